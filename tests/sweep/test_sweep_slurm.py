"""The sweep as a job array on the REAL local Slurm (``--emit=slurm``): one trial per
array task, and a task warned before its time limit checkpoints its trial, requeues
itself and resumes the trial, counted once.

Needs the local Slurm (``tests/support/local_slurm.py``: skipped with the reason without
it, failed under ``CI=true``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.support.helpers import REPO
from tests.support.local_slurm import FINAL_STATES, require_slurm
from tests.sweep.runs import checkpoint_steps, long_trials, starts, status, sweep, wait_for

ARRAY_S = 300  # generous: two TensorFlow start-ups on 2 shared cores, and a requeue


def array_states(job: str) -> dict[str, str]:
    """``{array task id: JobState}`` of the array job ``job`` (``scontrol show job``)."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                           text=True, timeout=30)
    assert shown.returncode == 0, shown.stderr
    return {found["ArrayTaskId"]: found["JobState"]
            for found in (dict(re.findall(r"(\w+)=(\S*)", line))
                          for line in shown.stdout.splitlines() if line.strip())}


def started_trial(output: Path) -> str | None:
    """The trial an array task's output says it started (None: none yet)."""
    if not output.exists():
        return None
    found = re.search(r"^trial (\d{4}) started", output.read_text(errors="replace"), re.M)
    return found.group(1) if found else None


def test_a_job_array_runs_one_trial_per_task_and_a_warned_task_resumes_its_trial(tmp_path):
    require_slurm()
    root = tmp_path / "array"
    emitted = sweep(f"--workdir={root}", "--trials=2", "--parallel=2", "--emit=slurm",
                    *long_trials(3000))
    assert emitted.returncode == 0, emitted.stderr[-3000:]
    script = tmp_path / "sweep.sbatch"
    script.write_text(emitted.stdout)
    assert "#SBATCH --array=0-1%2" in emitted.stdout and "--one" in emitted.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    submitted = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", str(script)],
                               env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    try:
        # The last task: its job id is the array's (a requeue by that id would requeue
        # every task).
        trial = wait_for(lambda: started_trial(tmp_path / f"array-{job}_1.out"),
                         timeout=ARRAY_S)
        wait_for(lambda: checkpoint_steps(root / "trials" / trial), timeout=ARRAY_S)
        # What Slurm sends warning_s seconds before the time limit (--signal=B:USR1@S).
        subprocess.run(["scancel", "--batch", "--signal=USR1", f"{job}_1"], check=True,
                       timeout=30)
        deadline = time.monotonic() + ARRAY_S
        while not set(array_states(job).values()) <= FINAL_STATES:
            assert time.monotonic() < deadline, array_states(job)
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job], timeout=30)
    outputs = "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("array-*.out"))
    assert array_states(job) == {"0": "COMPLETED", "1": "COMPLETED"}, outputs[-6000:]
    other = "0001" if trial == "0000" else "0000"
    assert "requeueing array task" in outputs, outputs[-6000:]
    assert ", run 2" not in (tmp_path / f"array-{job}_0.out").read_text()  # only task 1 was
    assert f"trial {trial} resumed (resume #1)" in outputs, outputs[-6000:]
    assert {n: (r["state"], r["step"], r["resumed"]) for n, r in status(root).items()} == {
        trial: ("COMPLETE", "3000", "1"), other: ("COMPLETE", "3000", "0")}
    assert [starts(root / "trials" / f"{n}.log") for n in (trial, other)] == [2, 1]
