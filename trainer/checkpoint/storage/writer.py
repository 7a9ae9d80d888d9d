"""The chief's writer of one workdir's checkpoints: orbax managers, keep-N / best-N, async writes.

:class:`CheckpointWriter` (:mod:`trainer.checkpoint.service` decides when it saves)
writes each step through orbax's ``CheckpointManager`` with the item handlers of
:func:`trainer.checkpoint.storage.handlers.saving_registry`, into the directory its
workdir's storage gives (:func:`trainer.checkpoint.storage.steps.steps_for`:
``workdir/checkpoints`` and ``checkpoints_best``, or for a workdir in a bucket a local
staging directory, from which each step is uploaded and committed). Reading is
:mod:`trainer.checkpoint.storage.reader`'s.

Contexts: host only; the chief (and, when a bucket's steps are saved in shares
(:meth:`CheckpointWriter.share_over`), every worker).
"""

from __future__ import annotations

import os
import time
from concurrent import futures
from typing import Any

from trainer.checkpoint.storage.handlers import orbax, saving_registry, short_error
from trainer.checkpoint.storage.reader import BEST_DIR
from trainer.checkpoint.storage.steps import steps_for


class StillWriting(Exception):
    """A write still runs when the time given to :meth:`CheckpointWriter.wait` is up."""


class CheckpointWriter:
    """The orbax managers of one workdir (chief only; created at the first save).

    Args:
      workdir: the run's directory; its storage (``steps``, chosen once) says where the
        managers write and when a step is committed (in a bucket: staged, then uploaded
        by one thread, so steps commit in order).
      cfg: ``config.checkpoint`` (``max_to_keep``, ``best_mode``, ``async_save``,
        ``fast_io``, ``staging_dir``).
      best_name: the metric the best manager ranks by (its key in ``metrics``).
    """

    def __init__(self, workdir: str, cfg: Any, best_name: str):
        self.workdir, self.cfg, self.best_name = workdir, cfg, best_name
        self.steps = steps_for(workdir, cfg.staging_dir)
        self._managers: dict[str, Any] = {}
        self._pending: dict[str, int] = {}
        self.shared = False  # every worker writes its share of each step (share_over)

    def share_over(self, rank: int, workers: int) -> bool:
        """Whether every worker writes each step, this one as ``rank`` of ``workers``
        (0: the chief), each uploading its share of the array files: on several workers
        with a workdir in a bucket and ``fast_io`` (each array one ``.npy`` file); else
        the chief writes alone, as on one worker."""
        if not (self.staged and self.cfg.fast_io and workers > 1):
            return False
        self.steps.share_over(rank, workers)
        self.shared = True
        return True

    def failed_share(self, kind: str, step: int, error: Exception) -> None:
        """This worker (not the chief) could not write its share of ``step``: the manager
        of ``kind`` is dropped and the chief told (its share marker says why)."""
        self.discard(kind)
        self.steps.failed_share(kind, step, short_error(error))

    @property
    def staged(self) -> bool:
        """Whether steps are staged locally and uploaded (a workdir in a bucket)."""
        return self.steps.staged

    def _manager(self, kind: str):
        if kind not in self._managers:
            ocp = orbax()
            best = kind == BEST_DIR
            directory = self.steps.directory(kind)
            self.steps.opened(kind)
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

    def has(self, kind: str, step: int) -> bool:
        return step in self._manager(kind).all_steps()

    def path(self, kind: str, step: int) -> str:
        """The directory of ``step`` of ``kind`` once committed."""
        return os.path.join(self.workdir, kind, str(step))

    def committed(self, kind: str, step: int) -> bool:
        """Whether the write of ``step`` of ``kind`` is committed, as the storage (not
        orbax's memory of it) shows: on a file system the step is listed and every file
        its checksums name is there with the size written (one stat per file, nothing
        read); in a bucket, the step's upload ended with every object's reported size
        and CRC32C equal to the bytes sent and its commit marker written (no further
        request)."""
        return self.steps.committed(kind, step, self._manager(kind))

    def delete(self, kind: str, step: int) -> None:
        """Removes the committed ``step`` of ``kind`` (a corrupt copy about to be
        written again)."""
        self.steps.delete(kind, step)
        self._manager(kind).delete(step)

    def kinds(self) -> list[str]:
        """The directories a manager writes to (those saved to since the last close)."""
        return list(self._managers)

    def pending(self, kind: str) -> int | None:
        """The step of ``kind`` whose async write may not be committed yet, or None."""
        return self._pending.get(kind)

    def in_flight(self, kind: str) -> int | None:
        """The step of ``kind`` whose async write is still running, or None."""
        running = self.steps.writing(kind, self._managers.get(kind))
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
                try:
                    self.steps.wait(name, None if deadline is None
                                    else max(0.0, deadline - time.monotonic()))
                except futures.TimeoutError as error:
                    raise StillWriting(f"the checkpoint of step {self._pending.get(name)}"
                                       f" is still being written to "
                                       f"{os.path.join(self.workdir, name)}") from error
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
        self.steps.saved(kind, step, manager, retain=not wait)
        if wait:
            self.wait(kind, timeout)

    def last_committed(self, kind: str) -> int | None:
        """The newest step of ``kind`` this writer knows committed in the bucket (seen at
        its first save, or uploaded since), without asking the storage; None when it
        knows none (or the workdir is not in a bucket)."""
        return self.steps.last_committed(kind)

    def abandon(self) -> None:
        """Gives up the writes still running (a stop whose grace period ran out): their
        threads are left to end with the process, nothing is waited for again, and the
        steps they write stay uncommitted (a restart deletes them)."""
        self.steps.abandon()
        self._managers.clear()
        self._pending.clear()

    def vanished(self, kind: str) -> bool:
        """Whether the directory of ``kind``'s open manager is gone (deleted during the
        run: ``rm -rf`` of the workdir by a user or a cleaner; never in a bucket)."""
        return kind in self._managers and self.steps.vanished(kind)

    def discard(self, kind: str) -> None:
        """Drops the manager of ``kind`` after a failed write (its errors are ignored);
        the next save makes a new one, which removes the step directory left incomplete
        (in a bucket: the staging directory is emptied, and the next manager sees the
        bucket's steps again)."""
        manager = self._managers.pop(kind, None)
        self._pending.pop(kind, None)
        try:
            if manager is not None:
                manager.close()
        except Exception:  # noqa: BLE001 - the write's error is the one reported
            pass
        self.steps.discard(kind)

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
        self.steps.close()
        self._managers.clear()
        self._pending.clear()
