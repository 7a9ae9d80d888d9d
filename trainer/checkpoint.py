"""Checkpoints on orbax-checkpoint: full training state, resume, preemption, export.

What a checkpoint holds (one orbax step directory, two items):

* ``state``: a pytree of numpy arrays, ``{group: [array, ...]}`` with the groups
  ``model`` (every model variable, including Keras ``SeedGenerator`` states: the RNG
  state of dropout and random layers), ``optimizer`` (every variable of
  ``trainer.optimizer``: slots, ``iterations``, learning rate), one group per other
  ``keras.Model`` / ``keras.optimizers.Optimizer`` attribute of the Trainer (e.g. a
  second optimizer; variables already saved are not repeated), and ``trainer``
  (``step_counter`` and the loss-scale state: ``scale``, ``good_steps``,
  ``skipped_steps``, ``last_skipped_step``);
* ``manifest``: JSON with the step (the input position: global batches consumed),
  ``global_batch_size``, ``seed``, replica/worker counts, and each group's variable
  names, shapes and dtypes.

Variables are matched by POSITION within a group (Keras names get ``_1`` suffixes when
a process builds a second model) and checked by shape and dtype, so a mismatch is an
error naming the variable. Restore assigns into the variables the current strategy
created, so a checkpoint written with 4 replicas restores into 1, 2 or another strategy.
Training metrics (window means) are not saved: the first logged window after a resume
covers only the steps run since.

Directories: ``workdir/checkpoints`` keeps the latest ``checkpoint.max_to_keep`` steps;
with ``checkpoint.best_metric`` (``"eval/NAME"`` or ``"train/NAME"``) a separate manager
in ``workdir/checkpoints_best`` keeps the best ``max_to_keep`` by that metric
(``best_mode``), in addition to the latest, and the best one is exported to
``workdir/export/best`` at the end of ``fit()``. Saves happen at every multiple of
``checkpoint.every_steps``, at the end of ``fit()`` and on preemption;
``checkpoint.async_save`` writes in a background thread (training continues, the next
save waits for the previous one). The loop is held only while the state is copied to
host memory; that copy goes into buffers kept between the saves of one ``fit()`` (one
state-sized host copy per directory in use, freed when ``fit()`` returns). Arrays are
stored uncompressed, one ``.npy`` file each, written around the page cache
(:mod:`trainer.array_files`).

Atomicity: orbax writes a step into ``<step>.orbax-checkpoint-tmp-*`` and renames it
when complete, so a crash mid-write leaves the previous steps intact. Restore ignores
such partial directories with a warning; when resuming (``step=None``) a committed step
that cannot be read is skipped with a warning and the previous one is tried.

Multi-worker: only the chief (``distribute.is_chief``) imports orbax, writes and reads;
every worker takes part in a restore, which the chief performs and broadcasts to the
others over TF collectives (the other workers need no access to the chief's files).
Orbax takes its process index from JAX, which is not initialised across TF workers, so
each process's orbax is single-process (``JAX_PLATFORMS`` defaults to ``cpu`` so JAX
never claims an accelerator).

Exact resume of the input: the step is restored BEFORE the train dataset is built, and
``data.distribute(..., skip_batches=step)`` skips the consumed batches in every input
pipeline. This is exact only for a deterministic pipeline (``train.deterministic``,
seeded shuffles, no dependence on wall time); a warning says when it cannot hold.

Preemption: during ``fit()`` SIGTERM sets a flag; at the next loop boundary every
worker agrees (one tiny all-reduce per loop on multi-worker runs), the chief saves the
current step synchronously, all workers pass a barrier and ``fit()`` raises
:class:`Preempted`; ``trainer.main`` exits with :data:`EXIT_PREEMPTED` (42, the code of
TF's own preemption handler) and a restart resumes. TF's ``PreemptionCheckpointHandler``
is not used: it is bound to ``tf.train.Checkpoint`` and does not initialise on CPU or
GCP TPU; this signal path works on every strategy.

Contexts: everything here runs on the host, eagerly, in cross-replica context, between
``tf.function`` calls.
"""

from __future__ import annotations

import json
import logging as pylogging
import math
import os
import re
import signal
import sys
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from trainer import array_files, distribute
from trainer.loop import Component, next_boundary

if TYPE_CHECKING:
    from trainer.trainer import Trainer

