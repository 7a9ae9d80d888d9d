"""Where checkpoints live: orbax managers, keep-N / best-N, async writes, reading back.

Directories: ``workdir/checkpoints`` keeps the latest ``checkpoint.max_to_keep`` steps;
with ``checkpoint.best_metric`` a second manager in ``workdir/checkpoints_best`` keeps the
best ``max_to_keep`` by that metric (``best_mode``). ``checkpoint.async_save`` writes in
a background thread (training continues; the next save waits for the previous one).

One step directory holds two items: ``state`` (the arrays of
:mod:`trainer.checkpoint.state`) and ``manifest`` (JSON). Arrays are written by orbax's
stock ``PyTreeCheckpointHandler`` (uncompressed: zstd saved little disk on a float
training state for much more CPU per save; benchmarks/README.md), so any orbax user can
read them; with ``checkpoint.fast_io=True`` they are aligned ``.npy`` files written with
O_DIRECT (:mod:`trainer.checkpoint.array_files`: much less CPU per async save on VMs
whose page cache is expensive; ``np.load`` reads them, plain orbax does not). Reading
handles both formats.

Atomicity: orbax writes a step into ``<step>.orbax-checkpoint-tmp-*`` and renames it when
complete, so a crash mid-write leaves the previous steps intact. Reading ignores such
partial directories with a warning; a committed step that cannot be read is reported
as :class:`Unreadable`.

In a bucket (``gs://``) orbax writes each step into a local staging directory, and
:mod:`trainer.checkpoint.bucket` uploads it in parallel and commits it with orbax's GCS
commit marker (a handful of round trips instead of ~130 sequential requests); a restore
lists and downloads a step in parallel and reads it locally.

Only the chief imports orbax (and JAX, kept on the CPU with ``JAX_PLATFORMS=cpu``), on
first use: a run without checkpoints starts as fast as plain Keras. Orbax takes its
process index from JAX, which is not initialised across TF workers, so each process's
orbax is single-process. Contexts: host only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import tempfile
import time
from concurrent import futures
from typing import Any, Callable, Iterator

import numpy as np
import tensorflow as tf
from absl import logging

from trainer.checkpoint import array_files, bucket, checksums, orbax_logs

Known = Callable[[str], "tuple[int, int] | None"]  # a file's (size, CRC32C) if computed
LATEST_DIR = "checkpoints"
BEST_DIR = "checkpoints_best"


class Unreadable(Exception):
    """A committed step whose files cannot be read (corrupt or incomplete)."""


class StillWriting(Exception):
    """A write still runs when the time given to :meth:`CheckpointStore.wait` is up."""


def orbax():
    """Imports orbax (and JAX) on first use only; JAX stays off accelerators."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import orbax.checkpoint as ocp

    orbax_logs.quiet()
    return ocp


def state_handler(ocp, fast_io: bool, verified: bool = False, npy: Any = None):
    """The orbax handler of the ``state`` item.

    ``fast_io=False``: orbax's stock tensorstore handler (uncompressed). ``True``: the
    O_DIRECT ``.npy`` handler of :mod:`trainer.checkpoint.array_files` (``npy``, or a new
    one), which also reads stock checkpoints; reading always uses it, so either format
    restores. ``verified``: the handler also writes the item's checksums (for saving;
    see :func:`_verified_handlers`).
    """
    cls = _verified_handlers(ocp)["state"] if verified else ocp.PyTreeCheckpointHandler
    if not fast_io:
        return cls(use_compression=False)
    import jax  # already imported by orbax; its handler keeps orbax's array metadata on

    npy = npy or array_files.npy_file_handler(ocp)
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, npy), (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)))
    return cls(use_ocdbt=False, use_compression=False, type_handler_registry=registry,
               **({"known_checksums": functools.partial(array_files.claim, npy)}
                  if verified else {}))


