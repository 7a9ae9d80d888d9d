"""Each worker's share of a step in a bucket: who uploads which array file, who reads it back.

On N workers (``MultiWorkerMirroredStrategy``) with a ``gs://`` workdir and
``checkpoint.fast_io``, the replicated state is bit-identical on every worker and each
array is one ``.npy`` file (``state/<group>.<i>.npy``,
:mod:`~trainer.checkpoint.storage.array_files`), so every worker stages the same step
(its own staging directory) with byte-identical array files. :func:`assign` splits a
step's array files over the workers, size-balanced (largest first, each to the least
loaded worker; the chief is rank 0), the same on every worker since it depends only on
the files' names and sizes:

* saving (:mod:`~trainer.checkpoint.storage.bucket_steps`): each worker uploads only
  its share, then writes its *share marker* ``_SHARE.<rank>.<digest>`` under the step
  (``digest``: a CRC32C of its files' names, sizes and CRC32Cs; or
  ``_SHARE.<rank>.failed`` holding the one-line reason); the chief uploads its share
  and everything that is not an array file (orbax's metadata, the manifest, the
  checksums), waits for every marker (:func:`await_shares`, listing the step), checks
  each digest against its own files (a worker whose files differ, a variable that is
  not the same on every worker, has its share sent again by the chief, with a
  warning), and only then writes the commit marker. So the
  committed step is the layout one host writes (plus the markers, which say who wrote
  what), readable by plain orbax and numpy alike, and a worker that fails its share
  fails the save on the chief (its error names the worker and the reason);
* reading (:mod:`~trainer.checkpoint.resume`): each worker downloads its share under
  the same assignment over the *current* worker count (plus the small files), checks
  it against the step's checksums, and the owner of each array sends it to the others
  in one sum over the workers
  (:func:`trainer.distribution.host_collectives.gather_owned`).

A large single array is not sliced: the largest array bounds the largest share.
Contexts: host; any thread (the markers from the upload threads).
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
from typing import Callable, Iterable

import google_crc32c
import numpy as np
import tensorflow as tf
from absl import logging

from trainer.checkpoint.storage import array_files as npy_files
from trainer.checkpoint.storage import checksums
from trainer.checkpoint.storage.handlers import short_error
from trainer.checkpoint.storage.reader import Unreadable, verify

MARKER = "_SHARE."  # the prefix of a worker's share marker, under the step
FAILED = "failed"  # a share marker's suffix when the worker's share failed
ARRAY_FILE = re.compile(r"state/[^/]+\.npy")  # an array file of the state item
WAIT_S = 180.0  # how long the chief waits for every share marker of a step
_POLL_S = (0.1, 1.0)  # the chief's listings of the step: first and longest interval


class ShareFailed(OSError):
    """A worker's share of a step is not in the bucket (failed or never came): an I/O
    error of the save (:func:`trainer.errors.storage_fault`), its reason logged as a
    warning when made (the save's failure line names the error's kind only)."""

    def __init__(self, message: str):
        super().__init__(errno.EIO, message)
        logging.warning("The checkpoint cannot be committed: %s.", message)


def array_files(sizes: dict[str, int]) -> dict[str, int]:
    """The array files (``state/*.npy``) among ``{name relative to the step: size}``."""
    return {name: size for name, size in sizes.items() if ARRAY_FILE.fullmatch(name)}


def splittable(names: Iterable[str]) -> bool:
    """Whether a step of these objects (names relative to the step) can be read in
    shares: it has array files and its ``state`` item holds no other array data (a
    leaf orbax's tensorstore wrote lives in a subdirectory of ``state``)."""
    names = list(names)
    state = [n for n in names if n.startswith("state/")]
    return any(ARRAY_FILE.fullmatch(n) for n in state) and all(
        "/" not in n[len("state/"):] for n in state)


def assign(sizes: dict[str, int], workers: int) -> dict[str, int]:
    """``{array file: the rank that uploads and reads it}``: largest first, each to the
    least loaded rank (ties: the lowest), so the same everywhere."""
    loads, owner = [0] * workers, {}
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        rank = min(range(workers), key=lambda r: (loads[r], r))
        owner[name] = rank
        loads[rank] += size
    return owner


def share_of(sizes: dict[str, int], workers: int, rank: int) -> list[str]:
    """The array files among ``sizes`` that ``rank`` uploads and reads, sorted."""
    return sorted(n for n, r in assign(array_files(sizes), workers).items() if r == rank)


def digest(table: dict[str, tuple[int, int]], names: Iterable[str]) -> str:
    """A CRC32C (8 hex digits) of ``names``' ``(name, size, CRC32C)`` in ``table``."""
    rows = [[name, *table.get(name, (-1, -1))] for name in sorted(names)]
    return f"{google_crc32c.value(json.dumps(rows).encode()):08x}"


def marker(rank: int, value: str) -> str:
    """The share marker's name of ``rank`` (``value``: its digest, or :data:`FAILED`)."""
    return f"{MARKER}{rank}.{value}"


def _reported(names: Iterable[str]) -> dict[int, str]:
    """``{rank: digest or FAILED}`` of the share markers among ``names`` (relative to
    the step)."""
    out = {}
    for name in names:
        head, _, value = name.partition(MARKER)[2].partition(".")
        if name.startswith(MARKER) and head.isdigit():
            out[int(head)] = value
    return out


def await_shares(directory, step: int, expected: dict[int, str],
                 timeout: float = WAIT_S) -> list[int]:
    """Waits until every rank of ``expected`` (``{rank: digest}``) has its share marker
    under ``step`` of the :class:`~trainer.checkpoint.storage.bucket.BucketDirectory`
    ``directory`` (one listing of the step each poll); returns the ranks whose digest
    is not the expected one (their files differ from the chief's: the chief sends its
    own). Raises :class:`ShareFailed` naming the worker whose share failed (with its
    reason) or (after ``timeout`` s) that did not report."""
    deadline, pause = time.monotonic() + timeout, _POLL_S[0]
    while True:
        reported = _reported(n.partition("/")[2] for n in directory.listing(step))
        for rank, value in sorted(reported.items()):
            if rank in expected and value == FAILED:
                reason = directory.read_text(step, marker(rank, FAILED))
                raise ShareFailed(f"worker {rank} could not upload its share of step {step}: "
                                  f"{reason}")
        missing = sorted(set(expected) - set(reported))
        if not missing:
            return [rank for rank in sorted(expected) if reported[rank] != expected[rank]]
        if time.monotonic() > deadline:
            raise ShareFailed(f"worker(s) {', '.join(map(str, missing))} did not report "
                              f"their share of step {step} within {timeout:.0f} s")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_S[1])


def wanted(names: dict[str, int], workers: int, rank: int) -> Callable[[str], bool]:
    """Which objects of a step (``names``: ``{name relative to the step: size}``)
    ``rank`` of ``workers`` downloads to read its share: its array files and every file
    that is not an array file (small: the manifest, orbax's metadata, the checksums)."""
    mine = set(share_of(names, workers, rank))
    return lambda name: name in mine or not ARRAY_FILE.fullmatch(name)


def read_share(local: str, manifest: dict, names: dict[str, int], workers: int,
               rank: int) -> tuple[list[np.ndarray | None], bool]:
    """The arrays of the manifest, flat in its order: those of ``rank``'s share read from
    the step downloaded to ``local`` (:func:`wanted`) and checked against the step's
    checksums, None for the others; the step's other files checked too. Also whether the
    step has checksums (False: written before them, unverified). Raises
    :class:`Unreadable` naming the variable whose file is missing, damaged or not the
    manifest's shape and dtype."""
    mine = set(share_of(names, workers, rank))
    try:
        table = checksums.step_table(local) if checksums.has_checksums(local) else {}
    except (ValueError, KeyError, TypeError, OSError, tf.errors.OpError) as error:
        raise Unreadable(f"its checksums cannot be read ({short_error(error)})") from error
    out: list[np.ndarray | None] = []
    for group, entries in manifest["groups"].items():
        for index, (variable, shape, dtype) in enumerate(entries):
            rel = f"state/{group}.{index}.npy"
            if rel not in mine:
                if rel not in names:
                    raise Unreadable(f"cannot read variable '{variable}' ({rel} is missing)")
                out.append(None)
                continue
            out.append(_read_checked(os.path.join(local, rel), rel, variable, table,
                                     (list(shape), np.dtype(dtype))))
    return out, verify(local, only=lambda rel: not ARRAY_FILE.fullmatch(rel))


def _read_checked(path: str, rel: str, variable: str, table: dict, like: tuple
                  ) -> np.ndarray:
    """The array file ``path`` (``rel`` in the step), checked against ``table`` (the
    step's checksums; none: unverified) and ``like`` (its shape and dtype)."""
    try:
        array, checksum = npy_files.read_npy(path)
        checksum = checksum or checksums.file_crc(path)
    except (ValueError, OSError) as error:
        raise Unreadable(f"cannot read variable '{variable}' ({short_error(error)})") from error
    if rel in table and tuple(table[rel]) != tuple(checksum):
        raise Unreadable(f"cannot read variable '{variable}' ({rel} does not match its "
                         f"checksum: written {tuple(table[rel])}, read {tuple(checksum)})")
    if (list(array.shape), array.dtype) != like:
        raise Unreadable(f"cannot read variable '{variable}' ({rel} holds {array.dtype} "
                         f"{list(array.shape)}, the manifest says {like[1]} {like[0]})")
    return array
