"""A workdir's checkpoint steps in a bucket (``gs://``): staged locally, uploaded, committed.

Orbax writing a step straight into a bucket costs ~130 requests, one after another, so
orbax writes each step into a local staging directory instead (its own rename commit, at
local-disk speed; under ``checkpoint.staging_dir``, default ``$TMPDIR``) and one upload
thread (steps commit in order) moves it to the bucket
(:meth:`trainer.checkpoint.storage.bucket.BucketDirectory.upload`: in parallel, each
object's CRC32C checked, orbax's GCS commit marker last), keeping a stub of it locally
(its orbax step metadata and marker: orbax's retention still sees it). The steps orbax's
retention removes from the staging directory are deleted from the bucket after the next
commit, in a background thread (never after a ``wait`` save: a stop's save holds nothing
but its own write). When a manager opens, the staging directory is seeded with the
bucket's committed steps, so retention sees them as it would in the bucket.

On several workers (:meth:`BucketSteps.share_over`), every worker stages each step and
uploads only its share of the array files (:mod:`~trainer.checkpoint.storage.shares`);
the chief alone seeds, commits (once every worker's share marker is in) and deletes.

Reading: one listing per checkpoint directory tells the committed steps (their marker is
there) from the incomplete ones; a step is read from a local copy, listed and downloaded
in parallel (on several workers, each downloads its share: ``readable(path, only)``).
The other side of :func:`trainer.checkpoint.storage.steps.steps_for` is
:mod:`trainer.checkpoint.storage.local_steps`. Contexts: host; the writer's calls from
one thread, the uploads and deletes in their own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from concurrent import futures
from typing import Any, Callable, Iterator

from absl import logging

from trainer.checkpoint.storage import bucket, checksums, shares
from trainer.checkpoint.storage.handlers import short_error
from trainer.checkpoint.storage.reader import KINDS, Unreadable, newest_first

#: What a staged step keeps once uploaded: orbax's step metadata, metrics and commit marker.
STUB = (bucket.METADATA_FILE, bucket.COMMIT_FILE, bucket.METRICS_ITEM)


class BucketSteps:
    """The checkpoint steps of the workdir ``workdir`` (``gs://...``), staged under
    ``staging_parent`` (``""``: ``$TMPDIR``) when written."""

    staged = True

    def __init__(self, workdir: str, staging_parent: str = ""):
        self.workdir, self.staging_parent = workdir, staging_parent
        self._staging: str | None = None  # the local root of the staged kinds
        self._uploads: dict[str, futures.Future] = {}  # each kind's last upload
        self._committed: dict[str, set[int]] = {}  # committed steps in the bucket, by kind
        self._threads: dict[str, futures.ThreadPoolExecutor] = {}
        self._cleanups: list[futures.Future] = []
        self._listings: dict[str, dict[str, int]] = {}  # the last listing of each directory
        self.rank, self.workers = 0, 1  # who this process is among the workers that save

    def share_over(self, rank: int, workers: int) -> None:
        """Every one of ``workers`` workers saves each step, this one as ``rank`` (0: the
        chief), and uploads only its share (:mod:`~trainer.checkpoint.storage.shares`);
        the chief commits the step once every share is in."""
        self.rank, self.workers = rank, workers

    def _in_bucket(self, kind: str) -> bucket.BucketDirectory:
        return bucket.BucketDirectory(os.path.join(self.workdir, kind))

    def _thread(self, name: str) -> futures.ThreadPoolExecutor:
        if name not in self._threads:
            self._threads[name] = futures.ThreadPoolExecutor(1, f"checkpoint-{name}")
        return self._threads[name]

    # ------------------------------------------------------------------ reading
    def _listed(self, warn_incomplete: bool
                ) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
        """``(committed, incomplete)`` steps, newest first: one listing of each checkpoint
        directory (a step is committed when its marker is there)."""
        found, partial = [], []
        for rank, kind in enumerate(KINDS):
            directory = os.path.join(self.workdir, kind)
            steps = self._in_bucket(kind)
            names = self._listings[directory] = steps.listing()
            for step in steps.incomplete_steps(names):
                partial.append((step, os.path.join(directory, str(step))))
                if warn_incomplete:
                    logging.warning("Ignoring the incomplete checkpoint %s/%d (a save that did "
                                    "not finish; removed at the next save).", directory, step)
            found += [(step, rank, os.path.join(directory, str(step)))
                      for step in steps.committed_steps(names)]
        return newest_first(found), sorted(partial, key=lambda f: -f[0])

    def candidates(self, warn_incomplete: bool = True) -> list[tuple[int, str]]:
        """Committed steps in both directories, newest first (latest dir before best)."""
        return self._listed(warn_incomplete)[0]

    def incomplete(self) -> list[tuple[int, str]]:
        """Steps with objects but no commit marker, newest first."""
        return self._listed(False)[1]

    def objects(self, path: str) -> dict[str, int]:
        """``{name relative to the step: size}`` of the objects of the step ``path``, from
        the listing :meth:`candidates` made (else one listing of the step)."""
        directory, step = os.path.split(path.rstrip("/"))
        listed = (self._listings.get(directory)
                  or bucket.BucketDirectory(directory).listing(int(step)))
        return {n.partition("/")[2]: size for n, size in listed.items()
                if n.partition("/")[0] == step and not n.endswith("/")}

    @contextlib.contextmanager
    def readable(self, path: str, only: Callable[[str], bool] = lambda name: True,
                 names: dict[str, int] | None = None) -> Iterator[str]:
        """A local copy of the committed step ``path`` (of its objects ``only`` accepts,
        by their name relative to the step: a worker's share; downloaded in parallel, by
        ``names`` (:meth:`objects`, made on the chief) or the listing :meth:`candidates`
        made, else listed first; removed afterwards), so
        reading and checking its files costs no further requests; :class:`Unreadable`
        when it cannot be downloaded."""
        local = tempfile.mkdtemp(prefix="tf-trainer-restore-")
        try:
            directory, step = os.path.split(path.rstrip("/"))
            try:
                listed = (self._listings.get(directory) if names is None
                          else {f"{step}/{n}": size for n, size in names.items()})
                bucket.BucketDirectory(directory).download(int(step), local, listed, only)
            except (OSError, ValueError) as error:
                raise Unreadable(f"its files cannot be downloaded ({short_error(error)})") from error
            yield local
        finally:
            shutil.rmtree(local, ignore_errors=True)

    # ------------------------------------------------------------------ writing
    def directory(self, kind: str) -> str:
        """Where orbax's manager of ``kind`` writes: its staging directory."""
        if self._staging is None:
            self._staging = staging_dir("checkpoints", self.staging_parent)
        return os.path.join(self._staging, kind)

    def opened(self, kind: str) -> None:
        """A manager of ``kind`` is made: its staging directory shows the bucket's
        committed steps (and a save cut before its commit is deleted from the bucket)."""
        directory = self.directory(kind)
        os.makedirs(directory, exist_ok=True)
        if self.rank == 0:  # the chief alone tells and deletes the bucket's steps
            self._committed[kind] = set(self._in_bucket(kind).seed(directory))

    def committed(self, kind: str, step: int, manager: Any) -> bool:
        """Whether ``step`` of ``kind`` is committed: its upload ended with every object's
        reported size and CRC32C equal to the bytes sent and its marker written (no
        further request)."""
        return step in self._committed.get(kind, ())

    def saved(self, kind: str, step: int, manager: Any, retain: bool) -> None:
        """Orbax's manager took the save of ``step``: once committed in the staging
        directory, it is uploaded (and, with ``retain``, the steps orbax's retention
        removed are deleted from the bucket) in the upload thread."""
        self._uploads[kind] = self._thread("upload").submit(
            self._upload, kind, step, manager, retain)

    def _upload(self, kind: str, step: int, manager: Any, retain: bool) -> None:
        """(The upload thread.) Once orbax committed ``step`` in the staging directory:
        uploads and commits it in the bucket, keeps a stub of it locally, and (with
        ``retain``) has the steps orbax's retention removed deleted from the bucket in
        the background."""
        if self.rank:
            return self._upload_share(kind, step, manager)
        manager.wait_until_finished()
        local = os.path.join(self.directory(kind), str(step))
        steps, theirs, expected = self._in_bucket(kind), {}, {}
        if self.workers > 1:
            sizes, table = bucket.local_sizes(local), checksums.step_table(local)
            for rank in range(1, self.workers):
                theirs[rank] = shares.share_of(sizes, self.workers, rank)
                expected[rank] = shares.digest(table, theirs[rank])

        def shares_in() -> None:  # every worker's share, the chief's bytes
            for rank in shares.await_shares(steps, step, expected) if expected else []:
                logging.warning("Worker %d's array files of step %d differ from the chief's "
                                "(a variable not the same on every worker?): the chief "
                                "uploads them.", rank, step)
                steps.send(step, local, theirs[rank])

        steps.upload(step, local, skip=[f for files in theirs.values() for f in files],
                     before_commit=shares_in)
        prune_to_stub(local)
        self._committed[kind].add(step)
        gone = self._committed[kind] - set(manager.all_steps())
        if retain and gone:
            self._committed[kind] -= gone
            self._cleanups.append(self._thread("cleanup").submit(
                self._in_bucket(kind).delete, gone))

    def _upload_share(self, kind: str, step: int, manager: Any) -> None:
        """(The upload thread of a worker but the chief.) Uploads this worker's share of
        ``step`` and its share marker; a failure is the marker's text (the chief fails
        the save with it) and a warning here, never an error of this worker's save."""
        steps = self._in_bucket(kind)
        local = os.path.join(self.directory(kind), str(step))
        try:
            manager.wait_until_finished()
            mine = shares.share_of(bucket.local_sizes(local), self.workers, self.rank)
            steps.send(step, local, mine)
            done = shares.digest(checksums.step_table(local), mine)
        except Exception as error:  # noqa: BLE001 - reported to the chief, which fails the save
            self.failed_share(kind, step, short_error(error))
            return
        steps.put(step, shares.marker(self.rank, done), "")
        prune_to_stub(local)

    def failed_share(self, kind: str, step: int, reason: str) -> None:
        """This worker's share of ``step`` could not be written: its share marker says
        ``reason`` (the chief fails the save with it)."""
        logging.warning("This worker's share of the checkpoint of step %d could not be "
                        "written (%s); the chief fails that save.", step, reason)
        self._in_bucket(kind).put(step, shares.marker(self.rank, shares.FAILED), reason)

    def writing(self, kind: str, manager: Any) -> bool:
        """Whether the upload of ``kind``'s last step still runs."""
        upload = self._uploads.get(kind)
        return upload is not None and not upload.done()

    def wait(self, kind: str, timeout: float | None) -> None:
        """Waits up to ``timeout`` seconds (None: no bound) for the upload of ``kind``'s
        last step; raises its error, or ``concurrent.futures.TimeoutError`` when it
        still runs (it stays pending)."""
        upload = self._uploads.get(kind)
        if upload is None:
            return
        try:
            upload.result(timeout)
        finally:
            if upload.done():
                self._uploads.pop(kind, None)

    def delete(self, kind: str, step: int) -> None:
        """Deletes the committed ``step`` of ``kind`` from the bucket."""
        self._in_bucket(kind).delete([step])
        self._committed.get(kind, set()).discard(step)

    def vanished(self, kind: str) -> bool:
        """Never: a bucket has no directories, and the next upload writes every object
        of its step."""
        return False

    def discard(self, kind: str) -> None:
        """After a failed write: its upload is waited for (its error ignored: the write's
        is the one reported), the staging directory of ``kind`` emptied, and the next
        manager sees the bucket's steps again."""
        upload = self._uploads.pop(kind, None)
        if upload is not None:
            futures.wait([upload])
        if self._staging is not None:
            shutil.rmtree(os.path.join(self._staging, kind), ignore_errors=True)
            self._committed.pop(kind, None)

    def last_committed(self, kind: str) -> int | None:
        """The newest step of ``kind`` known committed in the bucket (seen when its manager
        opened, or uploaded since), without asking the storage; None: none known."""
        return max(self._committed.get(kind, ()), default=None)

    def abandon(self) -> None:
        """Gives up the uploads still running (a stop whose grace period ran out): their
        threads are left to end with the process; the steps they write stay uncommitted
        (a restart deletes them). What is known committed is kept."""
        for thread in self._threads.values():
            thread.shutdown(wait=False, cancel_futures=True)
        self._uploads.clear()
        self._threads.clear()
        self._cleanups.clear()

    def close(self) -> None:
        """After the writes were waited for: the retention deletes' failures are a
        warning (a later save deletes those steps), the threads end and the staging
        directory is removed."""
        for cleanup in self._cleanups:
            error = cleanup.exception()
            if error is not None:
                logging.warning("Old checkpoints could not be deleted from %s (%s); a later "
                                "save deletes them.", self.workdir, short_error(error))
        for thread in self._threads.values():
            thread.shutdown()
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
        self._uploads.clear()
        self._committed.clear()
        self._threads.clear()
        self._cleanups.clear()
        self._staging = None


def staging_dir(label: str, parent: str = "") -> str:
    """A new local directory for one workdir's staged steps, under ``parent`` (made;
    ``""``: ``$TMPDIR``)."""
    if parent:
        os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"tf-trainer-staging-{label}-", dir=parent or None)


def prune_to_stub(step_dir: str) -> None:
    """Removes a staged step's files but its orbax step metadata, metrics and commit
    marker (uploaded: the local disk keeps one state; orbax still sees the step,
    committed, with its metrics)."""
    for entry in os.listdir(step_dir):
        if entry in STUB:
            continue
        path = os.path.join(step_dir, entry)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
