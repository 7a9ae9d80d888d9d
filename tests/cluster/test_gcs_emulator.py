"""The tests' GCS is the emulator on the head node, and nothing else is reachable.

From a simulated host, TensorFlow's gs:// filesystem, tensorstore (what orbax writes
arrays with) and google-cloud-storage (what orbax asks for the bucket) all work against
the emulator (tests/cluster/gcs.py) under the real storage host names, every one of
their requests is in the emulator's log, and a connection to any address outside the
namespaces fails at once (no route out). Writes with generation preconditions (what
tensorstore and TensorFlow send) are answered as GCS answers them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.cluster.gcs import BUCKET
from tests.cluster.runs import connect

CLIENTS = Path(__file__).with_name("gcs_clients.py")


def test_every_client_reads_and_writes_the_bucket_through_the_emulator(cluster, gcs):
    host = cluster.hosts[0]
    prefix = f"smoke-{cluster.ports()[0]}"
    logged_before = len(gcs.requests())
    result = cluster.run(host, [sys.executable, CLIENTS, BUCKET, prefix], env=gcs.client_env(),
                         timeout=180)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {"read": "hello", "listdir": ["a.txt"], "after_rename": ["b.txt"],
                    "after_delete": [], "isdir": True, "tensorstore": [0.0, 1.0, 2.0, 3.0],
                    "bucket": BUCKET, "blobs": [f"{prefix}/zarr/.zarray", f"{prefix}/zarr/0"]}
    logged = gcs.requests()[logged_before:]
    assert logged and {r["client"] for r in logged} == {host.address}, logged
    mine = [f"{r['method']} {r['path']}" for r in logged if prefix in r["path"]]
    for expected in ("POST /upload/storage/v1/b/tfsim-bucket/o?uploadType=resumable",  # TF
                     "/rewriteTo/",  # tf.io.gfile.rename
                     "DELETE /storage/v1/b/tfsim-bucket/o/",  # tf.io.gfile.remove
                     f"{prefix}%2Fzarr%2F0",  # tensorstore's chunk
                     f"prefix={prefix}%2Fzarr%2F"):  # google-cloud-storage's listing
        assert any(expected in line for line in mine), (expected, mine)
    assert any(r["path"] == f"/storage/v1/b/{BUCKET}" for r in logged), logged  # get_bucket
    assert all(r["status"] < 500 for r in logged), logged


def test_no_route_leaves_the_simulated_hosts(cluster, gcs):
    for host in (cluster.hosts[0], cluster.head):
        routes = cluster.run(host, ["ip", "route", "show", "default"]).stdout
        assert routes.strip() == "", routes
        # A public address: the connection fails at once (no route), it does not time out.
        result = connect(cluster, host, "8.8.8.8", 443, timeout=10)
        assert result.returncode == 1 and "Network is unreachable" in result.stdout, result


PRECONDITIONS = """
import json, sys
from google.api_core import exceptions
from google.cloud import storage
blob = storage.Client().bucket(sys.argv[1]).blob(sys.argv[2])
blob.upload_from_string(b"first", if_generation_match=0)  # create only
seen = {}
try:
    blob.upload_from_string(b"second", if_generation_match=0)
except exceptions.PreconditionFailed:
    seen["create_again"] = 412
blob.reload()
first = blob.generation
blob.upload_from_string(b"third", if_generation_match=first)  # this generation only
try:
    blob.upload_from_string(b"stale", if_generation_match=first)
except exceptions.PreconditionFailed:
    seen["stale_generation"] = 412
seen["content"] = blob.download_as_bytes().decode()
print(json.dumps(seen))
"""


def test_generation_preconditions_are_answered_as_gcs_does(cluster, gcs):
    name = f"preconditions-{cluster.ports()[0]}/object"
    result = cluster.run(cluster.hosts[0], [sys.executable, "-c", PRECONDITIONS, BUCKET, name],
                         env=gcs.client_env(), timeout=120)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {"create_again": 412, "stale_generation": 412, "content": "third"}, seen
