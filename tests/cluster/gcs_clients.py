"""Every client the trainer uses for gs://, once each, on ``gs://BUCKET/PREFIX``.

``python tests/cluster/gcs_clients.py BUCKET PREFIX`` (on a simulated host, with
:meth:`tests.cluster.gcs.GcsEmulator.client_env`) prints one JSON object: what each
client read back. Run by tests/cluster/test_gcs_emulator.py.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import tensorflow as tf
import tensorstore as ts
from google.cloud import storage


def main(bucket: str, prefix: str) -> None:
    root = f"gs://{bucket}/{prefix}"
    gfile = tf.io.gfile
    gfile.makedirs(f"{root}/dir")
    with gfile.GFile(f"{root}/dir/a.txt", "w") as f:
        f.write("hello")
    seen = {"read": gfile.GFile(f"{root}/dir/a.txt").read(),
            "listdir": sorted(gfile.listdir(f"{root}/dir"))}
    gfile.rename(f"{root}/dir/a.txt", f"{root}/dir/b.txt")
    seen["after_rename"] = sorted(gfile.listdir(f"{root}/dir"))
    gfile.remove(f"{root}/dir/b.txt")
    seen["after_delete"] = sorted(gfile.listdir(f"{root}/dir"))
    seen["isdir"] = gfile.isdir(f"{root}/dir")
    array = ts.open({"driver": "zarr", "kvstore": {"driver": "gcs", "bucket": bucket,
                                                   "path": f"{prefix}/zarr/"}},
                    create=True, dtype=ts.float32, shape=[4]).result()
    array.write(np.arange(4, dtype=np.float32)).result()
    seen["tensorstore"] = array.read().result().tolist()
    client = storage.Client()
    seen["bucket"] = client.get_bucket(bucket).name
    seen["blobs"] = sorted(b.name for b in client.list_blobs(bucket, prefix=f"{prefix}/zarr/"))
    print(json.dumps(seen))


if __name__ == "__main__":
    main(*sys.argv[1:])
