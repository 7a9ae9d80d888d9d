"""SIGTERM and SIGINT answered in every phase of a run, even inside TensorFlow.

The command lines (``trainer.main``, ``trainer.doctor``) call :func:`install` first
thing, before TensorFlow is imported; ``fit()`` installs it for its duration when a
plain script calls it (:class:`trainer.checkpoint.guards.preemption.PreemptionWatcher`).

What a signal does:

* while a *stop callback* is registered (:func:`set_stop_callback`: the training loop
  during ``fit()``), the first SIGTERM/SIGINT calls it: the loop stops at its next safe
  point (an eval pass in progress is abandoned within seconds), saves a final
  checkpoint and the command exits 143 (:data:`trainer.checkpoint.guards.preemption.EXIT_PREEMPTED`);
* in any other phase (start-up, building the model or the input, restoring, the
  ``eval``/``continuous_eval`` modes, the doctor, after training) there is nothing new
  to save: the process prints one line and exits at once with 128 + the signal number
  (143 for SIGTERM, 130 for SIGINT), both retryable: run the same command again to
  resume from the last checkpoint;
* a second signal, in any phase, exits at once the same way.

How: Python runs a signal handler only in the main thread, between two bytecodes; a
main thread blocked in TensorFlow (a ``tf.function`` reading a slow dataset, a
collective) would not see the signal until that call returns, possibly never. So the
interpreter's C-level handler also writes the signal number to a pipe
(``signal.set_wakeup_fd``), and a daemon thread reading that pipe acts at once. Each
delivery reaches both the thread and the Python handler; whichever sees it first
handles it (counted, so one signal is never taken for two). TensorFlow's multi-worker coordination service installs
its own SIGTERM handler when the strategy starts; ``fit()`` re-installs these.

Pure Python, no TensorFlow import (the bottom layer).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Deliveries:
    """Which signal deliveries are new: each delivery reaches two channels (the watcher
    thread's pipe and the Python-level handler), and the first channel to see it handles
    it. Counted PER SIGNAL: Python runs pending handlers in signal-number order (SIGINT
    before SIGTERM), not in the order the signals arrived, so one count per channel
    would take a SIGTERM the handler sees late for a second signal."""

    def __init__(self):
        self._seen: dict[tuple[str, int], int] = {}
        self._handled: dict[int, int] = {}

    def is_new(self, channel: str, signum: int) -> bool:
        """``channel`` sees one delivery of ``signum``: True when no channel handled it."""
        seen = self._seen[(channel, signum)] = self._seen.get((channel, signum), 0) + 1
        if seen <= self._handled.get(signum, 0):
            return False
        self._handled[signum] = seen
        return True


class _State:
    """The one process-wide installation (signals are process-wide)."""

    def __init__(self):
        self.lock = threading.RLock()  # the main thread's handler may interrupt a holder
        self.pipe: tuple[int, int] | None = None
        self.previous: dict[int, object] = {}
        self.previous_fd = -1
        self.received: int | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self.callback: Callable[[int], None] | None = None
        self.deliveries = Deliveries()
        self.watcher: threading.Thread | None = None


_STATE = _State()


def _on_signal(signum, frame) -> None:
    """The Python-level handler (main thread, once the current C call returns): handles
    the signal unless the watcher thread already did. It keeps the stop deterministic
    where the thread could be late: a signal that arrives during a loop call is seen
    before the loop's stop agreement that follows the call."""
    _deliver(signum, "handler")


def installed() -> bool:
    """True while :func:`install` is in effect."""
    return _STATE.pipe is not None


def received() -> int | None:
    """The number of the first SIGTERM/SIGINT this process received (None: none yet)."""
    return _STATE.received


def seconds_since_signal() -> float | None:
    """Seconds since the first SIGTERM/SIGINT of this process (None: none yet)."""
    at = _STATE.received_at
    return None if at is None else time.monotonic() - at


def install() -> bool:
    """Installs the handlers and starts the watcher thread; True when this call
    installed them (False: already installed, then only the handlers are set again, in
    case a library replaced them). Main thread only: raises ValueError elsewhere."""
    if installed():
        for signum in SIGNALS:
            signal.signal(signum, _on_signal)
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        _STATE.previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        _STATE.previous = {signum: signal.signal(signum, _on_signal) for signum in SIGNALS}
    except ValueError:
        os.close(read_fd)
        os.close(write_fd)
        raise
    _STATE.pipe = (read_fd, write_fd)
    _STATE.watcher = threading.Thread(target=_watch, args=(read_fd,), name="signal-watcher",
                                      daemon=True)
    _STATE.watcher.start()
    return True


def uninstall() -> None:
    """Restores the handlers found by :func:`install`, stops the watcher thread (once it
    has read every delivery) and forgets the signals received: the next installation
    (the next ``fit()`` in a notebook kernel) takes its first signal for a first one."""
    if not installed():
        return
    for signum, handler in _STATE.previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    signal.set_wakeup_fd(_STATE.previous_fd)
    _, write_fd = _STATE.pipe
    _STATE.pipe = None
    os.close(write_fd)  # the watcher reads end-of-file and ends
    _STATE.watcher.join()
    with _STATE.lock:
        _STATE.received, _STATE.deliveries, _STATE.watcher = None, Deliveries(), None
        _STATE.received_at = None


def set_stop_callback(callback: Callable[[int], None] | None) -> None:
    """Registers what the first signal does instead of exiting (None: exit at once).
    ``callback(signum)`` runs in the watcher thread: it must only set a flag."""
    with _STATE.lock:
        _STATE.callback = callback


def _watch(read_fd: int) -> None:
    try:
        while True:
            data = os.read(read_fd, 64)
            if not data:
                return
            for signum in data:
                if signum in SIGNALS:
                    _deliver(signum, "pipe")
    finally:
        os.close(read_fd)


def _deliver(signum: int, channel: str) -> None:
    """One delivery of ``signum`` seen by ``channel``; acts unless already handled."""
    name = signal.Signals(signum).name
    with _STATE.lock:
        if not _STATE.deliveries.is_new(channel, signum):
            return  # the other channel handled this delivery
        first = _STATE.received is None
        if first:
            _STATE.received, _STATE.received_at = signum, time.monotonic()
        callback = _STATE.callback
    if not first:
        exit_now(signum, f"{name} again: exiting at once with {128 + signum}.")
    if callback is None:
        exit_now(signum, f"{name}: no training step in progress, nothing new to save; exiting "
                         f"with {128 + signum}. Run the same command again to resume from "
                         f"the last checkpoint.")
    callback(signum)


def exit_now(signum: int, message: str) -> None:
    """Prints ``message`` on stderr and ends the process with 128 + ``signum`` at once
    (no cleanup: whatever the process was doing is abandoned; committed checkpoints
    stay, a checkpoint being written is ignored by the next run)."""
    try:
        sys.stdout.flush()
        print(message, file=sys.stderr, flush=True)
    finally:
        os._exit(128 + signum)
