"""What a checkpoint holds, and how it is matched back to a Trainer's variables.

The state is a pytree of numpy arrays, ``{group: [array, ...]}``, with the groups

* ``model``: every model variable, including Keras ``SeedGenerator`` states (the RNG
  state of dropout and random layers);
* ``optimizer``: every variable of ``trainer.optimizer`` (slots, ``iterations``,
  learning rate);
* one group per other ``keras.Model`` / ``keras.optimizers.Optimizer`` attribute of the
  Trainer (e.g. a second optimizer; variables already saved are not repeated);
* ``random``: the states of the ``SeedGenerator`` and ``tf.random.Generator`` objects the
  Trainer or a layer holds outside the model's variables (by attribute path:
  :mod:`trainer.step.random_streams`) and of the Keras global generator the step's
  unseeded ``keras.random`` ops draw from, so a resumed run draws what an uninterrupted
  one draws;
* ``trainer``: ``step_counter`` and the loss-scale state (``scale``, ``good_steps``,
  ``skipped_steps``, ``last_skipped_step``).

The manifest (JSON) holds the step (the input position: global batches consumed),
``global_batch_size``, ``seed``, replica/worker counts, the input layout
(``input_layout``: the pipelines whose streams the input follows, see
:mod:`trainer.data.resume`), the execution plan (``plan``: :mod:`trainer.loop.plan`), the
services' states (``services``: e.g. early stopping's best value,
:meth:`trainer.run_context.Service.checkpoint_state`), and each group's variable NAMES,
shapes and dtypes in the stored order.

Matching is by NAME within a group, never by position: a variable's name is its Keras
path (``sequential/dense/kernel``, ``adam/iteration``) or, for a plain ``tf.Variable``,
its name. A Trainer builds its model and optimizers under fresh Keras auto-numbering
(:func:`trainer.runtime.keras_compat.fresh_names`), so the same code gives the same names in
every process and for every Trainer of one process. A name seen twice in a group gets
``#2``, ``#3``... in creation order. A missing, extra, reshaped or retyped variable is a
:class:`CheckpointError` naming it, but for an entry of :data:`OPTIONAL` a checkpoint
lacks: it keeps its value. Restore assigns into the variables the current strategy
created, so a checkpoint written with 4 replicas restores into 1, 2 or another strategy.

Contexts: host, eager, cross-replica.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from trainer.checkpoint.storage import array_files
from trainer.distribution import host_collectives
from trainer.errors import UserError
from trainer.run_context import RunContext
from trainer.step import random_streams

FORMAT = 2  # 1: variables matched by position (before names); not readable any more

Groups = dict[str, list[tuple[str, Any]]]
#: ``(group, name)`` of the entries a checkpoint may lack: the Keras global generator's
#: state is saved once a traced step drew from it (:func:`random_streams.drew_global`),
#: and checkpoints of earlier versions never hold it. Restored from a checkpoint without
#: it, it keeps its value (its initial state, as in the run that wrote that checkpoint).
OPTIONAL = frozenset({("random", random_streams.GLOBAL_NAME)})


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be restored; the message names the step, variable and fix."""

    prefix = "Checkpoint error"


def _name(variable) -> str:
    path = getattr(variable, "path", None)
    return path if isinstance(path, str) else variable.name.split(":")[0]


def dtype_name(variable) -> str:
    return np.dtype(tf.as_dtype(variable.dtype).as_numpy_dtype).name


