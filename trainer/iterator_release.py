"""Dropping input iterators and their datasets off the training thread.

On a multi-device strategy, destroying a distributed input iterator waits for the
tf.data autotune thread of every per-device iterator to notice the cancellation
(:mod:`trainer.fast_exit` says more). Measured on 2 Mirrored replicas (the benchmark
MLP): the release at the end of a ``fit()`` took a median 1.2 s and up to 28 s, paid
by every ``fit()`` on the thread that called it. The objects are of no further use, so
the end of a ``fit()`` (and a probe's ``close()``) hands them to :func:`release`,
which returns at once (a thread start: about a millisecond) and drops them on a
background thread.

Contract:

* ``release(held)`` takes over the items of the list ``held`` and empties it on a new
  thread: an item whose last reference was in the list is destroyed there. The caller
  keeps no other reference (it sets its own attributes to None before the call);
  whatever it still holds lives on and is destroyed when its last reference goes.
* The threads are NOT daemons: a process that ends normally (the end of a script,
  ``sys.exit``) waits for pending releases before the interpreter finalizes
  TensorFlow, so no destructor runs in a half torn-down interpreter.
  :func:`trainer.fast_exit.exit_now` (``os._exit``) skips them, as it skips every
  teardown.
* :func:`wait` blocks until every release handed over so far is done (a test or a
  notebook that counts live iterators or threads calls it first); :func:`pending`
  counts the releases still running.

Host only (cross-replica context); no TensorFlow import: any object can be released.
"""

from __future__ import annotations

import threading
import time

_lock = threading.Lock()
_running: set[threading.Thread] = set()


def _empty(held: list) -> None:
    """The releasing thread: drops ``held``'s items one by one (each destroyed here
    when the list held its last reference)."""
    try:
        while held:
            held.pop()
    finally:
        with _lock:
            _running.discard(threading.current_thread())


def release(held: list) -> None:
    """Empties ``held`` on a background (non-daemon) thread and returns at once.

    ``held``: the objects to drop (typically a distributed iterator and its dataset);
    the caller must hold no other reference to them for the destruction to happen
    off its thread. Host only.
    """
    if not held:
        return
    thread = threading.Thread(target=_empty, args=(held,), name="tf-trainer-release",
                              daemon=False)
    with _lock:
        _running.add(thread)
    thread.start()


def pending() -> int:
    """The releases handed to :func:`release` that are still running."""
    with _lock:
        return len(_running)


def wait(timeout: float | None = None) -> bool:
    """Blocks until every release handed over so far is done, or ``timeout`` seconds
    (None: no limit); True when none is pending. Host only."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _lock:
        threads = list(_running)
    for thread in threads:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        thread.join(left)
    return pending() == 0
