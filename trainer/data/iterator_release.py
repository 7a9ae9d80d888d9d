"""Dropping input iterators and their datasets off the training thread, and keeping
them for an owner between uses without ever destroying them on the owner's thread.

On a multi-device strategy, destroying a distributed input iterator waits for the
tf.data autotune thread of every per-device iterator to notice the cancellation
(:mod:`trainer.runtime.fast_exit` says more). Measured on 2 Mirrored replicas (the benchmark
MLP): the release at the end of a ``fit()`` took a median 1.2 s and up to 28 s, paid
by every ``fit()`` on the thread that called it. So whatever ends an iterator (a
``fit()`` that raised, a Trainer's or a probe's ``close()``, an evaluation's end) hands
it to :func:`release`, which returns at once (a thread start: about a millisecond) and
drops it on a background thread.

Contract:

* ``release(held)`` takes over the items of the list ``held`` and empties it on a new
  thread: an item whose last reference was in the list is destroyed there. The caller
  keeps no other reference (it sets its own attributes to None before the call);
  whatever it still holds lives on and is destroyed when its last reference goes.
* The threads are NOT daemons: a process that ends normally (the end of a script,
  ``sys.exit``) waits for pending releases before the interpreter finalizes
  TensorFlow, so no destructor runs in a half torn-down interpreter.
  :func:`trainer.runtime.fast_exit.exit_now` (``os._exit``) skips them, as it skips every
  teardown.
* :func:`wait` blocks until every release handed over so far is done (a test or a
  notebook that counts live iterators or threads calls it first); :func:`pending`
  counts the releases still running.
* At interpreter exit (the main thread has ended), ``release`` drops the items on the
  calling thread: a thread started then would outlive the interpreter's wait for its
  threads.

:class:`KeptObjects` keeps objects for an owner between two uses (a Trainer's train
iterator from one ``fit()`` to the next) and releases them this way when it is
released, garbage collected (its finalizer runs before the collection would destroy
them on the collecting thread) or still holds them at interpreter exit.

Host only (cross-replica context); no TensorFlow import: any object can be released.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Any

_lock = threading.Lock()
_running: set[threading.Thread] = set()


def _empty(held: list) -> None:
    """The releasing thread: drops ``held``'s items one by one (each destroyed here
    when the list held its last reference)."""
    try:
        _empty_now(held)
    finally:
        with _lock:
            _running.discard(threading.current_thread())


def _empty_now(held: list) -> None:
    """Drops ``held``'s items one by one on the calling thread."""
    while held:
        held.pop()


def release(held: list) -> None:
    """Empties ``held`` on a background (non-daemon) thread and returns at once.

    ``held``: the objects to drop (typically a distributed iterator and its dataset);
    the caller must hold no other reference to them for the destruction to happen
    off its thread. Host only.
    """
    if not held:
        return
    if not threading.main_thread().is_alive():  # interpreter exit: nobody would wait
        _empty_now(held)
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


# The KeptObjects holding items now (weakly: the set keeps none alive), for the exit.
_holding: "weakref.WeakSet[KeptObjects]" = weakref.WeakSet()


@atexit.register
def _drop_kept_at_exit() -> None:
    """Interpreter exit: what is still kept is dropped now, while the interpreter is
    whole (``release`` drops it on this thread: the main thread has ended)."""
    for kept in list(_holding):
        kept.release()


class KeptObjects:
    """Objects kept for one owner from one use to the next (a Trainer's train iterator
    from one ``fit()`` to the next), with a tag saying what they are good for (e.g. the
    step the iterator is positioned at).

    The owner holds this object; the items may hold the owner (a dataset function's
    closure): one reference cycle, collected as a whole. Its collection must not
    destroy the items on the collecting thread, so this object's finalizer hands them to
    :func:`release` first (they live on for that thread; the rest of the cycle goes at
    a later collection). Host only.
    """

    def __init__(self) -> None:
        self._tag: Any = None
        self._items: list = []

    def keep(self, items: list, tag: Any) -> None:
        """Keeps ``items`` (taking over the list; the caller drops its own references)
        with ``tag``; what was kept before is released."""
        self.release()
        self._tag, self._items = tag, items
        _holding.add(self)

    def take(self, tag: Any) -> list | None:
        """The kept items when they were kept with a tag equal to ``tag`` (they are no
        longer kept: the caller holds them); otherwise releases them and returns None."""
        if self._items and self._tag == tag:
            items, self._tag, self._items = self._items, None, []
            _holding.discard(self)
            return items
        self.release()
        return None

    def release(self) -> None:
        """Releases what is kept (:func:`release`); nothing kept: nothing happens (not
        even a look at this module's globals, which the interpreter's teardown may have
        cleared before it collects this object)."""
        if not self._items:
            self._tag = None
            return
        items, self._tag, self._items = self._items, None, []
        _holding.discard(self)
        release(items)

    def __del__(self) -> None:
        """Collected (with its owner's cycle): the items go to the release first."""
        self.release()