def state_variables(run: RunContext, optional: bool = False) -> Groups:
    """The variables a checkpoint holds, by group: ``{group: [(name, variable), ...]}``.

    ``run``: the run context (:class:`trainer.run_context.RunContext`). Groups, in
    order: ``model``, ``owned`` (the trainable variables the Trainer holds itself, by
    attribute path), ``optimizer``, one per other ``keras.Model`` or Keras optimizer
    the Trainer holds (``other_models_and_optimizers()``, by attribute name), ``ema``,
    ``random`` (generators' states, by attribute path), ``trainer``. A
    variable appears once (in its first group). The optimizer must be built.
    ``optional``: with the :data:`OPTIONAL` entries a save leaves out (for a restore,
    which fills them from a checkpoint that has them).
    """
    groups: Groups = {}
    seen: set[int] = set()

    def add(group: str, variables, names=None) -> None:
        entries, used = [], {}
        for i, variable in enumerate(variables):
            if id(variable) in seen:
                continue
            seen.add(id(variable))
            name = _name(variable) if names is None else names[i]
            used[name] = used.get(name, 0) + 1
            entries.append((name if used[name] == 1 else f"{name}#{used[name]}", variable))
        if entries:
            groups[group] = entries

    add("model", run.model.variables)
    owned = run.owned_variables()  # by attribute path: stable where variable names are not
    add("owned", [v for _, v in owned], [path for path, _ in owned])
    add("optimizer", run.optimizer.variables)
    for attr, value in run.other_models_and_optimizers().items():
        add(attr, value.variables)
    if run.ema is not None and run.ema.built:
        add("ema", run.ema.variables)
    randoms = [(name, v) for name, v in run.random_states()
               if optional or name != random_streams.GLOBAL_NAME
               or random_streams.drew_global(run.step_counter)]
    add("random", [v for _, v in randoms], [name for name, _ in randoms])
    p = run.precision
    add("trainer", [run.step_counter, p.scale, p.good_steps, p.skipped_steps,
                    p.last_skipped_step])
    return groups


def trajectory_variables(run: RunContext) -> list:
    """Every variable the run's next steps depend on, flat: :func:`state_variables`'s
    (the optional ones included), and the precision's non-finite streaks (which a
    checkpoint does not hold). What the execution plan's rehearsal puts back
    (:mod:`trainer.loop.rehearsal`)."""
    p = run.precision
    groups = state_variables(run, optional=True)
    return [*(v for entries in groups.values() for _, v in entries),
            p.nonfinite_streak, p.worst_streak]


def all_finite(run: RunContext) -> bool:
    """True when every float variable of the model, its EMA and the optimizers is finite.

    Computed where the variables live, on every worker alike (their values are the same
    everywhere), so every worker takes the same decision without communication.
    """
    values = [tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(v)))
              for group, entries in state_variables(run).items() if group != "trainer"
              for _, v in entries if tf.as_dtype(v.dtype).is_floating]
    return bool(tf.reduce_all(values).numpy()) if values else True


def manifest(run: RunContext, groups: Groups) -> dict:
    """The JSON manifest of the current state (see the module docstring)."""
    return {
        "format": FORMAT,
        "step": int(run.step),
        "global_batch_size": int(run.batch.global_size),
        "seed": int(run.config.seed),
        "replicas": int(run.strategy.num_replicas_in_sync),
        "workers": host_collectives.num_workers(run.strategy),
        # The input pipelines whose streams the train input follows (trainer.data.resume):
        # a resume on another number of workers continues them.
        **({"input_layout": layout.to_manifest()}
           if (layout := run.input_report.get("input_layout")) else {}),
        # The execution plan the run measured (trainer.loop.plan): a resume on the same
        # hardware and strategy adopts it instead of measuring again.
        **({"plan": plan} if (plan := run.saved_plan) else {}),
        # What services keep across a resume (run_context.Service.checkpoint_state).
        **({"services": states} if (states := run.service_states) else {}),
        "groups": {g: [[name, list(v.shape), dtype_name(v)] for name, v in entries]
                   for g, entries in groups.items()},
    }


