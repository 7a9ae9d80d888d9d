"""The local tier: every worker's own copy of the state on its own disk, never uploaded.

Every ``checkpoint.local_every_steps`` steps each worker (the chief too) writes the state
it holds and the manifest (the step, which is every worker's input position, and the
input layout, exactly as a workdir's save records them) to its :func:`local_dir`, through
the same :class:`~trainer.checkpoint.storage.writer.CheckpointWriter` as the workdir's
saves (orbax's manager, async, every file's checksums), keeping the newest
:data:`KEEP` steps. The workdir's saves (a bucket's too) keep their cadence and stay the
only durable copy: a local step lives as long as the host's disk (a Slurm requeue onto
a fresh ``$TMPDIR`` wipes it; the peers' copies or the workdir then serve).

:func:`local_dir` is keyed by the workdir and the worker, so a restarted process on the
same host finds its steps; a run that reaches ``train.steps`` removes it (the workdir
holds its final step). The key is a path, so the chief also marks the workdir
(:func:`mark`): local steps under the key of an unmarked workdir (deleted and made
afresh at the same path) are another run's, and are never restored. A local step is found by :meth:`LocalTier.candidates` and read
as any step directory (:func:`trainer.checkpoint.resume.load`); which copy a restart
restores, and how a host with an empty disk gets it, is
:mod:`trainer.checkpoint.resume`'s. A write to the local disk that fails is a warning,
never a stop: the run goes on with its durable saves. Contexts: host only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import types
from typing import Any

import tensorflow as tf
from absl import logging

from trainer.checkpoint.storage.local_steps import LocalSteps
from trainer.checkpoint.storage.reader import LATEST_DIR
from trainer.checkpoint.storage.writer import CheckpointWriter
from trainer.errors import storage_fault

KEEP = 2  # local steps kept per worker
ROOT = "tf-trainer-local"  # under $TMPDIR when checkpoint.local_dir is ""
#: The workdir's record that a run of its history wrote local steps (:func:`mark`).
MARKER = "local_tier.json"


def mark(workdir: str) -> None:
    """Records in ``workdir`` (a directory or a bucket prefix; the chief, before its
    first local save of a run) that its history writes local steps. A workdir without
    it (deleted and made afresh at the same path) has no local steps of its own: those
    found under its key are another run's (:func:`marked`)."""
    path = os.path.join(workdir, MARKER)
    if not tf.io.gfile.exists(path):
        tf.io.gfile.makedirs(workdir)
        with tf.io.gfile.GFile(path, "w") as f:
            f.write('{"local_tier": true}\n')


def marked(workdir: str) -> bool:
    """Whether a run of ``workdir``'s history wrote local steps (:func:`mark`)."""
    return tf.io.gfile.exists(os.path.join(workdir, MARKER))


def local_dir(workdir: str, worker: int, configured: str = "") -> str:
    """The local tier's directory of ``worker`` (its index among the run's workers) for
    ``workdir``: ``<configured or $TMPDIR/tf-trainer-local>/<workdir key>/task-<worker>``;
    the key is the workdir's last name and a hash of its whole path."""
    path = workdir.rstrip("/")
    digest = hashlib.sha256(path.encode()).hexdigest()[:12]
    parent = configured or os.path.join(tempfile.gettempdir(), ROOT)
    return os.path.join(parent, f"{os.path.basename(path) or 'workdir'}-{digest}",
                        f"task-{worker}")


class LocalTier:
    """One worker's local steps in ``directory`` (see the module doc).

    ``cfg``: ``config.checkpoint`` (``async_save``, ``fast_io``).
    """

    def __init__(self, directory: str, cfg: Any):
        self.directory = directory
        self._settings = types.SimpleNamespace(
            max_to_keep=KEEP, best_mode="max", async_save=cfg.async_save,
            fast_io=cfg.fast_io, staging_dir="")
        self._writer: CheckpointWriter | None = None

    def candidates(self) -> list[tuple[int, str]]:
        """``(step, path)`` of the committed local steps, newest first (a write the
        process did not finish is left for the next save to remove)."""
        if not os.path.isdir(os.path.join(self.directory, LATEST_DIR)):
            return []
        return LocalSteps(self.directory).candidates(warn_incomplete=False)

    def wait(self) -> None:
        """Blocks until the last write is committed (its host buffers are then free); a
        storage fault is one warning."""
        if self._writer is None:
            return
        try:
            self._writer.wait(LATEST_DIR)
        except Exception as error:  # noqa: BLE001 - only storage faults are handled
            self._fault(error, self._writer.pending(LATEST_DIR))

    def save(self, step: int, state: dict, manifest: dict) -> None:
        """Writes ``step`` (async with ``checkpoint.async_save``); the caller keeps
        ``state``'s arrays unchanged until :meth:`wait` returns. The first save of this
        tier removes the local steps from ``step`` on (another history's: a run that
        restored an older step, or rolled back; kept, they would outrank this run's). A
        storage fault is one warning, and the run goes on."""
        try:
            if self._writer is None:
                self._writer = CheckpointWriter(self.directory, self._settings, "")
                for later, path in self.candidates():
                    if later >= step:
                        logging.info("Removing the local checkpoint %s (another history's; "
                                     "this run continues from step %d).", path, step)
                        shutil.rmtree(path)
            self._writer.save(LATEST_DIR, step, state, manifest,
                              wait=not self._settings.async_save)
        except Exception as error:  # noqa: BLE001 - only storage faults are handled
            self._fault(error, step)

    def close(self) -> None:
        """Waits for the last write (a fault: one warning) and closes the writer."""
        if self._writer is None:
            return
        try:
            self._writer.close()
        except Exception as error:  # noqa: BLE001 - only storage faults are handled
            self._fault(error, self._writer.pending(LATEST_DIR))
        self._writer = None

    def remove(self) -> None:
        """Removes this worker's local steps (its directory; after :meth:`close`)."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def _fault(self, error: Exception, step: int | None) -> None:
        """A local write failed: re-raised unless a storage fault; else one warning and
        the writer is dropped (the next save makes a new one)."""
        if storage_fault(error) is None:
            raise error
        logging.warning("Local checkpoint of step %s in %s failed (%s); training goes on, "
                        "the workdir's checkpoints are the durable copy.", step,
                        self.directory, storage_fault(error))
        if self._writer is not None:
            self._writer.discard(LATEST_DIR)
        self._writer = None
