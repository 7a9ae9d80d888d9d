"""Runs a sweep: trials taken from the study (Optuna ask/tell), P at a time.

Each of ``--parallel`` threads takes the next job and runs it as a subprocess
(:mod:`trainer.sweep.trials`), until the study holds ``--trials`` trials and none is left
to resume:

1. a trial to resume first (:meth:`trainer.sweep.claims.Claims.claim`: preempted by an
   earlier run, or left RUNNING by a sweep process that was killed; its orphaned
   ``trainer.main``, if one still runs here, is stopped first): run again in its own
   workdir, it resumes from its checkpoint, and its ``resumed`` count goes up;
2. else, while the study holds fewer than ``--trials`` trials, a new one (``ask``): its
   values sampled, its command printed.

The choice is made under ``DIR/claims.lock`` and the chosen trial's lock is held while
it runs (:mod:`trainer.sweep.claims`), so sweep processes sharing the study never run
one trial twice. With ``one`` (``--one``, a Slurm array task) the sweep takes a single
trial and ends with it.

``--trials N`` counts the study's trials, each run until it finishes: a preempted trial
is the same trial when it resumes, never a new one. The outcome of a run:

* pruned (its run wrote the step it was pruned at, :mod:`trainer.services.pruning`):
  PRUNED with the last value it reported, whatever its exit status; a pruned trial is
  finished, never resumed (one a killed sweep left RUNNING is told PRUNED when found);
* exit 0: the objective ``config.sweep.metric`` is read from its ``result:`` line and
  told (COMPLETE); a metric the run never reports ends the sweep in one line;
* preempted (143, :data:`trainer.sweep.trials.RESUMABLE`): released for a later run of
  the sweep (this one does not take it again; it exits 143 when it leaves one);
* exit 2 (a usage error in the command: the same for every trial): FAIL, and the sweep
  ends with that line;
* any other status: run again up to ``config.sweep.max_retries`` times (it resumes from
  its checkpoint if it wrote one), then FAIL with its last output line.

SIGTERM or SIGINT to the sweep: no new trial starts, every running trial gets one
SIGTERM (it checkpoints and exits 143), and the sweep exits 143; running it again
resumes them. A progress line is printed every :data:`PROGRESS_S` seconds.

The plan's views (:class:`View`: TensorBoard's HParams, MLflow's runs) are told when a
trial starts (their environment variables go to its process), when it completes, and
when the sweep ends.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Protocol

from tf_cluster.exit_codes import EXIT_PREEMPTED
from trainer.errors import EXIT_USAGE, ConfigError, UserError
from trainer.sweep import trials as trials_lib
from trainer.sweep.claims import Claims
from trainer.sweep.space import override
from trainer.sweep.study import HEARTBEAT_S, Study, owner_id, trial_process_alive

PROGRESS_S = 15.0
ORPHAN_WAIT_S = 90.0


class View(Protocol):
    """Where the sweep is shown besides its table (:mod:`trainer.sweep.hparams`,
    :mod:`trainer.sweep.mlflow_runs`), told of its trials from the sweep's threads."""

    def trial_starts(self, number: int, values: dict[str, Any], workdir: str,
                     resumed: bool) -> dict[str, str]:
        """Trial ``number`` starts (or resumes): environment variables for its process."""

    def trial_completed(self, number: int, results: dict[str, float]) -> None:
        """Trial ``number`` is COMPLETE; ``results``: every value its run reported."""

    def sweep_ends(self, code: int) -> None:
        """This run of the sweep ends with exit status ``code`` (1 after an error)."""


@dataclasses.dataclass
class Plan:
    """What every trial shares: the config file, the sweep's own overrides, the sampler,
    the views."""

    config_path: str
    passed: list[str]  # the sweep's --config. flags, passed to every trial
    sample: Callable[[Any], dict]  # Optuna trial -> {KEY: value}
    metric: str
    max_retries: int
    seed: int = 0  # config.sweep.seed: the sampler's (trainer.sweep.study.Study.ask)
    report_to: tuple[str, str] | None = None  # (storage URL, study): a pruner's trials report
    views: list[View] = dataclasses.field(default_factory=list)
    workers: int = 1  # > 1: each trial a local worker group (launch.multiworker)


