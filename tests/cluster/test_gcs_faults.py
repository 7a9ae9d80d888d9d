"""A bucket that is not there, not ours, not reachable or briefly failing: one clear
line, before TensorFlow starts, or training that goes through; nothing lost, no traceback.

The digits demo (``python -m trainer.main``) on a simulated host with the workdir in the
GCS emulator (tests/cluster/gcs.py). The start check (``trainer.checks.bucket``, before
TensorFlow's import) gives the line for a missing bucket (404), a forbidden one
(:data:`~tests.cluster.gcs.FORBIDDEN_BUCKET`, 403) and a host cut off the network
(no answer within ``TRAINER_BUCKET_CHECK_S``, 30 s). Those runs make an import of
TensorFlow fail loudly (``NO_TENSORFLOW_PRELUDE``): the line comes from the start check,
not after TensorFlow's start and retries (how long it takes is measured, not asserted).
Error answers the emulator injects
(:meth:`~tests.cluster.gcs.GcsEmulator.inject`) into the checkpoint writes are retried by
the clients (TensorFlow, tensorstore) and the run completes with every checkpoint.

Measured (printed with ``-s``): seconds from start to the line of each fault.
"""

from __future__ import annotations

import time

from tests.cluster.gcs import BUCKET, FORBIDDEN_BUCKET
from tests.cluster.runs import DIGITS, RUN_S, bucket_url, fetch, one_error_line, start, trainer_argv
from tests.support.helpers import NO_TENSORFLOW_PRELUDE

SHORT = ["--config.train.steps=20", "--config.train.steps_per_loop=10",
         "--config.checkpoint.every_steps=10", "--config.eval.every_steps=0"]
# TensorFlow's GCS retries: 1 s doubling by default; short here so the test stays short.
FAST_TF_RETRIES = {"GCS_RETRY_CONFIG_INIT_DELAY_TIME_US": "100000",
                   "GCS_RETRY_CONFIG_MAX_DELAY_TIME_US": "2000000"}


def refused(cluster, gcs, host, workdir: str) -> tuple[str, float]:
    """Runs the demo on ``workdir`` with an import of TensorFlow made to fail: (its one
    Workdir error line, seconds to it). The exit ends the wait, RUN_S is only a guard."""
    started = time.monotonic()
    proc = start(cluster, gcs, host, ["python", "-c", NO_TENSORFLOW_PRELUDE, "trainer.main",
                                      f"--config={DIGITS}", f"--workdir={workdir}", *SHORT])
    assert proc.finish(RUN_S) == 1, proc.output[-3000:]
    assert "TENSORFLOW IMPORTED" not in proc.output, proc.output[-3000:]
    return one_error_line(proc.output), proc.exited_at - started


def writes_to(gcs, bucket: str, since: int) -> list[dict]:
    return [r for r in gcs.requests()[since:]
            if r["method"] in ("POST", "PUT", "DELETE") and f"/b/{bucket}/" in r["path"]]


def test_a_bucket_that_does_not_exist_is_one_line_naming_it(cluster, gcs):
    logged = len(gcs.requests())
    line, seconds = refused(cluster, gcs, 0, "gs://tfsim-no-such-bucket/run")
    print(f"\n[measured] 404 bucket: the line after {seconds:.1f} s")
    assert line.startswith("Workdir error: --workdir=gs://tfsim-no-such-bucket/run: the bucket "
                           "gs://tfsim-no-such-bucket does not exist (404)."), line
    assert "gcloud storage buckets create gs://tfsim-no-such-bucket" in line
    assert not writes_to(gcs, "tfsim-no-such-bucket", logged)


def test_a_bucket_this_account_may_not_use_is_one_line_naming_it(cluster, gcs):
    logged = len(gcs.requests())
    line, seconds = refused(cluster, gcs, 0, f"gs://{FORBIDDEN_BUCKET}/run")
    print(f"\n[measured] 403 bucket: the line after {seconds:.1f} s")
    assert line.startswith(f"Workdir error: --workdir=gs://{FORBIDDEN_BUCKET}/run: this account "
                           f"may not use the bucket gs://{FORBIDDEN_BUCKET} (403: "), line
    assert "roles/storage.objectAdmin" in line
    assert not writes_to(gcs, FORBIDDEN_BUCKET, logged)


def test_a_host_cut_off_from_the_bucket_is_one_line_after_the_checks_timeout(cluster, gcs):
    host = cluster.hosts[1]
    prefix = f"cut-{cluster.ports()[0]}"
    logged = len(gcs.requests())
    cluster.partition(host)
    line, seconds = refused(cluster, gcs, host, bucket_url(prefix))
    print(f"\n[measured] host cut off: the line after {seconds:.1f} s")
    assert line.startswith(f"Workdir error: --workdir={bucket_url(prefix)}: the bucket "
                           f"gs://{BUCKET} could not be reached within 30 s"), line
    assert "TRAINER_BUCKET_CHECK_S=SECONDS waits longer" in line
    assert not [r for r in gcs.requests()[logged:] if r["client"] == host.address]


def test_error_answers_during_checkpoint_writes_are_retried_and_the_run_completes(
        cluster, gcs, tmp_path):
    prefix = f"unavailable-{cluster.ports()[0]}"
    gcs.inject(503, count=6, path_contains=f"{prefix}%2Fcheckpoints%2F")
    proc = start(cluster, gcs, 0, trainer_argv(bucket_url(prefix), *SHORT), env=FAST_TF_RETRIES)
    assert proc.finish(RUN_S) == 0, proc.output[-6000:]
    assert "Traceback" not in proc.output, proc.output[-6000:]
    answered = [r for r in gcs.requests() if prefix in r["path"]]
    assert sum(r["status"] == 503 for r in answered) == 6, answered  # every one was met
    names = fetch(cluster, gcs, prefix, tmp_path)
    for step in (10, 20):
        assert f"checkpoints/{step}/commit_success.txt" in names, names
        assert f"checkpoints/{step}/state/crc32c.json" in names, names
    assert f"checkpoint={bucket_url(prefix)}/checkpoints/20" in proc.output



def test_a_bucket_refusing_checkpoint_writes_mid_run_is_one_storage_line(cluster, gcs):
    """The start check passes (the bucket answers); then every checkpoint write is
    refused (403: a role changed, a retention lock): a warning at the first, one
    'Storage error' line naming the step, the cause and the fix at the second."""
    prefix = f"refused-writes-{cluster.ports()[0]}"
    gcs.inject(403, count=100000, path_contains=f"{prefix}%2Fcheckpoints%2F",
               methods=("POST", "PUT"))
    proc = start(cluster, gcs, 0, trainer_argv(bucket_url(prefix), *SHORT), env=FAST_TF_RETRIES)
    assert proc.finish(RUN_S) == 1, proc.output[-6000:]
    line = one_error_line(proc.output, prefix="Storage error: ")
    assert line.startswith(f"Storage error: cannot write the checkpoint of step 20 to "
                           f"{bucket_url(prefix)}/checkpoints: the storage refused the write "
                           f"(403: this account may not write there); the last good "
                           f"checkpoint is none"), line
    assert "roles/storage.objectAdmin" in line and "starts from step 0" in line, line
    assert "{" not in line and "https://" not in line, line  # no response body, no URL
    gcs.inject(403, count=0, path_contains=prefix)
