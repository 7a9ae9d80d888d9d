"""The grace period after SIGTERM (``checkpoint.preemption_grace_s``): the checkpoint
always commits, and the run's records that cannot be written in time are dropped with
one warning so the process exits within the budget instead of waiting on them.

The stalled output is real: the run's ``metrics.jsonl`` is a named pipe nobody reads,
so the writer thread blocks on it for good (as a write to a bucket that stopped
answering does). The run SIGTERMs itself during step 13 (``CKPT_TEST_ACTION``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.support.helpers import REPO, subprocess_env
from trainer.checkpoint import inventory

CONFIG = f"--config={REPO / 'tests' / 'support' / 'run_checkpoint.py'}"
GRACE_S = 3


def test_a_preemption_with_stalled_telemetry_saves_then_drops_the_records_and_exits(tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    os.mkfifo(workdir / "metrics.jsonl")  # never read: every write to it blocks
    (tmp_path / "out").mkdir()
    env = {**subprocess_env(), "CKPT_TEST_OUT": str(tmp_path / "out"),
           "CKPT_TEST_ACTION": "term:12"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.run_checkpoint", CONFIG, f"--workdir={workdir}",
         f"--config.checkpoint.preemption_grace_s={GRACE_S}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    print(f"\n[measured] run with stalled telemetry, SIGTERM at step 13: exit after "
          f"{time.monotonic() - started:.1f} s in all (grace {GRACE_S} s)")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 143, output[-4000:]
    assert "preempted at step 15; a checkpoint of that step was saved" in output, output[-4000:]
    dropped = [line for line in output.splitlines() if "The grace period after the stop "
               "signal (checkpoint.preemption_grace_s=3 s) ran out with" in line]
    assert len(dropped) == 1 and "records not yet written to" in dropped[0], output[-4000:]
    states = {e.step: e.state for e in inventory.survey(str(workdir))}
    assert states.get(15) == inventory.COMPLETE, states
