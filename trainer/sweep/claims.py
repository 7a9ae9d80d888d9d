"""Which sweep process runs which trial: file locks in the sweep's directory.

Several sweep processes may run one study (``python -m trainer.sweep`` started twice on
the same DIR, the tasks of a Slurm job array): each trial must run in one of them at a
time, and the study must not grow past ``--trials``. Two ``flock(2)`` locks make that
so, and the kernel releases both when a process dies, however it dies:

* ``DIR/claims.lock``: held while a process chooses its next trial (:meth:`Claims.choosing`):
  it reads the study, takes a trial to resume or asks Optuna for a new one, and marks it
  its own (``owner``) before the next process looks.
* ``DIR/trials/NNNN.lock``: held by the process that runs trial NNNN, from its claim
  until the trial finishes or is released (:meth:`Claims.take`, :meth:`Claims.free`).
  A RUNNING trial whose lock is free is run by nobody: a process takes it only then.

A trial is claimable (:meth:`Claims.claim`) when its lock can be taken and it is
RUNNING and either its owner was a process on this host (the free lock says that
process no longer runs it: preempted, or killed) or :func:`trainer.sweep.study.resumable`
says so (released, or from another host: no heartbeat for ``STALE_S`` seconds, which
covers a filesystem whose locks do not reach across hosts).

This needs DIR on a filesystem whose ``flock`` works between the processes that share
it: any local filesystem; NFSv4 and Lustre (mounted with ``flock``) across hosts. Every
process of one study must use the same DIR.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from typing import IO, Iterator

from trainer.sweep.study import resumable
from trainer.sweep.trials import workdir_of

CHOOSING = "claims.lock"


class Claims:
    """The locks of one sweep process over ``root`` (see the module docstring)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.held: dict[int, IO[bytes]] = {}

    @contextlib.contextmanager
    def choosing(self) -> Iterator[None]:
        """Holds ``DIR/claims.lock`` (waits for the process holding it)."""
        os.makedirs(self.root, exist_ok=True)
        with open(os.path.join(self.root, CHOOSING), "ab") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield  # closing the file releases the lock

    def take(self, number: int) -> bool:
        """Takes trial ``number``'s lock if it is free (True), held until :meth:`free`."""
        if number in self.held:
            return False
        path = workdir_of(self.root, number) + ".lock"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(path, "ab")  # noqa: SIM115 - held open while the trial runs
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return False
        self.held[number] = lock
        return True

    def free(self, number: int) -> None:
        """Releases trial ``number``'s lock (no-op when not held)."""
        lock = self.held.pop(number, None)
        if lock is not None:
            lock.close()

    def claim(self, trial) -> bool:
        """Takes ``trial`` when nobody runs it (see the module docstring); True if taken."""
        if trial.state.name != "RUNNING" or not self.take(trial.number):
            return False
        owner = trial.user_attrs.get("owner") or ""
        if owner.rpartition(":")[0] == socket.gethostname() or resumable(trial):
            return True
        self.free(trial.number)
        return False
