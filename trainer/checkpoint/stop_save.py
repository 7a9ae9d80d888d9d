"""The save of a run that stops before ``train.steps`` (or is preempted at its last step,
in its evaluation), within the grace period a preemption leaves.

The path of a stop, top-down: a signal (:mod:`trainer.checkpoint.guards.preemption`) or
``request_stop`` sets a flag; at the next loop boundary every worker agrees on it (the
loop driver's stop all-reduce) and the driver calls ``on_train_end``; :class:`StopSave`
then writes the stop's checkpoint synchronously (:meth:`Checkpointer.save
<trainer.checkpoint.service.Checkpointer.save>` with ``wait``, checked committed), every
worker learns what the chief found (one broadcast; none leaves before the save) and, after
a preemption, reports it as the run's ``preemption`` event (``step``, ``saved``,
``last_good``), from which ``fit()`` raises :class:`trainer.errors.Preempted` and
``trainer.main`` exits 143.

The grace budget: after a preemption, on a workdir in a bucket, the save's waits are
bounded by what is left of ``checkpoint.preemption_grace_s`` since the signal; a write
still running then is given up (one warning) and the last good checkpoint is the newest
this run knows committed, so the run's last line is said before the platform's kill. A
save that committed past the grace period is said (a spot VM may be gone by then).

Contexts: host, eager, cross-replica, between ``tf.function`` calls; on every worker at
the same point (it takes part in collectives).
"""

from __future__ import annotations

import time
from typing import Any

from absl import logging

from trainer.checkpoint import inventory
from trainer.checkpoint.service import Checkpointer
from trainer.checkpoint.storage.reader import LATEST_DIR
from trainer.checkpoint.storage.writer import StillWriting
from trainer.distribution import host_collectives
from trainer.run_context import RunContext, Service
from trainer.runtime import gcs, signals


class StopSave(Service):
    """Writes the checkpoint of an early stop (see the module docstring).

    Args:
      checkpointer: the run's checkpoint service, whose save this is (inactive when it is).
      config: the run's config (``train.steps``, ``checkpoint.preemption_grace_s``).
      events: the run's :class:`trainer.run_context.RunEvents`; a preemption's outcome is
        reported there.
    """

    def __init__(self, checkpointer: Checkpointer, config: Any, events: Any):
        self.checkpointer, self.events = checkpointer, events
        self.total = config.train.steps
        self.grace_s = config.checkpoint.preemption_grace_s

    def on_train_end(self, run: RunContext) -> None:
        cp = self.checkpointer
        if not cp.enabled or (run.step >= self.total and run.stopped_by != "preemption"):
            return  # the last step's save was the last loop's, unless preempted there
        committed, last_good = self._save(run)
        if committed:
            self._check_grace(run)
        report = None
        if cp.chief:
            saved = run.step if committed else None
            report = {"saved": saved, "last_good": (
                f"step {saved} ({cp.writer.path(LATEST_DIR, saved)})" if saved is not None
                else last_good or inventory.describe_last_good(run.workdir))}
        report = host_collectives.json_from_chief(run.strategy, report)
        if run.stopped_by == "preemption":
            self.events.preemption(run.step, report["saved"], report["last_good"])

    def _deadline(self, run: RunContext) -> float | None:
        """When the grace period of a preemption ends (monotonic seconds), for the chief's
        save to a bucket (and each worker's share of it); None: the save's waits are not
        bounded."""
        since = signals.seconds_since_signal()
        writer = self.checkpointer.writer
        if (run.stopped_by == "preemption" and since is not None and writer.staged
                and (self.checkpointer.chief or writer.shared)):
            return time.monotonic() + max(0.0, self.grace_s - since)
        return None

    def _save(self, run: RunContext) -> tuple[bool, str | None]:
        """``(committed, the last good checkpoint when already known)``."""
        writer = self.checkpointer.writer
        try:
            return self.checkpointer.save(run, wait=True, deadline=self._deadline(run)), None
        except StillWriting as error:
            writer.abandon()
            known = writer.last_committed(LATEST_DIR)
            last_good = (f"step {known} ({writer.path(LATEST_DIR, known)})"
                         if known is not None else "none known to this run")
            reason = gcs.retry_reason()
            logging.warning("%s when checkpoint.preemption_grace_s=%g s after the stop signal "
                            "ran out (the storage is slow or failing%s): the run ends now "
                            "without it; the last good checkpoint is %s.", error, self.grace_s,
                            f": {reason}" if reason else "", last_good)
            return False, last_good

    def _check_grace(self, run: RunContext) -> None:
        """Says when a preemption's save committed past the grace period (a spot VM may
        be gone by then): never skipped, so the time is what to act on."""
        since = signals.seconds_since_signal()
        if run.stopped_by == "preemption" and since is not None and since > self.grace_s:
            logging.warning(
                "The stop's checkpoint committed %.0f s after the stop signal, past "
                "checkpoint.preemption_grace_s=%g: a spot VM may be gone before that. Make "
                "the loops shorter (train.steps_per_loop) or the state smaller, or write to "
                "faster storage.", since, self.grace_s)
