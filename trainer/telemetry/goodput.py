"""Goodput: where a run's wall time went, over every restart of its workdir.

The categories of Google's ML goodput (ml-goodput-measurement), for one attempt (a
process running ``fit()``), from the process's start:

* program startup: process start -> the Trainer built (imports, strategy, model);
* training prep: Trainer built -> the first train loop, and the first loop call's time
  beyond its steps at the run's steady seconds per step (dataset, tracing, compiling,
  the execution plan's trials);
* checkpoint restore: the restore's reading, checking and assigning
  (``run.last_resume.seconds``; a rollback's restore too);
* checkpoint save: the time the loop waited in saves (the checkpoint service's
  ``blocking_s``: the host copy, and a previous save's commit when one is due; the
  background part of an async save is not counted);
* evaluation: the periodic and final evaluations (the evaluation service's ``seconds``);
* data loading wait: each logging window's loop time (a fit's first call aside) times
  the input-wait fraction telemetry judged for it (``perf/input_wait_fraction``; a
  window without one: 0);
* productive training: the train loop calls' time, less the above parts of it;
* other: the rest (logging, the host between loop calls, the time between ``fit()``
  calls of one process).

Across attempts (:mod:`trainer.telemetry.goodput_record`): wasted progress (the steps
an attempt recorded past the checkpoint the next one resumed from, at the seconds per
step it measured; moved out of its productive time) and infrastructure recovery (from
an attempt's last record to the next one's process start). Goodput = productive / wall
time from the first attempt's start to the last record.

The chief of a run with a workdir records its attempt in ``workdir/goodput.json`` at
every logging window and every checkpoint (on a background thread, coalesced; never
after a stop signal, so a stop's save keeps the bucket's requests for itself) and at
the end of a ``fit()`` that was not preempted: a SIGKILLed attempt's record is as recent
as its last window or checkpoint. At the end of ``fit()`` the sum over every attempt is
reported as the run's ``goodput`` event (:mod:`trainer.run_context`): a table on the
console, a ``metrics.jsonl`` record and ``goodput/...`` TensorBoard scalars (telemetry).

It is a service and a telemetry sink (its ``write`` gets every window record).
Contexts: host; the record's writes on one background thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import psutil
from absl import logging

from trainer.run_context import RunContext, RunEvents, Service
from trainer.runtime import signals
from trainer.telemetry import goodput_record
from trainer.telemetry.object_append import upload_errors


def process_start() -> float:
    """This process's start (Unix seconds): ``psutil.Process().create_time()``, whose
    boot time is in whole seconds (up to a second early), made exact to the clock tick
    by the boot-time clock where there is one (Linux)."""
    created = psutil.Process().create_time()
    if not hasattr(time, "CLOCK_BOOTTIME"):
        return created
    since_boot = created - psutil.boot_time()
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + since_boot


class LatestWriter:
    """Writes the latest of the values handed over, on a background thread that runs
    while there is something to write: a value handed over while a write runs replaces
    any waiting one (never a queue)."""

    def __init__(self, write: Callable[[Any], None]):
        self._write = write
        self._lock = threading.Lock()
        self._latest: Any = None
        self._running = False
        self._threads: list[threading.Thread] = []

    def put(self, value: Any) -> None:
        with self._lock:
            self._latest = value
            if not self._running:
                self._running = True
                thread = threading.Thread(target=self._drain, daemon=True, name="goodput")
                self._threads.append(thread)
                thread.start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                value, self._latest = self._latest, None
                if value is None:
                    self._running = False
                    return
            self._write(value)

    def flush(self) -> None:
        """Returns once every value handed over is written and the thread has ended."""
        with self._lock:
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join()


class Goodput(Service):
    """Accounts this process's time and keeps the workdir's goodput record (see the
    module docstring).

    Args:
      workdir, chief: the run's; inactive without a workdir or off the chief.
      events: the run's events (the ``goodput`` event is reported there).
      saves: the services that save (the checkpoint service, the local tier's): their
        ``blocking_s``, summed.
      evaluation: the evaluation service (its ``seconds``).
    """

    def __init__(self, workdir: str | None, chief: bool, events: RunEvents,
                 saves: Sequence[Any], evaluation: Any):
        self.enabled = bool(workdir) and chief
        self.events, self.saves, self.evaluation = events, saves, evaluation
        self.start = process_start()
        now = time.time()
        self.seconds = dict.fromkeys(goodput_record.MEASURED, 0.0)
        self.seconds["program_startup"] = now - self.start
        self._cursor, self._phase = now, "training_prep"
        self._seen = {"save": 0.0, "eval": 0.0}
        self._resume: Any = None
        self._file: goodput_record.RecordFile | None = None
        self._writer: LatestWriter | None = None
        self._previous: list[dict] = []
        self._attempt: dict[str, Any] | None = None  # from the first fit() on
        self._loop_s = self._window_s = 0.0  # loop time not yet accounted / in the window
        self._firsts: list[tuple[int, float]] = []  # (steps, seconds) of each fit's 1st call
        self._steady = [0, 0.0]  # steps and seconds of the other calls
        self._last_step, self._fit_calls = 0, 0

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, run: RunContext) -> None:
        if not self.enabled:
            return
        if self._attempt is None:
            self._open(run)
        self._account(run)
        self._phase, self._fit_calls = "training_prep", 0

    def _open(self, run: RunContext) -> None:
        """The first ``fit()`` of this process: the record so far, and this attempt."""
        self._file = goodput_record.RecordFile(run.workdir)
        try:
            self._previous = self._file.read()
        except (OSError, ValueError, KeyError, TypeError, *upload_errors()) as error:
            logging.warning("goodput: %s cannot be read (%s: %s); this attempt starts a new "
                            "record.", self._file.path, type(error).__name__, error)
        self._writer = LatestWriter(self._persist)
        previous = self._previous[-1] if self._previous else None
        self._attempt = {"start": self.start, "restored_step": run.step,
                         **goodput_record.follow(previous, self.start, run.step)}
        self._last_step = run.step

    def on_loop_end(self, run: RunContext) -> None:
        self._boundary(run)

    def on_log(self, run: RunContext, logs: dict[str, float]) -> None:
        self._boundary(run)  # before telemetry's: its window record is this step's

    def _boundary(self, run: RunContext) -> None:
        """After a loop call (once, from whichever hook comes first): its time, and the
        time since the last boundary."""
        if self.enabled:
            self._take_loop(run)
            self._account(run)
            self._phase = "other"

    def write(self, record: dict[str, Any]) -> None:
        """Telemetry sink: a window's input wait; the record is written."""
        if not self.enabled or record["kind"] != "train":
            return
        wait = record.get("perf/input_wait_fraction")
        self.seconds["data_loading"] += (wait or 0.0) * self._window_s
        self._window_s = 0.0
        self._save_later()

    def on_checkpoint(self, run: RunContext, step: int) -> None:
        stopping = run.stopped_by == "preemption" or signals.seconds_since_signal() is not None
        if self.enabled and not stopping:  # a stop's save: the record stays as it was
            self._account(run)
            self._save_later()

    def on_fit_end(self, run: RunContext, logs: dict[str, float]) -> None:
        if not self.enabled or self._attempt is None:
            return
        self._account(run)
        self._phase = "other"  # until a next fit() starts
        attempts = [*self._previous, self._snapshot()]
        if run.stopped_by != "preemption":
            self._writer.put(attempts)
            self._writer.flush()
        self.events.emit("goodput", run.step,
                         **goodput_record.scalars(goodput_record.summary(attempts)))

    # ------------------------------------------------------------- accounting
    def _take_loop(self, run: RunContext) -> None:
        """The loop call that just ended, once."""
        if run.step != self._last_step:
            steps, seconds = run.last_loop
            self._last_step = run.step
            if self._fit_calls == 0:  # its excess is training prep, never input wait
                self._firsts.append((steps, seconds))
            else:
                self._steady[0] += steps
                self._steady[1] += seconds
                self._window_s += seconds
            self._fit_calls += 1
            self._loop_s += seconds

    def _account(self, run: RunContext) -> None:
        """The time since the last call, by category: what the services measured
        (saves, evaluations, restores), the loop calls, and the rest in the phase (the
        preparation until a fit's first loop, "other" after)."""
        now = time.time()
        saved_s = sum(s.blocking_s for s in self.saves)
        parts = {"checkpoint_save": saved_s - self._seen["save"],
                 "evaluation": self.evaluation.seconds - self._seen["eval"],
                 "checkpoint_restore": 0.0}
        self._seen = {"save": saved_s, "eval": self.evaluation.seconds}
        if run.last_resume is not None and run.last_resume is not self._resume:
            self._resume = run.last_resume
            parts["checkpoint_restore"] = run.last_resume.seconds
        for category, value in parts.items():
            self.seconds[category] += value
        self.seconds[self._phase] += now - self._cursor - sum(parts.values()) - self._loop_s
        self._cursor, self._loop_s = now, 0.0
        self._attempt["last_step"], self._attempt["last_time"] = run.step, now

    def _snapshot(self) -> dict[str, Any]:
        """This attempt's entry now: the loop time split into productive time and the
        first calls' excess over the steady seconds per step (training prep)."""
        steps = self._steady[0] + sum(n for n, _ in self._firsts)
        loop_s = self._steady[1] + sum(s for _, s in self._firsts)
        step_s = (self._steady[1] / self._steady[0] if self._steady[0]
                  else loop_s / max(steps, 1))
        excess = sum(max(0.0, s - n * step_s) for n, s in self._firsts)
        seconds = dict(self.seconds)
        seconds["training_prep"] += excess
        seconds["productive"] = loop_s - excess - seconds["data_loading"]
        return {**self._attempt, "steps": steps, "step_s": step_s, "seconds": seconds}

    def _save_later(self) -> None:
        self._writer.put([*self._previous, self._snapshot()])

    def _persist(self, attempts: list[dict]) -> None:  # on the writer thread
        """Writes the record, unless a stop signal came (its save has the storage's
        requests to itself); a failed write warns once and the record stays behind."""
        if signals.seconds_since_signal() is not None or self._file is None:
            return
        try:
            self._file.write(attempts)
        except Exception as error:  # noqa: BLE001 - the record never ends a run
            logging.warning("goodput: cannot write %s (%s: %s); the run goes on without "
                            "its goodput record.", self._file.path, type(error).__name__, error)
            self._file = None
