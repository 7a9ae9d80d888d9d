"""Reading checkpoints: the directories, the committed steps, reading and verifying a step
(the writer: :mod:`trainer.checkpoint.storage.writer`; orbax's item handlers:
:mod:`trainer.checkpoint.storage.handlers`).

Directories: ``workdir/checkpoints`` keeps the latest ``checkpoint.max_to_keep`` steps;
with ``checkpoint.best_metric`` a second manager in ``workdir/checkpoints_best`` keeps the
best ``max_to_keep`` by that metric (``best_mode``).

Atomicity: orbax writes a step into ``<step>.orbax-checkpoint-tmp-*`` and renames it when
complete, so a crash mid-write leaves the previous steps intact. Reading ignores such
partial directories with a warning; a committed step that cannot be read is reported
as :class:`Unreadable`.

In a bucket (``gs://``) a step is committed by orbax's GCS commit marker
(:mod:`trainer.checkpoint.storage.bucket`); a restore lists and downloads a step in
parallel and reads it locally. Contexts: host only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import tempfile
from typing import Callable, Iterator

import numpy as np
import tensorflow as tf
from absl import logging

from tf_cluster.storage_schemes import is_bucket
from trainer.checkpoint.storage import array_files, bucket, checksums
from trainer.checkpoint.storage.handlers import orbax, short_error, state_handler

Known = Callable[[str], "tuple[int, int] | None"]  # a file's (size, CRC32C) if computed
LATEST_DIR = "checkpoints"
BEST_DIR = "checkpoints_best"


class Unreadable(Exception):
    """A committed step whose files cannot be read (corrupt or incomplete)."""



# ------------------------------------------------------------------- reading
def _existing_dirs(workdir: str) -> list[tuple[int, str]]:
    dirs = [os.path.join(workdir, LATEST_DIR), os.path.join(workdir, BEST_DIR)]
    return [(rank, d) for rank, d in enumerate(dirs) if tf.io.gfile.isdir(d)]


def candidates(workdir: str, warn_incomplete: bool = True) -> list[tuple[int, str]]:
    """Committed steps in both directories, newest first (latest dir before best).

    A step orbax is still writing (or never finished: ``<step>.orbax-checkpoint-tmp-*``)
    is not among them; ``warn_incomplete`` logs a warning for each such directory.
    """
    if is_bucket(workdir):
        return _bucket_steps(workdir, warn_incomplete)[0]
    existing = _existing_dirs(workdir)
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
    return [(step, path) for step, _, path in sorted(found, key=lambda f: (-f[0], f[1]))]


def incomplete(workdir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every directory orbax has not committed (being written, or a
    save that never finished), in both directories, newest first."""
    if is_bucket(workdir):
        return _bucket_steps(workdir, False)[1]
    existing = _existing_dirs(workdir)
    if not existing:
        return []
    ocp = orbax()
    found = [(ocp.path.step.step_from_checkpoint_name(os.path.basename(str(path))),
              os.path.join(directory, os.path.basename(str(path))))
             for _, directory in existing
             for path in ocp.path.step.tmp_checkpoints(directory)]
    return sorted(found, key=lambda f: -f[0])


def _bucket_steps(workdir: str, warn_incomplete: bool
                  ) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """:func:`candidates` and :func:`incomplete` of a workdir in a bucket: one listing
    of each checkpoint directory (a step is committed when its marker is there)."""
    found, partial = [], []
    for rank, kind in enumerate((LATEST_DIR, BEST_DIR)):
        directory = os.path.join(workdir, kind)
        steps = bucket.BucketSteps(directory)
        names = steps.listing()
        for step in steps.incomplete_steps(names):
            partial.append((step, os.path.join(directory, str(step))))
            if warn_incomplete:
                logging.warning("Ignoring the incomplete checkpoint %s/%d (a save that did "
                                "not finish; removed at the next save).", directory, step)
        found += [(step, rank, os.path.join(directory, str(step)))
                  for step in steps.committed_steps(names)]
    ordered = [(step, path) for step, _, path in sorted(found, key=lambda f: (-f[0], f[1]))]
    return ordered, sorted(partial, key=lambda f: -f[0])


@contextlib.contextmanager
def readable(path: str) -> Iterator[str]:
    """A path to read the committed step directory ``path`` from: itself, or for a step
    in a bucket a local copy (listed and downloaded in parallel; removed afterwards),
    so reading and checking its files costs no further requests."""
    if not is_bucket(path):
        yield path
        return
    local = tempfile.mkdtemp(prefix="tf-trainer-restore-")
    try:
        directory, step = os.path.split(path.rstrip("/"))
        try:
            bucket.BucketSteps(directory).download(int(step), local)
        except (OSError, ValueError) as error:
            raise Unreadable(f"its files cannot be downloaded ({short_error(error)})") from error
        yield local
    finally:
        shutil.rmtree(local, ignore_errors=True)


def incomplete_steps(workdir: str) -> list[int]:
    """The steps of :func:`incomplete`, ascending, each once."""
    return sorted({step for step, _ in incomplete(workdir)})


def verify(path: str, known: Known = lambda p: None) -> bool:
    """Checks the files of the committed step directory ``path`` against the checksums
    written with them (:mod:`trainer.checkpoint.storage.checksums`): True when they match, False
    when the step has none (written before checksums: unverified, still readable).
    ``known``: the checksums of files already read (:func:`read_state`), not read
    again. Raises :class:`Unreadable` naming the file that does not match (and its
    variable, for an array file of ours)."""
    try:
        return checksums.verify(path, known)
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
