"""TFDS data in a bucket: two hosts file-shard it, the doctor reads it, on simulated hosts.

The module fixture prepares the digits TFDS dataset (:mod:`models.digits_tfds`) on a
host's local disk and uploads its files with google-cloud-storage to
``gs://BUCKET/PREFIX/tfds`` in the GCS emulator (tests/cluster/gcs.py). Then:

* two hosts with node-local disks only (one worker each, ``launch.multiworker`` per
  host) train the launcher tests' digits config with ``--config.data.data_dir`` in the
  bucket and ``--config.data.sharding=file``; ``LAUNCH_TEST_RECORD_FILES=1``
  (tests/launch_helpers/weights_trainer.py) records which TFRecord files each worker
  read: disjoint sets whose union is the split's train files;
* ``python -m trainer.doctor`` on a host measures the demo's input reading the bucket
  (the emulator's log shows the host fetching train files); the doctor writes nothing,
  so it takes no ``--workdir``: given one (a bucket), it answers one usage line (exit 2);
  a data_dir in a bucket it may not use is one line too (the start check,
  :func:`trainer.cli.check_data_dir`), not minutes of TensorFlow's retries.
"""

from __future__ import annotations

import json
import sys
import urllib.parse

import pytest

from models.digits_tfds import NUM_SHARDS
from tests.cluster.gcs import BUCKET, FORBIDDEN_BUCKET, GcsEmulator
from tests.cluster.hosts import SimulatedCluster
from tests.cluster.runs import (DIGITS, RUN_S, bucket_url, fetch, finish_all, one_error_line,
                                outputs, per_host, start, trainer_argv)
from tests.support.helpers import NO_TENSORFLOW_PRELUDE, REPO

# On a host: prepare the digits TFDS files in a local directory, upload every file to
# gs://BUCKET/PREFIX/tfds, print the train split's file names (JSON).
UPLOAD = """
import json, os, sys
from google.cloud import storage
from models import digits_tfds
local, bucket, prefix = sys.argv[1:]
builder = digits_tfds.prepare(local)
target = storage.Client().bucket(bucket)
for root, _, names in os.walk(local):
    for name in names:
        if name.endswith(".lock"):
            continue
        path = os.path.join(root, name)
        target.blob(f"{prefix}/tfds/{os.path.relpath(path, local)}").upload_from_filename(path)
print(json.dumps(builder.info.splits["train"].filenames))
"""
FILE_SHARDED = ["--config.data.sharding=file", "--config.train.steps=20",
                "--config.train.steps_per_loop=10", "--config.checkpoint.async_save=False"]


@pytest.fixture(scope="module")
def bucket_data(simulated_cluster: SimulatedCluster, gcs: GcsEmulator) -> tuple[str, list[str]]:
    """``(prefix, train file names)`` of the digits TFDS files uploaded to the bucket."""
    prefix = f"tfds-data-{simulated_cluster.ports()[0]}"
    local = simulated_cluster.hosts[0].scratch / prefix
    result = simulated_cluster.run(0, [sys.executable, "-c", UPLOAD, str(local), BUCKET, prefix],
                                   env=gcs.client_env(), timeout=RUN_S)
    train_files = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(train_files) >= 2, train_files
    return prefix, train_files


def test_a_first_run_prepares_the_tfds_data_in_the_bucket_and_writes_nothing_local(
        cluster, gcs, tmp_path):
    """An empty bucket data_dir: the digits demo prepares its TFRecord files there (the
    lock of the machine's first workers stays local, in the temp directory)."""
    prefix = f"tfds-fresh-{cluster.ports()[0]}"
    run = start(cluster, gcs, 1, trainer_argv(bucket_url(f"{prefix}/run"), *FILE_SHARDED,
                                              f"--config.data.data_dir={bucket_url(prefix)}/tfds"))
    assert run.finish(RUN_S) == 0, run.output[-6000:]
    names = fetch(cluster, gcs, f"{prefix}/tfds", tmp_path)
    assert sum("-train.tfrecord-" in n for n in names) == NUM_SHARDS, names
    assert "run/checkpoints/20/commit_success.txt" in fetch(cluster, gcs, prefix, tmp_path / "all")
    for root in (REPO, cluster.hosts[1].home, cluster.hosts[1].scratch):
        assert not (root / "gs:").exists(), root


