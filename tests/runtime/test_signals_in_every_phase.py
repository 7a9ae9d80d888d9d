"""SIGTERM/SIGINT end a real ``trainer.main`` (or doctor) process in every phase.

Each case makes one phase long on purpose (``tests.support.run_signals``: a sleeping hook, a
slow dataset, a sleeping callback), waits for the phase's marker line, sends a REAL
signal and expects the documented end: during training a checkpoint and exit 143;
during an eval pass the pass abandoned, a checkpoint and 143; in a phase with nothing
new to save an immediate exit with 128 + the signal; a second signal exits at once.
All cases run at once (one module fixture, one thread per process): the whole file
costs about one process start-up on 2 cores.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.support.helpers import REPO, last_lines, subprocess_env

CONFIG = f"--config={REPO / 'tests' / 'support' / 'run_signals.py'}"
HANG_S = 120  # a process still running this long after its signal hangs: the test fails
START_S = 600  # start-up bound (TensorFlow's import takes minutes on a loaded 2-core box);
# below pytest's own timeout (900 s), so a late process fails with its case's name, its
# output and the Python stacks of all its threads (faulthandler, on SIGABRT)
TERM, INT = signal.SIGTERM, signal.SIGINT
NOTHING_TO_SAVE = "no training step in progress, nothing new to save"

# case: (phase, command-line flags, signals sent one after the other)
CASES = {
    "start-up (build_model)": ("build_model", [], [TERM]),
    "building the input": ("input", [], [INT]),
    "first trace": ("first_trace", [], [TERM]),
    "training": ("train", ["--config.train.steps=100000"], [INT]),
    "eval pass": ("eval", ["--config.eval.every_steps=10"], [TERM]),
    "last eval pass": ("eval", ["--config.eval.every_steps=0", "--config.train.steps=10"],
                       [TERM]),
    "checkpoint save": ("checkpoint", [], [TERM]),
    "second signal": ("checkpoint", [], [TERM, INT]),
    "--mode=eval": ("build_model", ["--mode=eval"], [TERM]),
    "--mode=continuous_eval": ("", ["--mode=continuous_eval"], [TERM]),
    "doctor": ("build_model", ["--sections=baseline"], [INT]),
}


class SignalledRun:
    """One process: started at once, signalled (from a thread) when its marker shows."""

    def __init__(self, root, case: str):
        self.case = case
        phase, flags, self.signals = CASES[case]
        self.marker = f"PHASE {phase}" if phase else "continuous_eval: watching"
        module = "trainer.doctor" if case == "doctor" else "trainer.main"
        name = "".join(c if c.isalnum() else "_" for c in case)
        workdir = [] if case == "doctor" else [f"--workdir={root / name}"]
        env = subprocess_env()
        env.pop("TF_CONFIG", None)
        env["SIGNAL_TEST_PHASE"] = phase
        env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT prints every thread's stack
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, CONFIG, *workdir, *flags], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.signalled_at = self.ended_at = None
        self.started_at = time.monotonic()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.signalled_at is None and self.marker in line:
                self.signalled_at = time.monotonic()
                for i, sig in enumerate(self.signals):
                    if i:
                        time.sleep(0.5)  # the first one is being handled
                    self.proc.send_signal(sig)
        self.proc.wait()
        self.ended_at = time.monotonic()

    def finish(self) -> "SignalledRun":
        """Waits for the exit: fails when the marker never came within START_S of the
        start, or the process still runs HANG_S after its signal."""
        while self.thread.is_alive():
            self.thread.join(1.0)
            now = time.monotonic()
            late = (now - self.signalled_at > HANG_S if self.signalled_at is not None
                    else now - self.started_at > START_S)
            if late and self.thread.is_alive():
                self.proc.send_signal(signal.SIGABRT)  # the stacks, then the end
                self.thread.join(10.0)
                self.proc.kill()
                raise AssertionError(
                    f"{self.case!r}: {'no exit' if self.signalled_at else 'no marker'} in "
                    f"time:\n{self.output[-6000:]}")
        return self

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def seconds(self) -> float:
        return self.ended_at - self.signalled_at


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("signals")
    started = {case: SignalledRun(root, case) for case in CASES}
    finished = {case: run.finish() for case, run in started.items()}
    print("\nsignal -> exit (s): " + ", ".join(
        f"{case}: {run.seconds:.2f}" for case, run in finished.items()
        if run.signalled_at is not None))
    return finished


def _signalled(run: SignalledRun) -> None:
    assert run.signalled_at is not None, f"marker {run.marker!r} never printed:\n" \
                                         f"{run.output[-3000:]}"
    assert "Traceback" not in run.output, run.output[-3000:]


@pytest.mark.parametrize("case, sig", [("start-up (build_model)", "SIGTERM"),
                                       ("building the input", "SIGINT"),
                                       ("--mode=eval", "SIGTERM"),
                                       ("--mode=continuous_eval", "SIGTERM"),
                                       ("doctor", "SIGINT")])
def test_a_signal_where_nothing_new_can_be_saved_exits_at_once_with_128_plus_it(
        runs, case, sig):
    run = runs[case]
    _signalled(run)
    assert run.proc.returncode == 128 + signal.Signals[sig], run.output[-3000:]
    assert last_lines(run.output, 1) == (
        f"{sig}: {NOTHING_TO_SAVE}; exiting with {128 + signal.Signals[sig]}. Run the same "
        f"command again to resume from the last checkpoint."), run.output[-3000:]


@pytest.mark.parametrize("case, sig, step", [("first trace", "SIGTERM", 5),
                                             ("checkpoint save", "SIGTERM", 10)])
def test_a_signal_during_training_saves_the_step_it_stops_at_and_exits_143(
        runs, case, sig, step):
    run = runs[case]
    _signalled(run)
    assert run.proc.returncode == 143, run.output[-3000:]
    assert f"{sig}: saving a checkpoint at the next loop boundary" in run.output
    assert f"preempted at step {step}; a checkpoint of that step was saved" in run.output
    assert f"checkpoint of step {step} ->" in run.output


def test_sigint_during_a_long_training_stops_at_the_next_loop_with_a_checkpoint(runs):
    run = runs["training"]
    _signalled(run)
    assert run.proc.returncode == 143, run.output[-3000:]
    assert "SIGINT: saving a checkpoint at the next loop boundary" in run.output
    # Once: the command's own exit line (the console's event line says it too).
    stopped = [line for line in run.output.splitlines()
               if "preempted at step" in line and "a checkpoint of that step was saved" in line]
    assert len(stopped) == 1, run.output[-3000:]
    step = int(stopped[0].split("preempted at step ")[1].split(";")[0])
    assert 5 <= step < 100000 and step % 5 == 0  # a loop boundary, long before the end
    assert f"checkpoint of step {step} ->" in run.output


@pytest.mark.parametrize("case", ["eval pass", "last eval pass"])
def test_a_signal_during_an_eval_pass_abandons_it_then_saves_and_exits_143(runs, case):
    # Also in the last pass: training is over but its evaluation was not made, so 143 (a
    # sweep or a scheduler runs it again and the rerun evaluates), never 0 without it.
    run = runs[case]
    _signalled(run)
    assert run.proc.returncode == 143, run.output[-3000:]
    assert "eval at step 10: the eval pass was abandoned after" in run.output
    assert "preempted at step 10; a checkpoint of that step was saved" in run.output
    assert "checkpoint of step 10 ->" in run.output
    assert "result:" not in run.output


def test_a_second_signal_exits_at_once(runs):
    run = runs["second signal"]
    _signalled(run)
    assert run.proc.returncode == 130, run.output[-3000:]
    assert last_lines(run.output, 1) == "SIGINT again: exiting at once with 130."
    assert "preempted at step" not in run.output  # it did not wait for the save


def test_each_delivery_is_handled_once_whatever_order_the_channels_see_them():
    """SIGTERM then SIGINT: the watcher's pipe sees them in that order, Python's handler
    runs pending ones by signal number (SIGINT first). Whatever the interleaving, the
    first delivery of each is handled once and the other channel's copy is not."""
    from trainer.runtime.signals import Deliveries

    orders = [
        [("pipe", TERM), ("handler", INT), ("handler", TERM), ("pipe", INT)],
        [("pipe", TERM), ("pipe", INT), ("handler", INT), ("handler", TERM)],
        [("handler", TERM), ("pipe", TERM), ("pipe", INT), ("handler", INT)],
    ]
    for order in orders:
        deliveries = Deliveries()
        handled = [sig for channel, sig in order if deliveries.is_new(channel, sig)]
        assert sorted(handled) == sorted([TERM, INT]), order
    # The same signal twice is two deliveries: the second is new on either channel.
    deliveries = Deliveries()
    seen = [deliveries.is_new(c, TERM) for c in ("pipe", "handler", "handler", "pipe")]
    assert seen == [True, False, True, False]
