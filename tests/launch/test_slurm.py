"""The emitted sbatch script on a REAL Slurm: training, preemption + requeue, failure.

Needs a running Slurm cluster on this machine; ``sudo tests/slurm/start_local_slurm.sh``
starts a one-node one (Debian/Ubuntu packages, idempotent). Without it these tests skip
with the reason, except under ``CI=true``, where they fail: CI must run them.

Every job is ``python -m launch.multiworker --workers 2 --tasks_per_node 2 --emit slurm``
with the launcher tests' digits config (``tests/launch_helpers/weights_config.py``, 30
steps, final weights saved by ``WeightsTrainer``), submitted with ``sbatch``. The
reference is the same config in one process (the session fixture
``launcher_reference_weights``).

Measured (printed; run with ``-s`` to see them, never asserted): seconds from the
warning signal to the checkpoint committed, and from the requeue to the next run's
start, its restored checkpoint and its first training window (5 steps).
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from launch import local_group, multiworker
from tests.launch_helpers.running import REPO
from tests.support.helpers import assert_same_weights
from tests.support.local_slurm import FINAL_STATES, require_slurm

CONFIG = f"--config={os.path.join(REPO, 'tests', 'launch_helpers', 'weights_config.py')}"
JOB_S = 300  # generous bound for one job (two TensorFlow start-ups on 2 shared cores)
EXIT_PREEMPTED = 143  # checked literally: the code schedulers retry (128 + SIGTERM)


@pytest.fixture(scope="module")
def slurm():
    require_slurm()


def free_port_pair() -> int:
    """A port P such that P and P + 1 were both free on this machine a moment ago."""
    for _ in range(50):
        (port,) = local_group.pick_free_ports(1)
        if port >= 65535:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("found no two consecutive free ports")


class Job:
    """One emitted script, submitted with sbatch from ``tmp_path`` (its output goes there)."""

    def __init__(self, tmp_path, emit_args=(), flags=(), env_extra=None):
        self.dir = tmp_path
        self.workdir = tmp_path / "run"
        script = tmp_path / "job.sbatch"
        code = multiworker.main(["--workers", "2", "--tasks_per_node", "2", "--emit", "slurm",
                                 "--port", str(free_port_pair()), "--job_name", "t",
                                 "--output", str(script), *emit_args, CONFIG,
                                 f"--workdir={self.workdir}", *flags])
        assert code == 0
        self.script = script.read_text()
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("SLURM_")}
        env.update(PYTHONPATH=REPO, PYTHONUNBUFFERED="1", TZ="UTC",
                   PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
                   **(env_extra or {}))
        result = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", str(script)],
                                env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        self.id = result.stdout.strip().split(";")[0]
        self.out = tmp_path / f"t-{self.id}.out"

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def state(self) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
        result = subprocess.run(["scontrol", "show", "job", "-o", self.id], capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 0, f"scontrol show job {self.id}: {result.stderr}"
        return dict(re.findall(r"(\w+)=(\S*)", result.stdout))

    def _fail(self, message: str):
        subprocess.run(["scancel", self.id], timeout=30)
        raise AssertionError(f"job {self.id}: {message}; state {self.state()}; output:\n"
                             f"{self.output()[-6000:]}")

    def wait(self, timeout: float = JOB_S) -> dict[str, str]:
        """Waits for the job to end; returns its final state (cancels it on timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state()
            if state["JobState"] in FINAL_STATES:
                return state
            time.sleep(0.5)
        self._fail(f"still {self.state()['JobState']} after {timeout} s")

    def watch_for(self, pattern: str, timeout: float = JOB_S) -> float:
        """Polls the output until a line matches ``pattern``; returns when it was seen
        (``time.time()``, at most 0.2 s late). Fails if the job ends first."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern, re.M)
        while not regex.search(self.output()):
            if time.monotonic() > deadline or self.state()["JobState"] in FINAL_STATES:
                self._fail(f"no output line matching {pattern!r}")
            time.sleep(0.2)
        return time.time()

    def wait_for_file(self, path, timeout: float = JOB_S) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline or self.state()["JobState"] in FINAL_STATES:
                self._fail(f"{path.name} did not appear")
            time.sleep(0.2)


# Timestamps in the job output: the script's own lines and absl's (TZ=UTC for both).
_SCRIPT_TIME = r"^\[slurm-job (\d{4}-\d\d-\d\dT[\d:.]+)Z\] "
_ABSL_TIME = r"^[IWE]\d{4} ([\d:.]+) .*"


def _script_time(output: str, pattern: str) -> float:
    match = re.search(_SCRIPT_TIME + pattern, output, re.M)
    assert match, f"no script line matching {pattern!r}:\n{output[-6000:]}"
    return datetime.datetime.fromisoformat(match.group(1)).replace(
        tzinfo=datetime.timezone.utc).timestamp()


def _absl_time(output: str, pattern: str, day: float) -> float:
    match = re.search(_ABSL_TIME + pattern, output, re.M)
    assert match, f"no log line matching {pattern!r}:\n{output[-6000:]}"
    clock = datetime.datetime.strptime(match.group(1), "%H:%M:%S.%f").time()
    date = datetime.datetime.fromtimestamp(day, datetime.timezone.utc).date()
    return datetime.datetime.combine(date, clock, datetime.timezone.utc).timestamp()


def test_two_tasks_on_one_node_train_to_the_same_weights_as_one_process(
        slurm, launcher_reference_weights, tmp_path):
    job = Job(tmp_path)
    state = job.wait()
    output = job.output()
    assert state["JobState"] == "COMPLETED", output[-6000:]
    assert state["Restarts"] == "0"
    port = int(re.search(r"--port=(\d+)", job.script).group(1))
    # Each task derived its TF_CONFIG from SLURM: one node, local task i on port + i.
    assert f"'worker': ['localhost:{port}', 'localhost:{port + 1}']" in output, output[-6000:]
    for task in ("worker-0", "worker-1"):
        assert_same_weights(launcher_reference_weights, job.workdir / f"weights-{task}.npz")


def test_warning_signal_checkpoints_requeues_and_resumes(slurm, launcher_reference_weights,
                                                         tmp_path):
    # From input batch 10 on, the first run is slowed down: the signal lands mid-training.
    job = Job(tmp_path, env_extra={"LAUNCH_TEST_SLOW_FROM": "10:0.3"})
    job.wait_for_file(job.workdir / "slow-worker-0")
    # What SLURM sends --warning_s seconds before the time limit (#SBATCH --signal=B:USR1@S).
    subprocess.run(["scancel", "--batch", "--signal=USR1", job.id], check=True, timeout=30)
    # The first training window of the second run (its lines carry no timestamp).
    first_window_seen = job.watch_for(rf"\] job {job.id}, run 2,[\s\S]*^step \d+/30: ")
    state = job.wait()
    output = job.output()
    assert state["JobState"] == "COMPLETED", output[-6000:]
    assert state["Restarts"] == "1", output[-6000:]
    saved = re.search(r"preempted at step (\d+); a checkpoint of that step was saved\. .*"
                      rf"Exit code {EXIT_PREEMPTED}\.", output)
    assert saved, output[-6000:]
    step = int(saved.group(1))
    assert 0 < step < 30  # mid-training (the input pipeline runs ahead of the steps)
    # Both tasks exited 143; srun reports them in one line ("tasks 0-1") when they end
    # together, else one line each ("task 0", "task 1").
    exited = re.findall(rf"srun: error: localhost: tasks? ([\d-]+): Exited with exit code "
                        rf"{EXIT_PREEMPTED}", output)
    assert sorted(exited) in (["0-1"], ["0", "1"]), output[-6000:]
    assert "requeueing job" in output
    assert re.search(rf"resumed from step {step} \(", output), output[-6000:]
    assert "] job %s, run 2," % job.id in output
    # Exact resume: the same weights as the uninterrupted run.
    for task in ("worker-0", "worker-1"):
        assert_same_weights(launcher_reference_weights, job.workdir / f"weights-{task}.npz")

    warned = _script_time(output, r"warning signal \(USR1\)")
    committed = _absl_time(output, rf"checkpoint of step {step} -> .*checkpoints$", warned)
    requeued = _script_time(output, "the tasks saved a checkpoint .*: requeueing")
    second_run = output[output.rindex("\n", 0, output.index("] job %s, run 2," % job.id)) + 1:]
    resumed = _absl_time(second_run, r"resumed from step", requeued)
    first_window = re.search(r"^step (\d+)/30: ", second_run, re.M)
    assert first_window and int(first_window.group(1)) > step, second_run[-4000:]
    print(f"\n[measure] warning signal -> checkpoint of step {step} committed: "
          f"{committed - warned:.2f} s; requeue -> second run starts: "
          f"{_script_time(second_run, 'job ') - requeued:.2f} s; requeue -> resumed from the "
          f"checkpoint: {resumed - requeued:.2f} s; requeue -> first window of the resumed run "
          f"(step {first_window.group(1)}) seen: {first_window_seen - requeued:.2f} s")


def test_a_task_failing_for_another_reason_ends_the_job_failed_without_requeue(slurm, tmp_path):
    job = Job(tmp_path, env_extra={"LAUNCH_TEST_EXIT_AT_START": "worker:1"})
    state = job.wait()
    output = job.output()
    assert state["JobState"] == "FAILED", output[-6000:]
    assert state["Restarts"] == "0"
    assert state["ExitCode"] != "0:0"
    assert "injected exit at start" in output
    assert re.search(r"the tasks failed \(exit \d+\): not requeued", output), output[-6000:]
    assert "requeueing" not in output