def _saving_registry(ocp, fast_io: bool):
    """The item handlers of a manager: ``state`` and ``manifest``, both writing their
    checksums (registered by item, so orbax's global args registry is left alone)."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state = state_handler(ocp, fast_io, verified=True)
    manifest = _verified_handlers(ocp)["manifest"]()
    for args in (ocp.args.PyTreeSave, ocp.args.PyTreeRestore):
        registry.add("state", args, state)
    for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
        registry.add("manifest", args, manifest)
    return registry


@functools.cache
def _verified_handlers(ocp) -> dict[str, type]:
    """Orbax's PyTree and JSON handlers, each writing :mod:`~trainer.checkpoint.checksums`
    of its item when orbax finalises it (inside the temporary step directory, before the
    commit; in orbax's background thread for an async save)."""

    class VerifiedPyTree(ocp.PyTreeCheckpointHandler):
        def __init__(self, *args, known_checksums=lambda path: None, **kwargs):
            super().__init__(*args, **kwargs)
            self._known = known_checksums

        def finalize(self, directory) -> None:
            super().finalize(directory)
            checksums.write(os.fspath(directory), self._known)

    class VerifiedJson(ocp.JsonCheckpointHandler):
        def finalize(self, directory) -> None:
            super().finalize(directory)
            checksums.write(os.fspath(directory))

    return {"state": VerifiedPyTree, "manifest": VerifiedJson}


# ------------------------------------------------------------------- reading
def _existing_dirs(workdir: str) -> list[tuple[int, str]]:
    dirs = [os.path.join(workdir, LATEST_DIR), os.path.join(workdir, BEST_DIR)]
    return [(rank, d) for rank, d in enumerate(dirs) if tf.io.gfile.isdir(d)]


def candidates(workdir: str, warn_incomplete: bool = True) -> list[tuple[int, str]]:
    """Committed steps in both directories, newest first (latest dir before best).

    A step orbax is still writing (or never finished: ``<step>.orbax-checkpoint-tmp-*``)
    is not among them; ``warn_incomplete`` logs a warning for each such directory.
    """
    if bucket.is_bucket(workdir):
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
    if bucket.is_bucket(workdir):
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
    if not bucket.is_bucket(path):
        yield path
        return
    local = tempfile.mkdtemp(prefix="tf-trainer-restore-")
    try:
        directory, step = os.path.split(path.rstrip("/"))
        try:
            bucket.BucketSteps(directory).download(int(step), local)
        except (OSError, ValueError) as error:
            raise Unreadable(f"its files cannot be downloaded ({_short(error)})") from error
        yield local
    finally:
        shutil.rmtree(local, ignore_errors=True)


def incomplete_steps(workdir: str) -> list[int]:
    """The steps of :func:`incomplete`, ascending, each once."""
    return sorted({step for step, _ in incomplete(workdir)})


def _short(error: Exception) -> str:
    """The first, human-readable part of an orbax / tensorstore error."""
    text = str(error).split(" [tensorstore_spec")[0]
    return f"{type(error).__name__}: {text[:400]}"


def verify(path: str, known: Known = lambda p: None) -> bool:
    """Checks the files of the committed step directory ``path`` against the checksums
    written with them (:mod:`trainer.checkpoint.checksums`): True when they match, False
    when the step has none (written before checksums: unverified, still readable).
    ``known``: the checksums of files already read (:func:`read_state`), not read
    again. Raises :class:`Unreadable` naming the file that does not match (and its
    variable, for an array file of ours)."""
    try:
        return checksums.verify(path, known)
    except checksums.Mismatch as error:
        variable = _variable_of(path, error.file)
        raise Unreadable(f"cannot read variable '{variable}' ({error})" if variable
                         else str(error)) from error
    except (tf.errors.OpError, OSError) as error:
        raise Unreadable(f"its files cannot be read ({_short(error)})") from error


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
        raise Unreadable(f"its manifest cannot be read ({_short(error)})") from error


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
        raise Unreadable(f"cannot read{where or ' its state'} ({_short(error)})") from error


# ------------------------------------------------------------------- writing
class CheckpointStore:
    """The orbax managers of one workdir (chief only; created at the first save).

    Args:
      workdir: the run's directory. In a bucket (``gs://``) the managers write to a
        local staging directory and each step is uploaded once orbax committed it there
        (:mod:`trainer.checkpoint.bucket`; one upload thread, so steps commit in order);
        the steps orbax's retention removes from the staging directory are deleted from
        the bucket after the next commit, in a background thread (never after a
        ``wait`` save: a stop's save holds nothing but its own write).
      cfg: ``config.checkpoint`` (``max_to_keep``, ``best_mode``, ``async_save``,
        ``fast_io``).
      best_name: the metric the best manager ranks by (its key in ``metrics``).
    """

    def __init__(self, workdir: str, cfg: Any, best_name: str):
        self.workdir, self.cfg, self.best_name = workdir, cfg, best_name
        self._managers: dict[str, Any] = {}
        self._pending: dict[str, int] = {}
        self._staged = bucket.is_bucket(workdir)
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
            self._staging = bucket.staging_dir("checkpoints")
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
                handler_registry=_saving_registry(ocp, self.cfg.fast_io))
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
        except (checksums.Mismatch, tf.errors.OpError, OSError):
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
                                "save deletes them.", self.workdir, _short(error))
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
