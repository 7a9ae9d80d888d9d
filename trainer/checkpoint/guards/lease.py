"""One writer per workdir: the lease the chief holds while ``fit()`` runs.

A job resubmitted while the first still runs, or two notebooks on one workdir, used to
write side by side: the second removed the first's checkpoint in flight as
"incomplete" and the first crashed. Now the chief of a run holds ``workdir/lease.json``
from ``on_fit_start`` to ``on_fit_end``: the holder's host, pid, start time and a
renewal counter, created only if absent (``O_EXCL`` on a file system; a generation
precondition in a bucket) and renewed every ``checkpoint.lease_s / 6`` seconds by a
background thread, under a compare-and-swap (``flock`` / the object's generation), so
two runs can never both believe they hold it.

A run that finds the lease held:

* by a live run: refused with one :class:`trainer.errors.WorkdirError` line naming it
  (host, pid, start) and how to take over; "live" means its process exists (same host:
  at once) or its renewal counter moves while this run watches it (another host);
* by a run that is gone (a dead pid on this host, e.g. a restart after SIGKILL: at
  once; another host's lease not renewed for ``checkpoint.lease_s``: a preempted VM's
  replacement, after saying it waits): taken over with one warning naming the holder.

A holder that finds its lease taken (it was cut off longer than ``lease_s``: another
run judged it gone) stops at the next loop boundary with a WorkdirError before it saves
again. ``checkpoint.lease_s = 0`` turns the lease off. Only the chief writes it; the
other workers never see it. Contexts: host; the renewal thread touches only the file.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import socket
import threading
import time
from typing import Callable

from absl import logging

from tf_cluster.storage_schemes import is_bucket, is_local
from trainer.errors import WorkdirError
from trainer.run_context import RunContext, Service
from trainer.runtime import gcs

FILE = "lease.json"
RENEWALS_PER_LEASE = 6  # renewals within one checkpoint.lease_s
_POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a lease: ``host``, ``pid``, ``started`` (Unix time), ``renewals``."""

    host: str
    pid: int
    started: float
    renewals: int = 0

    @classmethod
    def this_process(cls) -> "Holder":
        return cls(socket.gethostname(), os.getpid(), time.time())

    def same_run(self, other: "Holder") -> bool:
        return (self.host, self.pid, self.started) == (other.host, other.pid, other.started)

    def describe(self) -> str:
        return (f"host {self.host}, pid {self.pid}, started "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))}")

    def alive_here(self) -> bool | None:
        """Whether this holder's process runs, when this host can tell (same host: its
        pid exists or not); None for another host's."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # another user's process
        return True


def _encode(holder: Holder) -> bytes:
    return json.dumps(dataclasses.asdict(holder)).encode()


def _decode(data: bytes) -> Holder | None:
    try:
        return Holder(**json.loads(data))
    except (ValueError, TypeError):
        return None  # unreadable: treated as a holder that is gone


class LocalLeaseFile:
    """The lease file on a file system: created with ``O_EXCL``; compared and swapped
    under ``flock``."""

    def __init__(self, path: str):
        self.path = path

    def create(self, data: bytes) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

    def read(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def swap(self, expected: bytes, data: bytes | None) -> bool:
        """Replaces the content ``expected`` by ``data`` (None: removes the file);
        False when the content is no longer ``expected``."""
        try:
            f = open(self.path, "r+b")
        except FileNotFoundError:
            return False
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)
            if f.read() != expected:
                return False
            if data is None:
                os.remove(self.path)
                return True
            f.seek(0)
            f.write(data)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
        return True


class BucketLeaseFile:
    """The lease object in a bucket (``gs://``): created and swapped under generation
    preconditions, through the process's client and its retry policy
    (:mod:`trainer.runtime.gcs`; google-cloud-storage retries a conditional request too)."""

    def __init__(self, path: str):
        from google.api_core import exceptions

        bucket, name = gcs.split_url(path)
        self._blob = gcs.client().bucket(bucket).blob(name)
        self._retry = gcs.default_retry()
        self._failed = exceptions.PreconditionFailed
        self._missing = exceptions.NotFound
        self._generation: dict[bytes, int] = {}

    def create(self, data: bytes) -> bool:
        try:
            self._blob.upload_from_string(data, if_generation_match=0, retry=self._retry)
        except self._failed:
            return False
        self._generation = {data: self._blob.generation}
        return True

    def read(self) -> bytes | None:
        try:
            data = self._blob.download_as_bytes(retry=self._retry)
        except self._missing:
            return None
        self._generation = {data: self._blob.generation}
        return data

    def swap(self, expected: bytes, data: bytes | None) -> bool:
        generation = self._generation.get(expected)
        if generation is None:
            return False
        try:
            if data is None:
                self._blob.delete(if_generation_match=generation, retry=self._retry)
            else:
                self._blob.upload_from_string(data, if_generation_match=generation,
                                            retry=self._retry)
        except (self._failed, self._missing):
            return False
        self._generation = {} if data is None else {data: self._blob.generation}
        return True


def lease_file(workdir: str):
    """The lease file of ``workdir``: a bucket object for ``gs://``, else a file."""
    path = os.path.join(workdir, FILE)
    return BucketLeaseFile(path) if is_bucket(workdir) else LocalLeaseFile(path)


class WorkdirLease(Service):
    """Holds the workdir's lease during ``fit()`` (chief; see the module docstring).

    Args:
      lease_s: ``checkpoint.lease_s`` (0: no lease).
      chief: whether this process writes the workdir.
      holder: who this run is (default: this process now).
      clock: seconds, monotonic (injected by tests).
    """

    def __init__(self, lease_s: float, chief: bool, holder: Holder | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.lease_s, self.chief, self.clock = lease_s, chief, clock
        self.holder = holder or Holder.this_process()
        self._file = None
        self._held: bytes | None = None
        self._taken_by: Holder | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def on_fit_start(self, run: RunContext) -> None:
        if not (self.lease_s and self.chief and run.workdir):
            return
        if is_local(run.workdir):
            os.makedirs(run.workdir, exist_ok=True)
        self._file = lease_file(run.workdir)
        self._acquire(os.path.join(run.workdir, FILE))
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_until_stopped, daemon=True,
                                        name="workdir-lease")
        self._thread.start()

    def on_loop_end(self, run: RunContext) -> None:
        if self._taken_by is not None:
            raise WorkdirError(
                f"another run took over this workdir's lease ({self._taken_by.describe()}): "
                f"this run was cut off from {run.workdir} for over checkpoint.lease_s="
                f"{self.lease_s:g} s, so it was judged gone; it stops at step {run.step} "
                f"without saving. Let the other run go on, or stop it and run this command "
                f"again.")

    def on_fit_end(self, run: RunContext, logs: dict[str, float]) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        with self._lock:
            if self._held is not None and self._taken_by is None:
                self._file.swap(self._held, None)
            self._held = None

    # ------------------------------------------------------------------ holding
    def _acquire(self, path: str) -> None:
        """Creates the lease, or takes over one whose holder is gone; else raises."""
        mine = _encode(self.holder)
        waited_from, seen, said = None, None, False
        while True:
            if self._file.create(mine):
                self._held = mine
                return
            data = self._file.read()
            if data is None:
                continue  # released meanwhile
            other = _decode(data)
            if other is not None and other.same_run(self.holder):
                self._held = data  # this process's earlier fit(): still ours
                return
            alive = None if other is None else other.alive_here()
            if alive:
                raise self._refusal(path, other)
            gone = other is None or alive is False
            if not gone:
                if seen is not None and data != seen:
                    raise self._refusal(path, other)  # renewed while we watched: alive
                if waited_from is None:
                    waited_from, seen = self.clock(), data
                gone = self.clock() - waited_from >= self.lease_s
            if gone:
                if self._file.swap(data, mine):
                    self._held = mine
                    logging.warning("Took over the workdir lease %s from a run that is gone "
                                    "(%s).", path, other.describe() if other else "unreadable")
                    return
                waited_from, seen = None, None  # someone else changed it: look again
                continue
            if not said:
                said = True
                logging.warning("The workdir lease %s is held by %s, which this host cannot "
                                "check: waiting up to %.0f s (checkpoint.lease_s) to see "
                                "whether it still renews it.", path, other.describe(),
                                self.lease_s)
            time.sleep(min(_POLL_S, self.lease_s / RENEWALS_PER_LEASE))

    def _refusal(self, path: str, other: Holder) -> WorkdirError:
        return WorkdirError(
            f"another run is writing to this workdir ({other.describe()}; it holds {path}). "
            f"Two runs on one workdir destroy each other's checkpoints. Stop that run "
            f"first (a run stopped by SIGTERM saves and releases it), or choose another "
            f"--workdir; a run that is gone leaves a lease this command takes over by "
            f"itself within checkpoint.lease_s={self.lease_s:g} s.")

    def _renew_until_stopped(self) -> None:
        interval = self.lease_s / RENEWALS_PER_LEASE
        while not self._stop.wait(interval):
            with self._lock:
                if self._held is None or self._taken_by is not None:
                    return
                held = _decode(self._held)
                data = _encode(dataclasses.replace(held, renewals=held.renewals + 1))
                try:
                    if self._file.swap(self._held, data):
                        self._held = data
                        continue
                    current = self._file.read()
                except Exception as error:  # noqa: BLE001 - a storage blip: next renewal retries
                    logging.info("workdir lease not renewed (%s: %s); retrying.",
                                 type(error).__name__, error)
                    continue
                if current is None:  # removed (the workdir deleted?): made again
                    if self._file.create(data):
                        self._held = data
                    continue
                taker = _decode(current)
                if taker is None or not taker.same_run(self.holder):
                    self._taken_by = taker or Holder("unknown", 0, 0.0)
                    logging.warning("The workdir lease was taken over by %s; this run stops "
                                    "at the next loop boundary.", self._taken_by.describe())
                    return
