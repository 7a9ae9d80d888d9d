"""Periodic saves that come due while the previous async write is still running.

A store that is slow or does not answer for a while (a bucket over a congested link, a
network blip) makes an async write outlast the save interval. Waiting for it would stop
training for as long as the store does not answer. So a periodic save that comes due
while the previous write still runs waits for it up to :data:`WAIT_S` (a healthy store
finishes well within that: nothing changes), then is skipped and training goes on; the
later saves due while that same write still runs are skipped at once. The write in
flight still commits (or fails, and is reported by
:mod:`trainer.checkpoint.save_failures`). The first skip of a streak is a warning, the
others are logged. Final saves (``train.steps``, a stop, a preemption) and best saves
are never skipped: they wait for the write in flight.

Contexts: host, the chief, between ``tf.function`` calls.
"""

from __future__ import annotations

import time
from typing import Callable

from absl import logging

WAIT_S = 10.0  # how long a due save waits for the previous write before it is skipped
_POLL_S = 0.02


class SaveDeferral:
    """Decides whether a due periodic save is skipped (see the module docstring)."""

    def __init__(self, every: int, wait_s: float = WAIT_S):
        self.every, self.wait_s = every, wait_s
        self._stalled: int | None = None  # the in-flight step saves were skipped for
        self._streak = 0

    def skip(self, step: int, in_flight: Callable[[], int | None], where: str,
             why: Callable[[], str | None] = lambda: None) -> bool:
        """True (and said) when the save of ``step`` is to be skipped. ``in_flight()``:
        the step whose async write to ``where`` still runs (None once none does);
        ``why()``: what the storage is known to answer meanwhile (added to the line)."""
        running = in_flight()
        deadline = time.monotonic() + (0 if running == self._stalled else self.wait_s)
        while running is not None and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            running = in_flight()
        if running is None:
            self._stalled, self._streak = None, 0
            return False
        self._stalled, self._streak = running, self._streak + 1
        log = logging.warning if self._streak == 1 else logging.info
        reason = why()
        log("checkpoint of step %d skipped: the save of step %d to %s is still being "
            "written after %.0f s (slow or unreachable storage%s); training goes on, the next "
            "save is at step %d.", step, running, where, self.wait_s,
            f": {reason}" if reason else "", step + self.every)
        return True
