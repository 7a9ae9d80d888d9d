"""A workdir's checkpoint steps on a file system: orbax's own directories, commits and listing.

Orbax writes a step into ``<kind>/<step>.orbax-checkpoint-tmp-*`` and renames it to
``<kind>/<step>`` when complete (its commit), so a crash mid-write leaves the previous
steps intact; a step is read where it lies. The writer's side is orbax's own: nothing is
staged or uploaded. The other side of :func:`trainer.checkpoint.storage.steps.steps_for`
is :mod:`trainer.checkpoint.storage.bucket_steps`. Contexts: host only.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import tensorflow as tf
from absl import logging

from trainer.checkpoint.storage import checksums
from trainer.checkpoint.storage.handlers import orbax
from trainer.checkpoint.storage.reader import KINDS, newest_first


class LocalSteps:
    """The checkpoint steps of the workdir ``workdir`` on a file system."""

    staged = False

    def __init__(self, workdir: str):
        self.workdir = workdir

    # ------------------------------------------------------------------ reading
    def _existing(self) -> list[tuple[int, str]]:
        dirs = [os.path.join(self.workdir, kind) for kind in KINDS]
        return [(rank, d) for rank, d in enumerate(dirs) if tf.io.gfile.isdir(d)]

    def candidates(self, warn_incomplete: bool = True) -> list[tuple[int, str]]:
        """Committed steps in both directories, newest first (latest dir before best);
        ``warn_incomplete`` logs a warning for each directory orbax has not committed."""
        existing = self._existing()
        if not existing:
            return []  # a fresh run does not pay for importing orbax
        ocp = orbax()
        found = []
        for rank, directory in existing:
            for path in (ocp.path.step.tmp_checkpoints(directory) if warn_incomplete else []):
                logging.warning("Ignoring the incomplete checkpoint %s/%s (a save that did not "
                                "finish; removed at the next save).", directory, path)
            for step in ocp.path.step.checkpoint_steps(directory):
                found.append((step, rank, os.path.join(directory, str(step))))
        return newest_first(found)

    def incomplete(self) -> list[tuple[int, str]]:
        """``(step, path)`` of every directory orbax has not committed (being written, or
        a save that never finished), in both directories, newest first."""
        existing = self._existing()
        if not existing:
            return []
        ocp = orbax()
        found = [(ocp.path.step.step_from_checkpoint_name(os.path.basename(str(path))),
                  os.path.join(directory, os.path.basename(str(path))))
                 for _, directory in existing
                 for path in ocp.path.step.tmp_checkpoints(directory)]
        return sorted(found, key=lambda f: -f[0])

    @contextlib.contextmanager
    def readable(self, path: str) -> Iterator[str]:
        """The committed step directory ``path`` itself: read where it lies."""
        yield path

    # ------------------------------------------------------------------ writing
    def directory(self, kind: str) -> str:
        """Where orbax's manager of ``kind`` writes: ``workdir/kind``."""
        return os.path.join(self.workdir, kind)

    def opened(self, kind: str) -> None:
        """A manager of ``kind`` is made: orbax makes its directory."""

    def committed(self, kind: str, step: int, manager: Any) -> bool:
        """Whether ``step`` of ``kind`` is committed, as the file system shows: listed,
        and every file its checksums name there with the size written (one stat per
        file, nothing read)."""
        if step not in manager.all_steps(read=True):
            return False
        try:
            return checksums.verify(os.path.join(self.workdir, kind, str(step)), read=False)
        except (checksums.ChecksumMismatch, tf.errors.OpError, OSError):
            return False

    def saved(self, kind: str, step: int, manager: Any, retain: bool) -> None:
        """Orbax's manager took the save of ``step``: it commits it itself."""

    def writing(self, kind: str, manager: Any) -> bool:
        """Whether ``manager`` (of ``kind``; None: none open) is still writing."""
        return manager is not None and manager.is_saving_in_progress()

    def wait(self, kind: str, timeout: float | None) -> None:
        """Orbax's wait was all there is to wait for."""

    def delete(self, kind: str, step: int) -> None:
        """Nothing beside orbax's own deletion of the step."""

    def vanished(self, kind: str) -> bool:
        """Whether the directory of ``kind`` is gone (deleted during the run: ``rm -rf`` of
        the workdir by a user or a cleaner)."""
        return not tf.io.gfile.isdir(os.path.join(self.workdir, kind))

    def discard(self, kind: str) -> None:
        """Nothing to undo beside orbax's manager (the next one removes the step left
        incomplete)."""

    def last_committed(self, kind: str) -> int | None:
        """None: the file system is asked instead."""
        return None

    def abandon(self) -> None:
        """No thread of its own to give up."""

    def close(self) -> None:
        """Nothing of its own to close."""