def train_files_fetched(prefix: str, requests: list[dict]) -> dict[str, set]:
    """Client address -> names of the train TFRecord files under ``prefix``/tfds it GOT."""
    fetched: dict[str, set] = {}
    for request in requests:
        path = urllib.parse.unquote(request["path"])
        if request["method"] == "GET" and f"{prefix}/tfds/" in path and "-train.tfrecord" in path:
            fetched.setdefault(request["client"], set()).add(path.rsplit("/", 1)[1])
    return fetched


def test_two_hosts_read_disjoint_train_files_of_a_tfds_dataset_in_the_bucket(
        cluster, gcs, bucket_data, tmp_path):
    prefix, train_files = bucket_data
    workdir, seen = f"{prefix}/run", len(gcs.requests())
    runs = per_host(cluster, cluster.hosts[:2], 1, bucket_url(workdir),
                    [f"--config.data.data_dir={bucket_url(prefix)}/tfds", *FILE_SHARDED],
                    env={**gcs.client_env(), "LAUNCH_TEST_RECORD_FILES": "1"})
    assert finish_all(runs) == [0, 0], outputs(runs)
    names = fetch(cluster, gcs, workdir, tmp_path)
    assert "checkpoints/20/commit_success.txt" in names, names
    read = [set(json.loads((tmp_path / f"files-worker-{i}.json").read_text())) for i in (0, 1)]
    assert read[0] and read[1] and read[0].isdisjoint(read[1]), read
    assert read[0] | read[1] == set(train_files), (read, train_files)
    # The emulator served each host the train files its worker recorded, and only those.
    fetched = train_files_fetched(prefix, gcs.requests()[seen:])
    assert [fetched.get(host.address) for host in cluster.hosts[:2]] == read, fetched


def test_the_doctor_measures_the_input_read_from_the_bucket(cluster, gcs, bucket_data):
    prefix, train_files = bucket_data
    seen = len(gcs.requests())
    doctor = start(cluster, gcs, 0, [
        "python", "-m", "trainer.doctor", f"--config={DIGITS}",
        f"--config.data.data_dir={bucket_url(prefix)}/tfds", "--sections=baseline,input",
        "--steps", "10", "--time_budget_s", "60", "--json"])
    assert doctor.finish(RUN_S) == 0, doctor.output[-6000:]
    report = json.loads([line for line in doctor.lines if line.startswith("{")][-1])
    assert report["input"]["reads_files"] is True, report
    assert report["input"]["read_examples_per_s"] > 0, report
    assert report["baseline"]["steps"] == 10, report
    fetched = train_files_fetched(prefix, gcs.requests()[seen:])
    assert set(fetched) == {cluster.hosts[0].address}, fetched
    assert fetched[cluster.hosts[0].address] <= set(train_files), fetched


def test_the_doctor_given_a_bucket_workdir_says_in_one_line_it_takes_none(cluster, gcs):
    doctor = start(cluster, gcs, 0, ["python", "-m", "trainer.doctor", f"--config={DIGITS}",
                                     f"--workdir={bucket_url('doctor-workdir')}"])
    assert doctor.finish(RUN_S) == 2, doctor.output[-3000:]
    line = one_error_line(doctor.output, "Usage error: ")
    assert "unknown flag --workdir." in line and "takes no workdir (local or gs://)" in line, line


def test_the_doctor_on_a_data_dir_in_a_forbidden_bucket_says_so_in_one_line(cluster, gcs):
    """Said by the start check, before TensorFlow (whose import is made to fail here), not
    after minutes of TensorFlow's retries."""
    data_dir = f"gs://{FORBIDDEN_BUCKET}/tfds"
    doctor = start(cluster, gcs, 0, ["python", "-c", NO_TENSORFLOW_PRELUDE, "trainer.doctor",
                                     f"--config={DIGITS}", f"--config.data.data_dir={data_dir}"])
    assert doctor.finish(RUN_S) == 1, doctor.output[-3000:]
    assert "TENSORFLOW IMPORTED" not in doctor.output, doctor.output[-3000:]
    line = one_error_line(doctor.output, "Workdir error: ")
    assert line.startswith(f"Workdir error: --config.data.data_dir={data_dir}: this account may "
                           f"not use the bucket gs://{FORBIDDEN_BUCKET} (403: "), line
