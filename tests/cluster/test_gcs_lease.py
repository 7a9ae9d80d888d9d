"""One writer per workdir in a bucket: a job resubmitted on another host while the
first still trains into the same ``gs://`` workdir is refused with one line naming the
first run; the first goes on, saves at SIGTERM and releases the lease object (created
and renewed under generation preconditions, which the emulator enforces as GCS does)."""

from __future__ import annotations

import re
import signal

from tests.cluster.runs import CONFIG, RUN_S, bucket_url, fetch, one_error_line, start, trainer_argv

FLAGS = ("--config.train.steps=2000", "--config.checkpoint.every_steps=50",
         "--config.telemetry.probe_every_windows=0")


def test_a_second_run_on_a_bucket_workdir_is_refused_and_the_first_releases_it(
        cluster, gcs, tmp_path):
    prefix = f"lease-{cluster.ports()[0]}"
    argv = trainer_argv(bucket_url(prefix), *FLAGS, config=CONFIG)
    first = start(cluster, gcs, 0, argv, env={"LAUNCH_TEST_SLOW_FROM": "0:0.1"})
    first.wait_for(r"^step \d+/2000", RUN_S)
    second = start(cluster, gcs, 1, argv)
    assert second.finish(RUN_S) == 1, second.output[-6000:]
    line = one_error_line(second.output)
    assert re.match(r"Workdir error: another run is writing to this workdir \(host \S+, "
                    rf"pid \d+, started .*; it holds {bucket_url(prefix)}/lease.json\)",
                    line), line
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish(RUN_S) == 143, first.output[-6000:]
    assert "a checkpoint of that step was saved" in first.output
    names = fetch(cluster, gcs, prefix, tmp_path)
    assert "lease.json" not in names and any(n.startswith("checkpoints/") for n in names), names
