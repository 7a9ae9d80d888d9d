"""trainer.data.iterator_release: what a fit() hands over is dropped on a background thread;
the caller does not wait for it, the drop happens, and a process that ends normally
waits for it; the input probe's copy goes the same way at close(). KeptObjects keeps
items between uses, gives them back for an equal tag only, and hands them to the
release when released, replaced or collected with its owner. (Trainers on 2 replicas
that keep, hand over and drop their iterators, and a clean exit:
tests/test_many_trainers.py.)"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import weakref

from tests.support import toy
from tests.support.helpers import REPO, live_iterators, subprocess_env
from trainer.data import iterator_release
from trainer.telemetry.probes import InputProbe


def lines_of_a_clean_exit(script: str) -> list[str]:
    """The lines ``script`` (Python source) prints in a new process, which must exit
    with 0 and report no exception."""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Exception" not in done.stderr, done.stderr[-3000:]
    return done.stdout.splitlines()


class SlowToDestroy:
    """Stands in for a distributed iterator: its destruction blocks until ``go`` is set
    (as an iterator's waits for its tf.data autotune thread) and records its thread."""

    def __init__(self, go: threading.Event):
        self.go = go
        self.destroyed_on: list[int] = []

    def __del__(self):
        self.go.wait(timeout=30)  # a synchronous release would block the test this long
        self.destroyed_on.append(threading.get_ident())


def test_release_returns_before_the_object_is_destroyed():
    go = threading.Event()
    held = [SlowToDestroy(go)]
    gone = weakref.ref(held[0])
    try:
        iterator_release.release(held)
        # The destructor is still blocked: release did not wait for it.
        assert gone() is not None
        assert iterator_release.pending() >= 1
    finally:
        go.set()
    assert iterator_release.wait(timeout=60)


def test_the_release_destroys_the_object_on_another_thread():
    go = threading.Event()
    go.set()
    obj = SlowToDestroy(go)
    destroyed_on, gone = obj.destroyed_on, weakref.ref(obj)
    held = [obj]
    del obj
    iterator_release.release(held)
    assert iterator_release.wait(timeout=60)
    assert gone() is None
    assert held == []
    assert destroyed_on and destroyed_on[0] != threading.get_ident()


def test_wait_with_a_timeout_reports_a_release_still_running():
    go = threading.Event()
    iterator_release.release([SlowToDestroy(go)])
    try:
        assert not iterator_release.wait(timeout=0.01)
    finally:
        go.set()
    assert iterator_release.wait(timeout=60)
    assert iterator_release.pending() == 0


def test_a_process_that_ends_normally_waits_for_pending_releases():
    # The destructor prints after the main thread has finished: the interpreter waited
    # for the (non-daemon) releasing thread, and the process still exits with 0.
    script = textwrap.dedent("""
        import threading
        from trainer.data import iterator_release

        class Slow:
            def __del__(self):
                threading.Event().wait(0.5)
                print("destroyed", flush=True)

        iterator_release.release([Slow()])
        print("main done", flush=True)
    """)
    assert lines_of_a_clean_exit(script) == ["main done", "destroyed"]


def test_the_input_probe_releases_its_copy_at_close():
    t = toy.ToyTrainer(toy.toy_config(**{"train.steps": 2}))
    t.fit()
    assert iterator_release.wait(timeout=120)
    gc.collect()
    gc.disable()  # freed by reference counting on the releasing thread, not a collection
    try:
        before = live_iterators()
        probe = InputProbe(t.context)
        assert live_iterators() > before
        probe.close()
        assert iterator_release.wait(timeout=120)
        assert live_iterators() == before
    finally:
        gc.enable()


class RecordingList(list):
    """A list of kept items that records the threads which empty it."""

    def __init__(self, *items):
        super().__init__(items)
        self.emptied_on: list[int] = []

    def pop(self, *args):
        self.emptied_on.append(threading.get_ident())
        return super().pop(*args)


def test_kept_objects_come_back_for_an_equal_tag_only():
    kept = iterator_release.KeptObjects()
    first, second = RecordingList("iterator", "dataset"), RecordingList("other")
    kept.keep(first, (20, "config"))
    assert kept.take((20, "config")) is first
    assert first == ["iterator", "dataset"] and not first.emptied_on
    kept.keep(first, (20, "config"))
    assert kept.take((10, "config")) is None  # another position: released
    kept.keep(second, (20, "config"))
    assert kept.take((20, "config")) is second
    assert iterator_release.wait(timeout=60)
    assert first == [] and first.emptied_on[0] != threading.get_ident()
    assert kept.take((20, "config")) is None  # nothing kept any more


def test_keeping_new_objects_releases_the_old_ones():
    kept = iterator_release.KeptObjects()
    old = RecordingList("old")
    kept.keep(old, 1)
    kept.keep(RecordingList("new"), 2)
    assert iterator_release.wait(timeout=60)
    assert old == [] and old.emptied_on[0] != threading.get_ident()
    kept.release()
    assert iterator_release.wait(timeout=60)


class Owner:
    """Holds a KeptObjects whose items hold the owner back (as a dataset function's
    closure holds a Trainer): one reference cycle."""

    def __init__(self, items: list):
        self.kept = iterator_release.KeptObjects()
        items.append(self)
        self.kept.keep(items, "tag")


def test_a_collected_owner_hands_its_kept_objects_to_the_release():
    items = RecordingList("iterator")
    emptied_on, gone = items.emptied_on, weakref.ref(items)
    gc.collect()
    gc.disable()
    try:
        Owner(items)
        del items
        gc.collect()  # the cycle: KeptObjects' finalizer hands the items over
        assert iterator_release.wait(timeout=60)
        assert emptied_on and set(emptied_on) != {threading.get_ident()}
        gc.collect()  # the rest of the cycle, no longer held by the items
        assert gone() is None
    finally:
        gc.enable()


def test_a_process_that_exits_with_kept_objects_drops_them_before_teardown():
    script = textwrap.dedent("""
        import sys
        from trainer.data import iterator_release

        class Item:
            def __del__(self):
                print(f"dropped, finalizing: {sys.is_finalizing()}", flush=True)

        kept = iterator_release.KeptObjects()
        kept.keep([Item()], "tag")
        print("main done", flush=True)
    """)
    # Dropped by the exit handler, not by the interpreter's teardown of the modules.
    assert lines_of_a_clean_exit(script) == ["main done", "dropped, finalizing: False"]
