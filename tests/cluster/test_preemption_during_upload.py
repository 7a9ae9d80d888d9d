"""A spot VM's notice while the previous checkpoint is still being uploaded.

The digits launcher config saves every loop (every 5 steps, as the defaults do: a stop
always lands on a save step) into the emulator's bucket. Right after a save is issued
the host loses the bucket (its network is cut), so that upload stalls; the next
periodic save waits for it, then is skipped ("checkpoint of step N skipped"), and the
SIGTERM comes right then: the stop's step is a save step whose periodic save is skipped
too. Before the fix the stop found its step "already saved" and wrote nothing, yet said
"a checkpoint of that step was saved": thousands of steps lost on a real run. Now the
stop's save waits for the stalled upload (the bucket comes back 3 s after the signal),
writes its own step, checks it committed, and only then says so; the step is in the
bucket, complete, and a restart resumes from it.
"""

from __future__ import annotations

import re
import signal
import time

from tests.cluster.gcs_runs import RUN_S, bucket_url, start, trainer_argv
from tests.support.helpers import REPO

CONFIG = REPO / "tests" / "launch_helpers" / "weights_config.py"
STEPS = 60
FLAGS = (f"--config.train.steps={STEPS}", "--config.checkpoint.every_steps=5",
         "--config.telemetry.probe_every_windows=0")
SLOW = {"LAUNCH_TEST_SLOW_FROM": "0:0.3"}  # 1.5 s per loop of 5 steps


def test_a_preemption_while_an_upload_stalls_saves_its_step_and_says_so_truthfully(
        cluster, gcs):
    host = cluster.hosts[0]
    workdir = bucket_url(f"upload-stall-{cluster.ports()[0]}")
    argv = trainer_argv(workdir, *FLAGS, config=CONFIG)
    run = start(cluster, gcs, host, argv, env=SLOW)
    run.wait_for(r"checkpoint of step 10 -> .*\(async\)", RUN_S)
    cluster.partition(host)
    try:
        skipped = int(run.wait_for(r"checkpoint of step (\d+) skipped", RUN_S).group(1))
        run.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(3)
    finally:
        cluster.heal(host)
    status = run.finish(RUN_S)
    print(f"\n[measured] SIGTERM -> exit {time.monotonic() - signalled:.1f} s (the bucket "
          f"back after 3 s)")
    output = run.output
    assert status == 143, output[-6000:]
    stopped = int(re.search(r"preempted at step (\d+); a checkpoint of that step was saved\. "
                            r"Its files are committed and checked", output).group(1))
    assert stopped >= skipped and stopped % 5 == 0, output[-6000:]
    assert "Traceback" not in output, output[-6000:]

    listing = cluster.run(host, ["python", "-m", "trainer.checkpoint.inspect",
                                 f"--workdir={workdir}"], env=gcs.client_env(), timeout=300)
    states = {int(row[0]): row[1] for row in map(str.split, listing.stdout.splitlines())
              if row and row[0].isdigit()}
    assert states.get(stopped) == "complete" and max(states) == stopped, listing.stdout

    resumed = start(cluster, gcs, host, [*argv, f"--config.train.steps={stopped + 5}"])
    assert resumed.finish(RUN_S) == 0, resumed.output[-6000:]
    assert f"resumed from step {stopped} (" in resumed.output, resumed.output[-6000:]
