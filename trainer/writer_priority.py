"""CPU priority of the threads that write asynchronous checkpoints (Linux).

An async checkpoint write is CPU work: mostly the kernel's page-cache copy, done inside
the writing threads' system calls (2.2 s of system time for 577 MB on the 2-core
benchmark machine). When training keeps the cores busy, that CPU is taken from the
train loop. Orbax writes through tensorstore, whose threads are named ``ts_pool_*``
(workers, and an overseer that starts more of them under load; a new thread inherits
the policy of the thread that starts it, and idle workers exit after about 20 s).
Under ``SCHED_IDLE`` they run only on cycles nothing else in the machine wants, so the
write fills the idle gaps of the loop (host waits, the gaps between steps) instead of
competing with it.

The trade-off: if training leaves no idle CPU at all, an idle-priority write progresses
slowly and the NEXT save waits for it (``wait_until_finished``); the loop is then held
for at most about the time of a synchronous save, which is the same bound as at normal
priority. Reads (restore) use the same threads but run while the loop is stopped.

Linux only: elsewhere (and where ``os.SCHED_IDLE`` is missing) these functions do
nothing and return 0. The workers run C++ I/O and take the GIL only briefly, to resolve
futures; should one be waiting for CPU while holding it, the train loop blocks on the
GIL, the cores go idle and the worker runs: the inversion resolves itself.
"""

from __future__ import annotations

import os

from absl import logging

THREAD_PREFIX = "ts_pool"  # tensorstore's worker and overseer threads
PRIORITIES = ("idle", "normal")
_TASKS = "/proc/self/task"


def writer_threads() -> list[int]:
    """Native ids of this process's tensorstore threads (empty off Linux)."""
    tids = []
    try:
        entries = os.listdir(_TASKS)
    except OSError:
        return tids
    for entry in entries:
        try:
            with open(os.path.join(_TASKS, entry, "comm")) as f:
                if f.read().startswith(THREAD_PREFIX):
                    tids.append(int(entry))
        except OSError:  # the thread exited meanwhile
            continue
    return tids


def set_writer_priority(priority: str) -> int:
    """Puts the tensorstore threads under ``SCHED_IDLE`` ("idle") or back under
    ``SCHED_OTHER`` ("normal"); returns how many threads changed policy.

    Call right after an async save is dispatched: its workers then exist, and workers
    started later inherit the overseer's policy. Idempotent and cheap (one ``/proc``
    scan). "normal" only undoes an earlier "idle" (threads under another policy, e.g.
    real-time, are left alone). A refusal by the kernel is logged once, not raised.
    """
    if priority not in PRIORITIES:
        raise ValueError(f"writer priority {priority!r}: expected one of {PRIORITIES}")
    idle = getattr(os, "SCHED_IDLE", None)
    if idle is None:
        return 0
    want, undo = (idle, os.SCHED_OTHER) if priority == "idle" else (os.SCHED_OTHER, idle)
    changed = 0
    for tid in writer_threads():
        try:
            if os.sched_getscheduler(tid) != undo:
                continue
            os.sched_setscheduler(tid, want, os.sched_param(0))
            changed += 1
        except ProcessLookupError:  # exited meanwhile
            continue
        except PermissionError as error:
            logging.log_first_n(logging.WARNING, "cannot set the checkpoint writer threads "
                                "to %s priority (%s); they keep their priority.", 1,
                                priority, error)
            break
    return changed