def snapshot(run: RunContext, reuse: dict[str, list[np.ndarray]] | None = None
             ) -> tuple[dict[str, list[np.ndarray]], dict]:
    """Host copies of the training state and its manifest.

    Arrays are ``np.ndarray`` (0-d for scalars: orbax rejects numpy scalars), page
    aligned (:func:`trainer.checkpoint.storage.array_files.aligned_empty`); they are snapshots, safe to
    write while training continues. ``reuse``: the state of an earlier snapshot whose
    arrays are overwritten in place where shape and dtype still match (the caller makes
    sure nothing reads them any more). Copying into warm buffers avoids faulting in
    fresh pages: 0.06 s instead of 0.3-1.4 s for 577 MB.
    """
    groups = state_variables(run)
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
    return state, manifest(run, groups)


def check_compatible(saved: dict, groups: Groups, where: str) -> None:
    """Raises CheckpointError naming the first variable that does not match ``saved``
    (a manifest) by name, shape and dtype."""
    if saved.get("format") != FORMAT:
        raise CheckpointError(
            f"{where} has format {saved.get('format')!r}; this version reads format "
            f"{FORMAT} (variables matched by name). Train in a fresh --workdir, or restore "
            f"it with the version that wrote it.")
    saved_groups = saved["groups"]
    fix = ("The model or optimizer changed since the checkpoint was written: train in a "
           "fresh --workdir, or restore the configuration that wrote it.")
    extra = sorted(set(saved_groups) - set(groups))
    if extra:
        raise CheckpointError(f"{where} holds {len(saved_groups[extra[0]])} variables of "
                              f"'{extra[0]}' (first: '{saved_groups[extra[0]][0][0]}') that "
                              f"this Trainer does not have. {fix}")
    for group, entries in groups.items():
        stored = {name: (shape, dtype) for name, shape, dtype in saved_groups.get(group, [])}
        for name, variable in entries:
            if name not in stored and (group, name) in OPTIONAL:
                continue
            if name not in stored:
                close = [n for n in stored if n.rsplit("/", 1)[-1] == name.rsplit("/", 1)[-1]]
                hint = f" (it has {', '.join(repr(n) for n in close[:3])})" if close else ""
                raise CheckpointError(
                    f"Variable '{name}' ({group}, shape {list(variable.shape)}) is missing "
                    f"from {where}{hint}. {fix}")
            shape, dtype = stored[name]
            if list(variable.shape) != list(shape):
                raise CheckpointError(
                    f"Variable '{name}' has shape {list(variable.shape)} but {where} holds "
                    f"shape {shape} for it ({group}). {fix}")
            if dtype_name(variable) != dtype:
                raise CheckpointError(
                    f"Variable '{name}' has dtype {dtype_name(variable)} but {where} holds "
                    f"{dtype} for it ({group}). {fix}")
        unused = sorted(set(stored) - {name for name, _ in entries})
        if unused:
            raise CheckpointError(
                f"{where} holds {len(stored)} {group} variables but the Trainer has "
                f"{len(entries)}; '{unused[0]}' has no counterpart. {fix}")


def in_trainer_order(groups: Groups, saved: dict,
                     state: dict[str, list[np.ndarray]]) -> dict[str, list[np.ndarray]]:
    """``state`` (arrays in the manifest ``saved``'s order) rearranged by name into the
    order of ``groups``; an :data:`OPTIONAL` entry ``saved`` lacks is the variable's
    current value. Call :func:`check_compatible` first."""
    out = {}
    for group, entries in groups.items():
        order = {name: i for i, (name, _, _) in enumerate(saved["groups"].get(group, []))}
        out[group] = [state[group][order[name]] if name in order
                      else np.array(tf.convert_to_tensor(variable)) for name, variable in entries]
    return out


def assign(groups: Groups, state: dict[str, list[np.ndarray]]) -> None:
    """Assigns arrays given in ``groups``' own order (:func:`in_trainer_order`)."""
    for group, entries in groups.items():
        for (_, variable), value in zip(entries, state[group]):
            variable.assign(value)


def like(groups: Groups) -> list[tuple[list, str]]:
    """``(shape, dtype name)`` of every variable of ``groups``, flat, in order."""
    return [(list(v.shape), dtype_name(v)) for entries in groups.values() for _, v in entries]