EXIT_PREEMPTED = 143  # trainer.main's exit code after a preemption save; restart to resume
LATEST_DIR = "checkpoints"
BEST_DIR = "checkpoints_best"
BEST_EXPORT_DIR = os.path.join("export", "best")
FORMAT = 1
_SUM = tf.distribute.ReduceOp.SUM


class CheckpointError(RuntimeError):
    """A checkpoint cannot be restored; the message names the step, variable and fix."""


class Preempted(RuntimeError):
    """Raised by ``fit()`` after SIGTERM once the state at ``step`` is saved."""

    def __init__(self, step: int):
        super().__init__(f"preempted at step {step}; a checkpoint of that step was saved. "
                         f"Restart the same command to resume.")
        self.step = step


class _Unreadable(Exception):
    """A committed step whose files cannot be read (corrupt or incomplete)."""


def _orbax():
    """Imports orbax (and JAX) on first use only; JAX stays off accelerators."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import orbax.checkpoint as ocp

    handler = logging.get_absl_handler()  # orbax logs through absl, JAX through logging
    if not any(isinstance(f, _QuietOrbax) for f in handler.filters):
        handler.addFilter(_QuietOrbax())
        # Also on the absl logger: without absl's app.run, another handler prints it.
        pylogging.getLogger("absl").addFilter(_QuietOrbax())
        sys.unraisablehook = _without_closed_loop_noise(sys.unraisablehook)
    return ocp


def _state_handler(ocp):
    """The orbax handler that writes and reads the ``state`` item.

    Leaves go through :mod:`trainer.array_files`: one ``.npy`` per array, written
    with O_DIRECT from the :func:`snapshot` buffers (page-aligned, untouched until the
    write is done, so no defensive copy), which keeps the background write's CPU
    (and so an async save's stall) 10x lower than through the page cache. No
    compression: zstd saved 8% of a float training state for 4x the CPU per save.
    Checkpoints written by orbax's tensorstore handler (before this format) restore
    through the same handler.
    """
    import jax  # already imported by orbax; its handler keeps orbax's array metadata on

    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, array_files.npy_file_handler(ocp)),
        (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)))
    return ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_compression=False,
                                       type_handler_registry=registry)


def _without_closed_loop_noise(previous):
    """An unraisable-exception hook that drops orbax's closed-event-loop echoes.

    When one array of a checkpoint cannot be read, orbax closes its asyncio loop while
    tensorstore still completes the other reads; each completion then reports
    "RuntimeError: Event loop is closed" with a traceback. The read error itself is
    raised (and reported) normally; only these echoes are dropped.
    """

    def hook(unraisable) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        previous(unraisable)

    return hook


class _QuietOrbax(pylogging.Filter):
    """Drops orbax's and JAX's INFO lines (a dozen per save) and orbax's warning that a
    save holds no OCDBT data to merge (the ``state`` leaves are ``.npy`` files, see
    :func:`_state_handler`); other warnings and errors pass."""

    _SOURCES = (f"{os.sep}orbax{os.sep}", f"{os.sep}jax{os.sep}")
    _EXPECTED = "Skipping merge of OCDBT checkpoints: No per-process OCDBT"

    def filter(self, record: pylogging.LogRecord) -> bool:
        path = record.pathname or ""
        if not any(s in path for s in self._SOURCES):
            return True
        return record.levelno >= pylogging.WARNING and self._EXPECTED not in record.getMessage()


# ------------------------------------------------------------------ state
def _name(variable) -> str:
    path = getattr(variable, "path", None)
    return path if isinstance(path, str) else variable.name.split(":")[0]


def state_variables(trainer: "Trainer") -> dict[str, list[tuple[str, Any]]]:
    """The variables a checkpoint holds, by group: ``{group: [(name, variable), ...]}``.

    Groups, in order: ``model``, ``optimizer``, one per other ``keras.Model`` or
    Keras optimizer attribute of ``trainer`` (by attribute name, sorted), ``trainer``.
    A variable appears once (in its first group). The optimizer must be built.
    """
    groups: dict[str, list[tuple[str, Any]]] = {}
    seen: set[int] = set()

    def add(group: str, variables) -> None:
        entries = []
        for variable in variables:
            if id(variable) not in seen:
                seen.add(id(variable))
                entries.append((_name(variable), variable))
        if entries:
            groups[group] = entries

    add("model", trainer.model.variables)
    add("optimizer", trainer.optimizer.variables)
    for attr, value in sorted(vars(trainer).items()):
        if attr.startswith("_") or attr in ("model", "optimizer"):
            continue
        if isinstance(value, (keras.Model, keras.optimizers.Optimizer)):
            add(attr, value.variables)
    p = trainer.precision
    add("trainer", [trainer.step_counter, p.scale, p.good_steps, p.skipped_steps,
                    p.last_skipped_step])
    return groups


def _manifest(trainer: "Trainer", groups: dict) -> dict:
    return {
        "format": FORMAT,
        "step": int(trainer.step),
        "global_batch_size": int(trainer.config.train.global_batch_size),
        "seed": int(trainer.config.seed),
        "replicas": int(trainer.strategy.num_replicas_in_sync),
        "workers": distribute.num_workers(trainer.strategy),
        "groups": {g: [[name, list(v.shape), _dtype(v)] for name, v in entries]
                   for g, entries in groups.items()},
    }


def _dtype(variable) -> str:
    return np.dtype(tf.as_dtype(variable.dtype).as_numpy_dtype).name


def snapshot(trainer: "Trainer", reuse: dict[str, list[np.ndarray]] | None = None
             ) -> tuple[dict[str, list[np.ndarray]], dict]:
    """Host copies of the training state and its manifest (cross-replica context).

    Arrays are ``np.ndarray`` (0-d for scalars: orbax rejects numpy scalars); they are
    snapshots, safe to write while training continues. ``reuse``: the state of an
    earlier snapshot whose arrays are overwritten in place where shape and dtype still
    match (the caller makes sure nothing reads them any more). Copying into warm
    buffers avoids faulting in fresh pages: 0.06 s instead of 0.3-1.4 s for 577 MB.
    """
    groups = state_variables(trainer)
    reuse = reuse or {}
    state = {}
    for group, entries in groups.items():
        old = reuse.get(group, [])
        arrays = []
        for i, (_, variable) in enumerate(entries):
            # A read of the variable, seen as numpy without a copy (on CPU); the one
            # copy is the one below. (``Variable.numpy()`` would copy into fresh memory.)
            value = np.asarray(tf.convert_to_tensor(variable))
            if i < len(old) and old[i].shape == value.shape and old[i].dtype == value.dtype:
                np.copyto(old[i], value)
                arrays.append(old[i])
            else:
                copy = array_files.aligned_empty(value.shape, value.dtype)
                np.copyto(copy, value)
                arrays.append(copy)
        state[group] = arrays
    return state, _manifest(trainer, groups)


def _check_compatible(manifest: dict, groups: dict, where: str) -> None:
    """Raises CheckpointError naming the first variable that does not match."""
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where} has format {manifest.get('format')!r}; this version "
                              f"reads format {FORMAT}.")
    saved_groups = manifest["groups"]
    fix = ("The model or optimizer changed since the checkpoint was written: train in a "
           "fresh --workdir, or restore the configuration that wrote it.")
    extra = sorted(set(saved_groups) - set(groups))
    if extra:
        raise CheckpointError(f"{where} holds {len(saved_groups[extra[0]])} variables of "
                              f"'{extra[0]}' (first: '{saved_groups[extra[0]][0][0]}') that "
                              f"this Trainer does not have. {fix}")
    for group, entries in groups.items():
        saved = saved_groups.get(group, [])
        for i, (name, variable) in enumerate(entries):
            if i >= len(saved):
                raise CheckpointError(
                    f"Variable '{name}' ({group} #{i}, shape {list(variable.shape)}) is "
                    f"missing from {where}, which holds {len(saved)} {group} variables "
                    f"(the Trainer has {len(entries)}). {fix}")
            saved_name, saved_shape, saved_dtype = saved[i]
            if list(variable.shape) != list(saved_shape):
                raise CheckpointError(
                    f"Variable '{name}' has shape {list(variable.shape)} but {where} holds "
                    f"shape {saved_shape} for it (saved as '{saved_name}'). {fix}")
            if _dtype(variable) != saved_dtype:
                raise CheckpointError(
                    f"Variable '{name}' has dtype {_dtype(variable)} but {where} holds "
                    f"{saved_dtype} for it (saved as '{saved_name}'). {fix}")
        if len(saved) > len(entries):
            raise CheckpointError(
                f"{where} holds {len(saved)} {group} variables but the Trainer has "
                f"{len(entries)}; '{saved[len(entries)][0]}' has no counterpart. {fix}")


def _assign(groups: dict, state: dict) -> None:
    for group, entries in groups.items():
        for (_, variable), value in zip(entries, state[group]):
            variable.assign(value)


# -------------------------------------------------------------- directories
def _dirs(workdir: str) -> list[str]:
    return [os.path.join(workdir, LATEST_DIR), os.path.join(workdir, BEST_DIR)]


def _candidates(workdir: str) -> list[tuple[int, str]]:
    """Committed steps in both directories, newest first (latest dir before best)."""
    existing = [(rank, d) for rank, d in enumerate(_dirs(workdir)) if tf.io.gfile.isdir(d)]
    if not existing:
        return []  # a fresh run does not pay for importing orbax
    ocp = _orbax()
    found = []
    for rank, directory in existing:
        for path in ocp.path.step.tmp_checkpoints(directory):
            logging.warning("Ignoring the incomplete checkpoint %s/%s (a save that did not "
                            "finish; removed at the next save).", directory, path)
        for step in ocp.path.step.checkpoint_steps(directory):
            found.append((step, rank, os.path.join(directory, str(step))))
    return [(step, path) for step, _, path in sorted(found, key=lambda f: (-f[0], f[1]))]


def _read_manifest(path: str) -> dict:
    ocp = _orbax()
    try:
        restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
            path, args=ocp.args.Composite(manifest=ocp.args.JsonRestore()))
        return dict(restored["manifest"])
    except (ValueError, KeyError, OSError, TypeError) as error:
        raise _Unreadable(f"its manifest cannot be read ({_short(error)})") from error


def _short(error: Exception) -> str:
    """The first, human-readable part of an orbax / tensorstore error."""
    text = str(error).split(" [tensorstore_spec")[0]
    return f"{type(error).__name__}: {text[:400]}"


def _read_state(path: str, manifest: dict) -> dict[str, list[np.ndarray]]:
    ocp = _orbax()
    target = {g: [np.empty(shape, dtype) for _, shape, dtype in entries]
              for g, entries in manifest["groups"].items()}
    try:
        restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler(
            state=_state_handler(ocp))).restore(
            path, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(target)))
        return restored["state"]
    except (ValueError, KeyError, OSError, TypeError) as error:
        where = ""  # the variable, from the leaf name ("model.3") the error gives
        for match in re.finditer(r'\b(\w+)\.(\d+)\b', str(error)):
            entries = manifest["groups"].get(match.group(1), [])
            if int(match.group(2)) < len(entries):
                where = f" variable '{entries[int(match.group(2))][0]}'"
                break
        raise _Unreadable(f"cannot read{where or ' its state'} ({_short(error)})") from error


def _load(path: str, groups: dict) -> tuple[dict, dict]:
    """Reads and checks one step directory (chief): ``(state, manifest)``."""
    manifest = _read_manifest(path)
    _check_compatible(manifest, groups, f"checkpoint {path}")
    return _read_state(path, manifest), manifest


# ------------------------------------------------------------ multi-worker
def _sum_over_workers(strategy: tf.distribute.Strategy, words: np.ndarray) -> np.ndarray:
    """Sums an int32 vector over workers; each worker contributes it once.

    The worker's first local replica holds ``words``, the others zeros, and one
    all-reduce sums them: with zeros everywhere but the chief it is a broadcast.
    """
    first = [True]

    def value(_):
        contribution = words if first[0] else np.zeros_like(words)
        first[0] = False
        return tf.constant(contribution)

    per_replica = strategy.experimental_distribute_values_from_function(value)
    return strategy.reduce(_SUM, per_replica, axis=None).numpy()


def _pack(arrays: list[np.ndarray]) -> np.ndarray:
    raw = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    raw += b"\0" * (-len(raw) % 4)
    return np.frombuffer(raw, np.int32).copy()


def _unpack(words: np.ndarray, like: list[tuple[list, str]]) -> list[np.ndarray]:
    raw = words.tobytes()
    out, offset = [], 0
    for shape, dtype in like:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        out.append(np.frombuffer(raw[offset:offset + size], dtype).reshape(shape).copy())
        offset += size
    return out


def _broadcast_state(strategy, groups: dict, state: dict | None) -> dict:
    """The chief's ``state`` on every worker (``state`` is None off the chief)."""
    like = [(list(v.shape), _dtype(v)) for entries in groups.values() for _, v in entries]
    if state is None:
        words = np.zeros(_pack([np.zeros(s, d) for s, d in like]).shape, np.int32)
    else:
        words = _pack([a for g in groups for a in state[g]])
    flat = _unpack(_sum_over_workers(strategy, words), like)
    out, i = {}, 0
    for group, entries in groups.items():
        out[group] = flat[i:i + len(entries)]
        i += len(entries)
    return out


def _from_chief(strategy, chief: bool, value: int) -> int:
    """The chief's ``value`` on every worker (the others' ``value`` is ignored)."""
    words = np.array([value if chief else 0], np.int32)
    return int(_sum_over_workers(strategy, words)[0])


def _barrier(strategy) -> None:
    if distribute.num_workers(strategy) > 1:
        _sum_over_workers(strategy, np.zeros(1, np.int32))


# ---------------------------------------------------------------- restore
def _ensure_variables(trainer: "Trainer") -> None:
    """Builds the model (from the train dataset's spec if needed) and the optimizer."""
    from trainer import data, loop

    model = trainer.model
    if model.built and model.trainable_variables:
        trainer.build_optimizer_variables(trainer.optimizer, model.trainable_variables)
        return
    cfg = trainer.config.train
    loop._ensure_built(trainer, data.distribute(
        trainer.strategy, trainer.build_train_dataset, cfg.global_batch_size,
        deterministic=cfg.deterministic))


_NONE, _FAILED = -1, -2
_CHIEF_FAILED = "The chief could not restore the checkpoint; its log has the reason."


def _select(workdir: str, step: int | None) -> list[tuple[int, str]]:
    """The step directories to try, newest first (only ``step``'s when given)."""
    candidates = _candidates(workdir)
    if step is None:
        return candidates
    chosen = [c for c in candidates if c[0] == step]
    if not chosen:
        available = sorted({s for s, _ in candidates})
        raise CheckpointError(f"There is no checkpoint of step {step} in {workdir} "
                              f"(available: {available or 'none'}).")
    return chosen


def restore(trainer: "Trainer", step: int | None = None) -> int | None:
    """Restores the latest (or the given) checkpoint in ``trainer.workdir``.

    Sets the variables and ``trainer.step``; returns the step, or None when there is no
    checkpoint (``step=None`` only). Call it on every worker: the chief reads, the
    others receive the state over collectives. Raises :class:`CheckpointError` (naming
    the variable) when a checkpoint is missing, unreadable or does not fit the model.
    """
    strategy = trainer.strategy
    multi = distribute.num_workers(strategy) > 1
    chief = distribute.is_chief(strategy)
    if trainer.workdir is None:
        if step is not None:
            raise CheckpointError(f"restore(step={step}) needs a workdir; this Trainer has none.")
        return None
    candidates, failure, newest = [], None, _NONE
    if chief:
        try:
            candidates = _select(trainer.workdir, step)
            newest = candidates[0][0] if candidates else _NONE
        except CheckpointError as error:
            failure, newest = error, _FAILED
    if multi:  # every worker learns the chief's answer before anything else happens
        newest = _from_chief(strategy, chief, newest)
    if newest == _FAILED:
        raise failure or CheckpointError(_CHIEF_FAILED)
    if newest == _NONE:
        return None
    _ensure_variables(trainer)
    groups = state_variables(trainer)
    state, manifest, failure = None, None, None
    if chief:
        try:
            state, manifest = _load_first_readable(candidates, groups, step)
        except CheckpointError as error:
            failure = error
    if multi:
        status = _from_chief(strategy, chief, manifest["step"] if manifest else _FAILED)
        if status == _FAILED:
            raise failure or CheckpointError(_CHIEF_FAILED)
        state = _broadcast_state(strategy, groups, state)
        restored = status
    else:
        if failure:
            raise failure
        restored = manifest["step"]
    _assign(groups, state)
    trainer.step = restored
    if chief:
        _warn_on_input_changes(trainer, manifest)
    logging.info("resumed from step %d (%s)", restored,
                 trainer.workdir if chief else "the chief's checkpoint, broadcast")
    return restored


def _load_first_readable(candidates: list, groups: dict,
                         step: int | None) -> tuple[dict, dict]:
    """Loads the newest readable candidate; with ``step`` given, only that step."""
    reasons = []
    for _, path in candidates:
        try:
            return _load(path, groups)
        except _Unreadable as error:
            reasons.append(f"{path}: {error}")
            if step is None:
                logging.warning("Skipping checkpoint %s: %s; trying an earlier one.", path, error)
    raise CheckpointError(
        "No readable checkpoint: " + "; ".join(reasons) + ". The files are corrupt or "
        "incomplete: delete those step directories (training then resumes from an "
        "earlier one, or from scratch).")


def _warn_on_input_changes(trainer: "Trainer", manifest: dict) -> None:
    cfg = trainer.config
    if not cfg.train.deterministic:
        logging.warning("train.deterministic is False: the input resumes after %d batches, "
                        "but their order may differ from the interrupted run.", manifest["step"])
    if manifest["global_batch_size"] != cfg.train.global_batch_size:
        logging.warning("The checkpoint was written with train.global_batch_size=%d, the run "
                        "uses %d: the input position (%d batches) is no longer exact.",
                        manifest["global_batch_size"], cfg.train.global_batch_size,
                        manifest["step"])
    if manifest["seed"] != cfg.seed:
        logging.warning("The checkpoint was written with seed=%d, the run uses seed=%d.",
                        manifest["seed"], cfg.seed)


# ----------------------------------------------------------------- export
def export(trainer: "Trainer", path: str) -> None:
    """Writes the model's inference function as a SavedModel at ``path``.

    Keras 3 ``model.export`` (format ``tf_saved_model``): endpoints ``serve`` and the
    ``serving_default`` signature; ``tf.saved_model.load(path)`` works in a process
    without this package. Builds the model first if needed.
    """
    _ensure_variables(trainer)
    trainer.model.export(path, format="tf_saved_model", verbose=False)


# ------------------------------------------------------------- component
class Checkpointer(Component):
    """Saves on the ``checkpoint.*`` policy, handles SIGTERM and exports the best.

    Inactive (no saves, no signal handler) when the Trainer has no workdir. Orbax
    managers exist on the chief only and are created at the first save.
    """

    def __init__(self, trainer: "Trainer"):
        cfg = trainer.config.checkpoint
        self.enabled = trainer.workdir is not None
        # With gradient accumulation a step that is not a multiple of K holds partial
        # per-replica sums, which are not saved: saves happen at multiples of K only
        # (config validation makes every_steps and train.steps multiples of K).
        self.k = trainer.config.perf.grad_accum_steps
        self.every = cfg.every_steps
        self.total = trainer.config.train.steps
        self.chief = distribute.is_chief(trainer.strategy)
        self.multi = distribute.num_workers(trainer.strategy) > 1
        self.best_source, _, self.best_name = cfg.best_metric.partition("/")
        self._managers: dict[str, Any] = {}
        self._host_state: dict[str, dict[str, list[np.ndarray]]] = {}  # snapshot buffers, by kind
        self._stop_requested = False
        self._previous_handler: Any = None
        self._handler_installed = False

    def next_boundary(self, step: int) -> float:
        return next_boundary(step, self.every) if self.enabled else math.inf

    # --- signals
    def _on_sigterm(self, signum, frame) -> None:
        self._stop_requested = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
        logging.warning("SIGTERM: saving a checkpoint at the next loop boundary, then "
                        "exiting with code %d.", EXIT_PREEMPTED)

    def _should_stop(self, trainer: "Trainer") -> bool:
        if not self.multi:
            return self._stop_requested
        flag = np.array([int(self._stop_requested)], np.int32)
        return bool(_sum_over_workers(trainer.strategy, flag)[0])

    # --- managers (chief only)
    def _manager(self, trainer: "Trainer", kind: str):
        if kind not in self._managers:
            ocp = _orbax()
            cfg = trainer.config.checkpoint
            best = kind == BEST_DIR
            options = ocp.CheckpointManagerOptions(
                max_to_keep=cfg.max_to_keep,
                best_fn=(lambda metrics: metrics[self.best_name]) if best else None,
                best_mode=cfg.best_mode,
                keep_checkpoints_without_metrics=False,
                enable_async_checkpointing=cfg.async_save,
                cleanup_tmp_directories=True,
            )
            self._managers[kind] = ocp.CheckpointManager(
                os.path.join(trainer.workdir, kind), options=options,
                item_handlers={"state": _state_handler(ocp),
                               "manifest": ocp.JsonCheckpointHandler()})
        return self._managers[kind]

    def save(self, trainer: "Trainer", kind: str = LATEST_DIR,
             metrics: dict[str, float] | None = None, wait: bool = False) -> None:
        """Saves the current state (chief; other workers return at once)."""
        if not self.chief:
            return
        manager = self._manager(trainer, kind)
        if trainer.step in manager.all_steps():
            return
        ocp = _orbax()
        manager.wait_until_finished()  # an async write may still read the buffers reused here
        state, manifest = snapshot(trainer, self._host_state.get(kind))
        self._host_state[kind] = state
        manager.save(trainer.step, metrics=metrics, force=True, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state), manifest=ocp.args.JsonSave(manifest)))
        if wait:
            manager.wait_until_finished()
        logging.info("checkpoint of step %d -> %s%s", trainer.step,
                     os.path.join(trainer.workdir, kind), "" if wait else " (async)")

    # --- loop hooks
    def on_fit_start(self, trainer: "Trainer") -> None:
        if not self.enabled:
            return
        if self.best_source == "eval" and not trainer.has_eval_dataset():
            from trainer.config import ConfigError

            metric = trainer.config.checkpoint.best_metric
            raise ConfigError(f"config.checkpoint.best_metric={metric!r} needs an eval "
                              f"dataset; override build_eval_dataset or use a 'train/...' "
                              f"metric.")
        try:
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._handler_installed = True
        except ValueError:  # not the main thread: preemption stays the caller's business
            logging.info("fit() runs outside the main thread: SIGTERM is not handled.")

    def on_train_loop_end(self, trainer: "Trainer", num_steps: int, seconds: float) -> None:
        if not self.enabled:
            return
        if self._should_stop(trainer):
            if trainer.step % self.k:
                logging.info("SIGTERM: step %d is inside a gradient accumulation of %d steps; "
                             "saving at the next multiple.", trainer.step, self.k)
                return
            try:
                self.save(trainer, wait=True)
            finally:
                _barrier(trainer.strategy)  # no worker exits before the chief's save is done
            raise Preempted(trainer.step)
        if trainer.step >= self.total or (self.every and trainer.step % self.every == 0):
            self.save(trainer)  # the last step even inside an accumulation: the run ends

    def _save_best(self, trainer: "Trainer", values: dict[str, float]) -> None:
        if self.best_name not in values:
            from trainer.config import ConfigError

            raise ConfigError(
                f"config.checkpoint.best_metric={trainer.config.checkpoint.best_metric!r}: "
                f"no '{self.best_name}' among the {self.best_source} values "
                f"({', '.join(sorted(values))}).")
        if trainer.step % self.k == 0:
            self.save(trainer, BEST_DIR, {self.best_name: float(values[self.best_name])})

    def on_log(self, trainer: "Trainer", values: dict[str, float]) -> None:
        if self.enabled and self.best_source == "train":
            self._save_best(trainer, values)

    def on_eval(self, trainer: "Trainer", values: dict[str, float]) -> None:
        if self.enabled and self.best_source == "eval":
            self._save_best(trainer, values)

    def on_fit_end(self, trainer: "Trainer", results: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self._handler_installed:
            signal.signal(signal.SIGTERM, self._previous_handler or signal.SIG_DFL)
            self._handler_installed = False
        for manager in self._managers.values():
            manager.wait_until_finished()
        best = self._managers.get(BEST_DIR)
        if best is not None and trainer.step >= self.total and best.best_step() is not None:
            self._export_best(trainer, best.best_step())
        for manager in self._managers.values():
            manager.close()
        self._managers.clear()
        self._host_state.clear()

    def _export_best(self, trainer: "Trainer", step: int) -> None:
        """Exports the best step's model to ``workdir/export/best`` (chief)."""
        groups = state_variables(trainer)
        current, _ = snapshot(trainer)
        state, _ = _load(os.path.join(trainer.workdir, BEST_DIR, str(step)), groups)
        target = os.path.join(trainer.workdir, BEST_EXPORT_DIR)
        try:
            _assign({"model": groups["model"]}, state)
            if tf.io.gfile.exists(target):
                tf.io.gfile.rmtree(target)
            export(trainer, target)
        finally:
            _assign({"model": groups["model"]}, current)
        metrics = self._managers[BEST_DIR].metrics(step) or {}
        with tf.io.gfile.GFile(os.path.join(target, "best.json"), "w") as f:
            f.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}))
        logging.info("exported the best checkpoint (step %d, %s) to %s", step, metrics, target)
