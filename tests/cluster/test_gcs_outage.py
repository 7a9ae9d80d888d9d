"""A bucket that stops answering mid-run, during an async save.

The host training into ``gs://`` loses its network right after a checkpoint was issued,
and gets it back once the run printed :data:`OUTAGE_STEPS` more steps (~30 s: its input
gives 2 steps/s); a run blocked on the bucket prints none, and the wait for them fails
after a generous guard. Training must go on meanwhile (telemetry
writes and saves to the bucket are off the training thread; a save due while the
previous one is still being written is deferred), the stalled save is completed or
reported once, and every checkpoint the bucket holds afterwards verifies: a partial one
is never adopted by the run that resumes from it.
"""

from __future__ import annotations

import re
import time

from tests.cluster.gcs import BUCKET
from tests.cluster.hosts import Watched
from tests.cluster.runs import CONFIG_FLAG

OUTAGE_STEPS = 60  # steps trained while the host is cut off (12 saves due meanwhile)
RUN_S = 600
STEPS = 80


def steps_printed(watched: Watched, since: float) -> list[int]:
    """The steps of the progress lines printed (``step N/M``) after ``since``."""
    return [int(m.group(1)) for t, line in watched.timed_lines if t >= since
            for m in [re.match(r"step (\d+)/\d+: ", line)] if m]


def test_training_goes_on_while_the_bucket_is_unreachable_and_adopts_no_partial_save(
        cluster, gcs):
    host = cluster.hosts[0]
    workdir = f"gs://{BUCKET}/outage-{cluster.ports()[0]}"
    flags = [CONFIG_FLAG, f"--workdir={workdir}", f"--config.train.steps={STEPS}",
             "--config.train.steps_per_loop=1", "--config.train.log_every_steps=1",
             "--config.checkpoint.every_steps=5"]
    env = {**gcs.client_env(), "LAUNCH_TEST_SLOW_FROM": "0:0.5"}  # 2 steps/s
    run = Watched(cluster.popen(host, ["python", "-m", "trainer.main",
                                       *flags], env=env))
    issued = int(run.wait_for(r"checkpoint of step (\d+) -> .*\(async\)", RUN_S).group(1))
    cluster.partition(host)
    # Counted from the last step read once the host is cut off, not from the save's
    # line: the run goes on while this thread wakes up and cuts (4 steps once, here).
    cut = time.monotonic()
    last = max(steps_printed(run, 0), default=issued)
    # The event: training printed its steps while the host stays cut off.
    run.wait_for(rf"^step {last + OUTAGE_STEPS}/", RUN_S)
    during, outage_s = steps_printed(run, cut), time.monotonic() - cut
    cluster.heal(host)
    status = run.finish(RUN_S)
    output = run.output
    assert status == 0, output[-6000:]
    assert len(during) >= OUTAGE_STEPS, (during, output[-6000:])
    assert "Traceback" not in output, output[-6000:]
    assert len(re.findall(r"could not be saved|Storage error", output)) <= 1, output[-6000:]
    listing = cluster.run(host, ["python", "-m", "trainer.checkpoint.show",
                                 f"--workdir={workdir}"], env=gcs.client_env(), timeout=300)
    rows = [line.split() for line in listing.stdout.splitlines()
            if re.match(r"\d+ ", line)]
    assert rows and all(row[1] in ("complete", "incomplete") for row in rows), listing.stdout
    assert int(rows[0][0]) == STEPS and rows[0][1] == "complete", listing.stdout
    assert any(int(row[0]) >= issued for row in rows if row[1] == "complete"), listing.stdout
    resumed = cluster.run(host, ["python", "-m", "trainer.main",
                                 *flags, f"--config.train.steps={STEPS + 5}"],
                          env=gcs.client_env(), timeout=RUN_S)
    said = resumed.stdout + resumed.stderr
    assert re.search(rf"resumed from step {STEPS} \(", said), said[-6000:]
    print(f"\n[measured] the outage lasted {outage_s:.0f} s ({len(during)} steps "
          f"printed during it); saves skipped: {output.count(' skipped: the save of step')}")