class Sweep:
    """One run of ``python -m trainer.sweep`` over ``study`` (see the module docstring)."""

    def __init__(self, study: Study, plan: Plan, root: str, n_trials: int, parallel: int,
                 say: Callable[[str], None], one: bool = False):
        self.study, self.plan, self.root = study, plan, root
        self.n_trials, self.parallel, self.say = n_trials, parallel, say
        self.claims = Claims(root)
        self.jobs_left: int | None = 1 if one else None  # --one: a single trial
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.running: dict[int, subprocess.Popen | None] = {}
        self.preempted: set[int] = set()  # released by this run: not taken again
        self.error: BaseException | None = None
        self.begin = time.time()

    # ------------------------------------------------------------------ jobs
    def next_job(self) -> tuple[int, bool] | None:
        """``(trial number, resumed)`` of the next trial to run here, or None. Chosen
        under ``DIR/claims.lock`` (:mod:`trainer.sweep.claims`): another sweep process
        on the same study never takes the same trial, nor asks past ``--trials``."""
        with self.claims.choosing(), self.lock:
            if self.stopping.is_set() or self.jobs_left == 0:
                return None
            every = self.study.trials()
            for trial in every:
                number = trial.number
                if (number not in self.running and number not in self.preempted
                        and self.claims.claim(trial)):
                    self._stop_orphan(trial)
                    if self._pruned(number, None):  # before its sweep process ended
                        continue
                    attrs = trial.user_attrs
                    self.study.set(number, owner=owner_id(), heartbeat=time.time(),
                                   resumed=int(attrs.get("resumed", 0)) + 1)
                    return self._taken(number, True)
            if len(every) >= self.n_trials:
                return None
            return self._taken(self._ask(), False)

    def _taken(self, number: int, resumed: bool) -> tuple[int, bool]:
        self.running[number] = None
        if self.jobs_left is not None:
            self.jobs_left -= 1
        return number, resumed

    def _ask(self) -> int:
        trial = self.study.ask(self.plan.seed)
        if not self.claims.take(trial.number):  # a lock file left by a deleted study
            raise UserError(f"{self.root}: trial {trial.number:04d}'s lock is held by "
                            f"another process; is another study running in this --workdir?")
        try:
            values = self.plan.sample(trial)
        except Exception as error:
            self.claims.free(trial.number)
            self.study.finish(trial.number, error=str(error).splitlines()[0] if str(error)
                              else type(error).__name__)
            raise
        workdir = trials_lib.workdir_of(self.root, trial.number)
        argv = trials_lib.command(self.plan.config_path, workdir, self.plan.passed,
                                  [override(k, v) for k, v in values.items()],
                                  self.plan.workers)
        self.study.set(trial.number, owner=owner_id(), heartbeat=time.time(),
                       workdir=workdir, command=trials_lib.shell(argv), resumed=0,
                       retries=0, seconds=0.0, overrides=json.dumps(values))
        return trial.number

    def _stop_orphan(self, trial) -> None:
        """The trainer.main a killed sweep left running in this trial's workdir: one
        SIGTERM (it checkpoints), then wait for it (SIGKILL after ORPHAN_WAIT_S)."""
        if not trial_process_alive(trial):
            return
        pid = int(trial.user_attrs["pid"])
        self.say(f"trial {trial.number:04d}: its run (pid {pid}) outlived its sweep; "
                 f"stopping it to resume it")
        os.kill(pid, signal.SIGTERM)
        deadline = time.time() + ORPHAN_WAIT_S
        while trial_process_alive(trial) and time.time() < deadline:
            time.sleep(0.2)
        if trial_process_alive(trial):
            os.kill(pid, signal.SIGKILL)

    # ------------------------------------------------------------------ one trial
    def run_trial(self, number: int, resumed: bool) -> None:
        """Runs trial ``number`` until it finishes, is preempted or fails."""
        trial = self.study.trial(number)
        attrs = dict(trial.user_attrs)
        argv = trials_lib.shell_split(attrs["command"])
        if self.plan.report_to:
            argv += trials_lib.report_flags(*self.plan.report_to, number)
        verb = f"resumed (resume #{attrs.get('resumed')})" if resumed else "started"
        overrides = json.loads(attrs["overrides"])
        values = " ".join(f"{k}={v!r}" for k, v in overrides.items())
        self.say(f"trial {number:04d} {verb}: {values}\n  {attrs['command']}")
        env = {k: v for view in self.plan.views
               for k, v in view.trial_starts(number, overrides, attrs["workdir"], resumed).items()}
        retries = int(attrs.get("retries", 0))
        while True:
            attempt = trials_lib.run(argv, attrs["workdir"],
                                     lambda proc: self._started(number, proc), env)
            attrs["seconds"] = float(attrs.get("seconds", 0.0)) + attempt.seconds
            self.study.set(number, seconds=attrs["seconds"], step=attempt.step)
            if self._pruned(number, attempt):
                return None
            if attempt.status == 0:
                return self._completed(number, attempt)
            if attempt.preempted or self.stopping.is_set():
                return self._released(number, attempt)
            if attempt.status == EXIT_USAGE or retries >= self.plan.max_retries:
                self.study.finish(number, error=attempt.last_line)
                self.say(f"trial {number:04d} FAILED (exit {attempt.status}) after "
                         f"{retries + 1} run(s): {attempt.last_line}")
                if attempt.status == EXIT_USAGE:
                    raise UserError(f"trial {number:04d}'s command is refused: "
                                    f"{attempt.last_line}")
                return None
            retries += 1
            self.study.set(number, retries=retries)
            self.say(f"trial {number:04d} crashed (exit {attempt.status}): "
                     f"{attempt.last_line}; retry {retries} of {self.plan.max_retries}")

    def _started(self, number: int, process: subprocess.Popen) -> None:
        with self.lock:
            self.running[number] = process
            if self.stopping.is_set():
                trials_lib.stop(process)
        self.study.set(number, pid=process.pid)

    def _completed(self, number: int, attempt: trials_lib.Attempt) -> None:
        value = attempt.results.get(self.plan.metric)
        if value is None:
            reported = ", ".join(sorted(attempt.results)) or "nothing"
            message = (f"config.sweep.metric={self.plan.metric!r} is not a value the run of "
                       f"trial {number:04d} reports (it reported: {reported}); name one of "
                       f"those (eval/ values need an eval dataset).")
            self.study.finish(number, error=message)
            raise ConfigError(message)
        self.study.finish(number, value)
        for view in self.plan.views:
            view.trial_completed(number, attempt.results)
        self.say(f"trial {number:04d} finished: {self.plan.metric}={value:.6g} at step "
                 f"{attempt.step} ({attempt.seconds:.1f} s)")

    def _pruned(self, number: int, attempt: trials_lib.Attempt | None) -> bool:
        """Tells a trial its run pruned PRUNED, at the step every worker stopped at (after
        the pruned step when a gradient-accumulation window ended first); False when its
        run was not pruned."""
        step = self.study.pruned_at(number)
        if step is None:
            return False
        if attempt is not None and attempt.step is not None:
            step = attempt.step
        self.study.prune(number, step)
        value = self.study.trial(number).value  # None: its last value was not finite
        self.say(f"trial {number:04d} pruned at step {step}: {self.plan.metric}="
                 f"{value if value is None else f'{value:.6g}'}"
                 + (f" ({attempt.seconds:.1f} s)" if attempt else ""))
        return True

    def _released(self, number: int, attempt: trials_lib.Attempt) -> None:
        self.study.set(number, owner="")
        with self.lock:
            self.preempted.add(number)
        self.say(f"trial {number:04d} preempted at step {attempt.step} (exit "
                 f"{attempt.status}): run the sweep again to resume it from its checkpoint")

    # ------------------------------------------------------------------ the threads
    def _worker(self) -> None:
        try:
            while not self.stopping.is_set():
                job = self.next_job()
                if job is None:
                    return
                try:
                    self.run_trial(*job)
                finally:
                    with self.lock:
                        self.running.pop(job[0], None)
                    self.claims.free(job[0])
        except BaseException as error:  # noqa: BLE001 - the first error ends the sweep
            with self.lock:
                self.error = self.error or error
            self.stop()

    def stop(self) -> None:
        """No new trial; one SIGTERM to every running trial (they checkpoint, exit 143)."""
        with self.lock:
            if self.stopping.is_set():
                return
            self.stopping.set()
            processes = [p for p in self.running.values() if p is not None]
        for process in processes:
            trials_lib.stop(process)

    def run(self) -> int:
        """Runs the sweep; returns the exit status (0, 143 with trials left to resume)."""
        previous = {s: signal.signal(s, lambda *_: self.stop())
                    for s in (signal.SIGTERM, signal.SIGINT)}
        threads = [threading.Thread(target=self._worker, name=f"sweep-{i}", daemon=True)
                   for i in range(self.parallel)]
        for thread in threads:
            thread.start()
        last_progress = last_beat = time.time()
        try:
            while any(t.is_alive() for t in threads):
                for thread in threads:
                    thread.join(0.2)
                if time.time() - last_beat >= HEARTBEAT_S:
                    last_beat = time.time()
                    self._heartbeat()
                if time.time() - last_progress >= PROGRESS_S:
                    last_progress = time.time()
                    self.say(self.progress())
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        code = 1 if self.error is not None else (
            EXIT_PREEMPTED if self.preempted or self.stopping.is_set() else 0)
        for view in self.plan.views:
            view.sweep_ends(code)
        if self.error is not None:
            raise self.error
        self.say(self.progress())
        return code

    def _heartbeat(self) -> None:
        with self.lock:
            numbers = list(self.running)
        for number in numbers:
            self.study.beat(number)

    def progress(self) -> str:
        """``sweep NAME: 3/8 finished, 2 running (0004 at step 120, ...), ...``."""
        every = self.study.trials()
        done = [t for t in every if t.state.is_finished()]
        with self.lock:
            running = sorted(self.running)
        steps = ", ".join(
            f"{n:04d} at step {trials_lib.last_step(trials_lib.workdir_of(self.root, n))}"
            for n in running)
        complete = [t for t in done if t.state.name == "COMPLETE"]
        best = ""
        if complete:
            pick = max if self.study.optuna.direction.name == "MAXIMIZE" else min
            top = pick(complete, key=lambda t: t.value)
            best = f"; best {self.plan.metric}={top.value:.6g} (trial {top.number:04d})"
        left = f", {len(self.preempted)} preempted" if self.preempted else ""
        return (f"sweep {self.study.name}: {len(done)}/{self.n_trials} finished, "
                f"{len(running)} running{f' ({steps})' if steps else ''}{left}{best}; "
                f"{time.time() - self.begin:.0f} s")


def say(line: str) -> None:
    """Prints a sweep line on stderr (the trials' own output is in their logs)."""
    print(line, file=sys.stderr, flush=True)
