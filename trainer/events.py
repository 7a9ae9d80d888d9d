"""The framework's own events of a run, on one path: a service reports, listeners act.

A run's notable moments that are not a logging window or an evaluation — restored from
a checkpoint, rolled back, stopped early (by a callback, early stopping, or because the
workdir is already at ``train.steps``), preempted — are reported once to the run's
:class:`RunEvents` (``trainer.events``, owned by the Trainer and handed to the services
that report). Every listener receives the same record: telemetry writes it to
``metrics.jsonl`` and prints it through the progress service (console of a plain script,
a notebook and ``trainer.main`` alike).

Records (``time`` is added to each)::

    {"kind": "restore", "step": S, "workdir": DIR}
    {"kind": "stop", "step": S, "reason": TEXT}
    {"kind": "rollback", "step": RESTORED, "from_step": S, "reason": TEXT,
     "rollbacks": N, "max_rollbacks": M}
    {"kind": "preemption", "step": S}
    {"kind": "plan", "step": S, "source": "measured" | "checkpoint" | "skipped",
     "chosen": {"xla": B, "steps_per_loop": N}, "baseline": {...}, "ratio": R,
     "measure_s": T, "plans": [{"xla", "steps_per_loop", "steps_per_s", "vs_baseline"}],
     ...}  (the execution plan: trainer.plan)

Host only; no TensorFlow.
"""

from __future__ import annotations

import time
from typing import Any, Callable

Record = dict[str, Any]


class RunEvents:
    """The events of one Trainer: ``subscribe(listener)``, then the reporting methods.

    ``records`` keeps every event reported so far (in order), e.g. for a notebook.
    """

    def __init__(self):
        self._listeners: list[Callable[[Record], None]] = []
        self.records: list[Record] = []

    def subscribe(self, listener: Callable[[Record], None]) -> None:
        """``listener(record)`` is called for every later event."""
        self._listeners.append(listener)

    def emit(self, kind: str, step: int, **fields: Any) -> Record:
        """Reports an event of ``kind`` at ``step`` to every listener; returns the record."""
        record = {"kind": kind, "step": int(step), **fields, "time": time.time()}
        self.records.append(record)
        for listener in self._listeners:
            listener(record)
        return record

    def restore(self, step: int, workdir: str) -> Record:
        """The run resumed from the checkpoint of ``step`` in ``workdir``."""
        return self.emit("restore", step, workdir=workdir)

    def stop(self, step: int, reason: str) -> Record:
        """Training stops at ``step`` before ``train.steps`` (or does not start)."""
        return self.emit("stop", step, reason=reason)

    def rollback(self, step: int, from_step: int, reason: str, rollbacks: int,
                 max_rollbacks: int) -> Record:
        """At ``from_step`` the run went back to the checkpoint of ``step``."""
        return self.emit("rollback", step, from_step=int(from_step), reason=reason,
                         rollbacks=rollbacks, max_rollbacks=max_rollbacks)

    def plan(self, step: int, fields: dict[str, Any]) -> Record:
        """The run's execution plan was decided at ``step`` (:mod:`trainer.plan`)."""
        return self.emit("plan", step, **fields)

    def preemption(self, step: int) -> Record:
        """SIGTERM: the run stops at ``step`` after its checkpoint, to be restarted."""
        return self.emit("preemption", step)
