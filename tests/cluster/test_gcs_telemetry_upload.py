"""The run's records in a bucket cost the bytes they hold, not their square.

TensorFlow's GCS file system uploads a whole file at every flush of a file opened for
append; the records were flushed at every logging window, so metrics.jsonl and the
event files were uploaded again and again (quadratic in the run's length). Now each
flush composes only the new bytes onto the object (trainer.telemetry.object_append).

Measured on the emulator's request log: the same run twice on one host, with the
records and without (``telemetry.loggers``), the difference being what the records
cost; it must stay within a small multiple of what they hold at the end (plus a few
hundred bytes of request metadata per flush). The fetched files read back whole.
"""

from __future__ import annotations

import json
import os

from tests.cluster.runs import CONFIG, RUN_S, bucket_url, fetch, start, trainer_argv

STEPS, EVERY = 200, 5
FLAGS = (f"--config.train.steps={STEPS}", f"--config.train.steps_per_loop={EVERY}",
         f"--config.train.log_every_steps={EVERY}", "--config.checkpoint.every_steps=0",
         "--config.telemetry.probe_every_windows=0")
OVERHEAD_PER_FLUSH = 4096  # request metadata of one part upload, compose and delete


def uploaded(gcs, host, since: int) -> int:
    return sum(r.get("bytes", 0) for r in gcs.requests()[since:]
               if r["client"] == host.address and r["method"] in ("POST", "PUT"))


def run_and_measure(cluster, gcs, host, prefix: str, *flags: str) -> int:
    since = len(gcs.requests())
    proc = start(cluster, gcs, host, trainer_argv(bucket_url(prefix), *FLAGS, *flags,
                                                 config=CONFIG))
    assert proc.finish(RUN_S) == 0, proc.output[-6000:]
    return uploaded(gcs, host, since)


def test_records_in_a_bucket_are_uploaded_once_not_at_every_flush(cluster, gcs, tmp_path):
    host = cluster.hosts[0]
    port = cluster.ports()[0]
    with_records = run_and_measure(cluster, gcs, host, f"records-{port}")
    without = run_and_measure(cluster, gcs, host, f"no-records-{port}",
                              "--config.telemetry.loggers=()")
    names = fetch(cluster, gcs, f"records-{port}", tmp_path)
    record_files = [n for n in names if n == "metrics.jsonl" or "tfevents" in n]
    held = sum(os.path.getsize(tmp_path / n) for n in record_files)
    cost = with_records - without
    windows = STEPS // EVERY
    print(f"\n[measured] records of {STEPS} steps ({windows} windows): {held:,} bytes held, "
          f"{cost:,} bytes uploaded ({cost * 1000 / STEPS:,.0f} per 1,000 steps)")
    assert not any(".part-" in n for n in names), names  # parts composed and deleted
    assert cost <= 2 * held + 3 * windows * OVERHEAD_PER_FLUSH, (cost, held)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r.get("kind") == "train"]
    assert steps == list(range(EVERY, STEPS + 1, EVERY)), steps
