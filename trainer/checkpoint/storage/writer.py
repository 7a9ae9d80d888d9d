"""The orbax managers of one workdir: writing steps, keep-N / best-N, async writes.

:class:`CheckpointWriter` (the chief's; :mod:`trainer.checkpoint.service` decides when
it saves) writes each step through orbax's ``CheckpointManager`` with the item handlers
of :func:`trainer.checkpoint.storage.handlers.saving_registry`: into ``workdir/checkpoints`` (and
``checkpoints_best``), or for a workdir in a bucket into a local staging directory from
which :mod:`trainer.checkpoint.storage.bucket` uploads and commits each step. Reading is
:mod:`trainer.checkpoint.storage.reader`'s.

Contexts: host only; the chief.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent import futures
from typing import Any

import tensorflow as tf
from absl import logging

from tf_cluster.storage_schemes import is_bucket
from trainer.checkpoint.storage import bucket, checksums
from trainer.checkpoint.storage.handlers import orbax, saving_registry, short_error
from trainer.checkpoint.storage.reader import BEST_DIR


class StillWriting(Exception):
    """A write still runs when the time given to :meth:`CheckpointWriter.wait` is up."""


class CheckpointWriter:
    """The orbax managers of one workdir (chief only; created at the first save).

    Args:
      workdir: the run's directory. In a bucket (``gs://``) the managers write to a
        local staging directory and each step is uploaded once orbax committed it there
        (:mod:`trainer.checkpoint.storage.bucket`; one upload thread, so steps commit in order);
        the steps orbax's retention removes from the staging directory are deleted from
        the bucket after the next commit, in a background thread (never after a
        ``wait`` save: a stop's save holds nothing but its own write).
      cfg: ``config.checkpoint`` (``max_to_keep``, ``best_mode``, ``async_save``,
        ``fast_io``, ``staging_dir``).
      best_name: the metric the best manager ranks by (its key in ``metrics``).
    """

    def __init__(self, workdir: str, cfg: Any, best_name: str):
        self.workdir, self.cfg, self.best_name = workdir, cfg, best_name
        self._managers: dict[str, Any] = {}
        self._pending: dict[str, int] = {}
        self._staged = is_bucket(workdir)
        self._staging: str | None = None  # the local root of the staged kinds
        self._uploads: dict[str, futures.Future] = {}  # each kind's last upload
        self._in_bucket: dict[str, set[int]] = {}  # committed steps in the bucket, by kind
        self._threads: dict[str, futures.ThreadPoolExecutor] = {}
        self._cleanups: list[futures.Future] = []

    @property
    def staged(self) -> bool:
        """Whether steps are staged locally and uploaded (a workdir in a bucket)."""
        return self._staged

    def _thread(self, name: str) -> futures.ThreadPoolExecutor:
        if name not in self._threads:
            self._threads[name] = futures.ThreadPoolExecutor(1, f"checkpoint-{name}")
        return self._threads[name]

    def _directory(self, kind: str) -> str:
        """Where the manager of ``kind`` writes: ``workdir/kind``, or its staging
        directory for a workdir in a bucket."""
        if not self._staged:
            return os.path.join(self.workdir, kind)
        if self._staging is None:
            self._staging = bucket.staging_dir("checkpoints", self.cfg.staging_dir)
        return os.path.join(self._staging, kind)

    def _manager(self, kind: str):
        if kind not in self._managers:
            ocp = orbax()
            best = kind == BEST_DIR
            directory = self._directory(kind)
            if self._staged:
                os.makedirs(directory, exist_ok=True)
                self._in_bucket[kind] = set(self._bucket_dir(kind).seed(directory))
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.cfg.max_to_keep,
                best_fn=(lambda metrics: metrics[self.best_name]) if best else None,
                best_mode=self.cfg.best_mode,
                keep_checkpoints_without_metrics=False,
                enable_async_checkpointing=self.cfg.async_save,
                cleanup_tmp_directories=True,
            )
            self._managers[kind] = ocp.CheckpointManager(
                directory, options=options,
                handler_registry=saving_registry(ocp, self.cfg.fast_io))
        return self._managers[kind]

    def _bucket_dir(self, kind: str) -> bucket.BucketSteps:
        return bucket.BucketSteps(os.path.join(self.workdir, kind))

    def has(self, kind: str, step: int) -> bool:
        return step in self._manager(kind).all_steps()

    def path(self, kind: str, step: int) -> str:
        """The directory of ``step`` of ``kind`` once committed."""
        return os.path.join(self.workdir, kind, str(step))

    def committed(self, kind: str, step: int) -> bool:
        """Whether the write of ``step`` of ``kind`` is committed, as the storage (not
        orbax's memory of it) shows: the step is listed and every file its checksums
        name is there with the size written (one stat per file, nothing read); in a
        bucket, the step's upload ended with every object's reported size and CRC32C
        equal to the bytes sent and its commit marker written (no further request)."""
        if self._staged:
            return step in self._in_bucket.get(kind, ())
        if step not in self._manager(kind).all_steps(read=True):
            return False
        try:
            return checksums.verify(self.path(kind, step), read=False)
        except (checksums.ChecksumMismatch, tf.errors.OpError, OSError):
            return False

    def delete(self, kind: str, step: int) -> None:
        """Removes the committed ``step`` of ``kind`` (a corrupt copy about to be
        written again)."""
        if self._staged:
            self._bucket_dir(kind).delete([step])
            self._in_bucket.get(kind, set()).discard(step)
        self._manager(kind).delete(step)

    def kinds(self) -> list[str]:
        """The directories a manager writes to (those saved to since the last close)."""
        return list(self._managers)

    def pending(self, kind: str) -> int | None:
        """The step of ``kind`` whose async write may not be committed yet, or None."""
        return self._pending.get(kind)

    def in_flight(self, kind: str) -> int | None:
        """The step of ``kind`` whose async write is still running, or None."""
        if self._staged:
            upload = self._uploads.get(kind)
            running = upload is not None and not upload.done()
        else:
            manager = self._managers.get(kind)
            running = manager is not None and manager.is_saving_in_progress()
        return self._pending.get(kind) if running else None

    def wait(self, kind: str | None = None, timeout: float | None = None) -> None:
        """Blocks until the async writes of ``kind`` (default: every kind) are committed;
        raises the error of a write that failed. ``timeout``: seconds at most for a
        bucket's uploads; :class:`StillWriting` when one still runs then (it stays
        pending)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for name, manager in list(self._managers.items()):
            if kind in (None, name):
                manager.wait_until_finished()
                upload = self._uploads.get(name)
                if upload is not None:
                    try:
                        upload.result(None if deadline is None
                                      else max(0.0, deadline - time.monotonic()))
                    except futures.TimeoutError as error:
                        raise StillWriting(f"the checkpoint of step {self._pending.get(name)}"
                                           f" is still being written to "
                                           f"{os.path.join(self.workdir, name)}") from error
                    finally:
                        if upload.done():
                            self._uploads.pop(name, None)
                self._pending.pop(name, None)

    def save(self, kind: str, step: int, state: dict, manifest: dict,
             metrics: dict[str, float] | None = None, wait: bool = False,
             timeout: float | None = None) -> None:
        """Writes ``state`` / ``manifest`` as ``step`` (async unless ``wait``; ``timeout``:
        see :meth:`wait`). The caller must not change ``state``'s arrays until
        :meth:`wait` returns."""
        ocp = orbax()
        self._pending[kind] = step
        manager = self._manager(kind)
        manager.save(step, metrics=metrics, force=True, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state), manifest=ocp.args.JsonSave(manifest)))
        if self._staged:
            self._uploads[kind] = self._thread("upload").submit(
                self._upload, kind, step, manager, not wait)
        if wait:
            self.wait(kind, timeout)

    def last_committed(self, kind: str) -> int | None:
        """The newest step of ``kind`` this store knows committed in the bucket (seen at
        its first save, or uploaded since), without asking the storage; None when it
        knows none (or the workdir is not in a bucket)."""
        return max(self._in_bucket.get(kind, ()), default=None)

    def abandon(self) -> None:
        """Gives up the writes still running (a stop whose grace period ran out): their
        threads are left to end with the process, nothing is waited for again, and the
        steps they write stay uncommitted (a restart deletes them)."""
        for thread in self._threads.values():
            thread.shutdown(wait=False, cancel_futures=True)
        self._managers.clear()
        self._pending.clear()
        self._uploads.clear()
        self._threads.clear()
        self._cleanups.clear()

    def _upload(self, kind: str, step: int, manager: Any, retain: bool) -> None:
        """(The upload thread.) Once orbax committed ``step`` in the staging directory:
        uploads and commits it in the bucket, keeps a stub of it locally, and (with
        ``retain``) has the steps orbax's retention removed deleted from the bucket in
        the background."""
        manager.wait_until_finished()
        local = os.path.join(self._directory(kind), str(step))
        self._bucket_dir(kind).upload(step, local)
        bucket.prune_to_stub(local)
        self._in_bucket[kind].add(step)
        gone = self._in_bucket[kind] - set(manager.all_steps())
        if retain and gone:
            self._in_bucket[kind] -= gone
            self._cleanups.append(self._thread("cleanup").submit(
                self._bucket_dir(kind).delete, gone))

    def vanished(self, kind: str) -> bool:
        """Whether the directory of ``kind``'s open manager is gone (deleted during the
        run: ``rm -rf`` of the workdir by a user or a cleaner). Never in a bucket: it
        has no directories, and the next upload writes every object of its step."""
        return not self._staged and kind in self._managers and not tf.io.gfile.isdir(
            os.path.join(self.workdir, kind))

    def discard(self, kind: str) -> None:
        """Drops the manager of ``kind`` after a failed write (its errors are ignored);
        the next save makes a new one, which removes the step directory left incomplete
        (in a bucket: the staging directory is emptied, and the next manager sees the
        bucket's steps again)."""
        manager = self._managers.pop(kind, None)
        self._pending.pop(kind, None)
        upload = self._uploads.pop(kind, None)
        try:
            if manager is not None:
                manager.close()
            if upload is not None:
                futures.wait([upload])
        except Exception:  # noqa: BLE001 - the write's error is the one reported
            pass
        if self._staged and self._staging is not None:
            shutil.rmtree(os.path.join(self._staging, kind), ignore_errors=True)
            self._in_bucket.pop(kind, None)

    def best_step(self) -> int | None:
        manager = self._managers.get(BEST_DIR)
        return None if manager is None else manager.best_step()

    def metrics(self, kind: str, step: int) -> dict[str, float]:
        return dict(self._manager(kind).metrics(step) or {})

    def close(self) -> None:
        """Waits for pending writes (and a bucket's retention deletes: their failure is a
        warning, the steps are deleted at a later save) and closes every manager."""
        for kind in list(self._managers):
            self.wait(kind)
        for manager in self._managers.values():
            manager.close()
        for cleanup in self._cleanups:
            error = cleanup.exception()
            if error is not None:
                logging.warning("Old checkpoints could not be deleted from %s (%s); a later "
                                "save deletes them.", self.workdir, short_error(error))
        for thread in self._threads.values():
            thread.shutdown()
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
        self._managers.clear()
        self._pending.clear()
        self._uploads.clear()
        self._in_bucket.clear()
        self._threads.clear()
        self._cleanups.clear()
        self._staging = None
