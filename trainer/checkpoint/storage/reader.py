"""Reading one committed step directory: its manifest, its arrays and their checksums, and
the names every storage module shares (a workdir's two checkpoint directories, the order
steps are tried in, :class:`Unreadable`).

Directories: ``workdir/checkpoints`` keeps the latest ``checkpoint.max_to_keep`` steps;
with ``checkpoint.best_metric`` a second manager in ``workdir/checkpoints_best`` keeps the
best ``max_to_keep`` by that metric (``best_mode``). Which steps a workdir holds, and a
local path to read one from, are its storage's
(:func:`trainer.checkpoint.storage.steps.steps_for`); everything here reads a local
directory. A committed step that cannot be read is reported as :class:`Unreadable`.
Contexts: host only.
"""

from __future__ import annotations

import functools
import re
from typing import Callable

import numpy as np
import tensorflow as tf

from trainer.checkpoint.storage import array_files, checksums
from trainer.checkpoint.storage.handlers import orbax, short_error, state_handler

Known = Callable[[str], "tuple[int, int] | None"]  # a file's (size, CRC32C) if computed
LATEST_DIR = "checkpoints"
BEST_DIR = "checkpoints_best"
KINDS = (LATEST_DIR, BEST_DIR)  # a workdir's checkpoint directories, in the order tried


class Unreadable(Exception):
    """A committed step whose files cannot be read (corrupt or incomplete)."""


def newest_first(found: list[tuple[int, int, str]]) -> list[tuple[int, str]]:
    """``(step, rank of its directory in KINDS, path)`` -> ``(step, path)``, newest
    first; at one step, the latest directory's copy before the best one's."""
    return [(step, path) for step, _, path in sorted(found, key=lambda f: (-f[0], f[1]))]


def verify(path: str, known: Known = lambda p: None,
           only: Callable[[str], bool] = lambda rel: True) -> bool:
    """Checks the files of the committed step directory ``path`` against the checksums
    written with them (:mod:`trainer.checkpoint.storage.checksums`): True when they match, False
    when the step has none (written before checksums: unverified, still readable).
    ``known``: the checksums of files already read (:func:`read_state`), not read
    again; ``only``: the files checked (relative to ``path``; default all). Raises
    :class:`Unreadable` naming the file that does not match (and its variable, for an
    array file of ours)."""
    try:
        return checksums.verify(path, known, only=only)
    except checksums.ChecksumMismatch as error:
        variable = _variable_of(path, error.file)
        raise Unreadable(f"cannot read variable '{variable}' ({error})" if variable
                         else str(error)) from error
    except (tf.errors.OpError, OSError) as error:
        raise Unreadable(f"its files cannot be read ({short_error(error)})") from error


def _variable_of(path: str, file: str) -> str | None:
    """The variable stored in ``file`` (``state/<group>.<i>.npy``) of the step
    directory ``path``, by its manifest; None when not known."""
    match = re.fullmatch(r"state/(\w+)\.(\d+)\.npy", file)
    if not match:
        return None
    try:
        entries = read_manifest(path)["groups"].get(match.group(1), [])
    except Unreadable:
        return None
    index = int(match.group(2))
    return entries[index][0] if index < len(entries) else None


def read_manifest(path: str) -> dict:
    """The manifest of the step directory ``path``; :class:`Unreadable` if it cannot be read."""
    ocp = orbax()
    try:
        restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
            path, args=ocp.args.Composite(manifest=ocp.args.JsonRestore()))
        return dict(restored["manifest"])
    except (ValueError, KeyError, OSError, TypeError) as error:
        raise Unreadable(f"its manifest cannot be read ({short_error(error)})") from error


def read_state(path: str, manifest: dict) -> tuple[dict[str, list[np.ndarray]], Known]:
    """The arrays of ``path``, in the manifest's order, and ``known``: the ``(size,
    CRC32C)`` of each ``.npy`` file computed from the bytes read, for
    :func:`verify` (so the check reads those files no second time). Raises
    :class:`Unreadable` naming the variable whose file cannot be read."""
    ocp = orbax()
    target = {g: [np.empty(shape, dtype) for _, shape, dtype in entries]
              for g, entries in manifest["groups"].items()}
    npy = array_files.npy_file_handler(ocp)
    try:
        restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler(
            state=state_handler(ocp, fast_io=True, npy=npy))).restore(
            path, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(target)))
        return restored["state"], functools.partial(array_files.claim, npy)
    except (ValueError, KeyError, OSError, TypeError) as error:
        where = ""  # the variable, from the leaf name ("model.3") the error gives
        for match in re.finditer(r'\b(\w+)\.(\d+)\b', str(error)):
            entries = manifest["groups"].get(match.group(1), [])
            if int(match.group(2)) < len(entries):
                where = f" variable '{entries[int(match.group(2))][0]}'"
                break
        raise Unreadable(f"cannot read{where or ' its state'} ({short_error(error)})") from error
