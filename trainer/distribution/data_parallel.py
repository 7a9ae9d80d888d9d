"""Manual data parallelism: each batch split over mixed or uneven devices by weight.

``distribute.strategy="manual"`` with ``distribute.devices`` and
``distribute.device_weights`` (default: equal). Where Mirrored gives every replica the
same batch (so the slowest device sets the pace), this mode gives each device a share
of the batch proportional to its weight. It runs under a one-replica
``OneDeviceStrategy`` on the FIRST listed device, which holds the single copy of the
variables, receives the input and applies the update (list the device that should hold
them first): the input pipeline yields GLOBAL batches and ``strategy.run`` calls the
step function once. This module owns what happens inside that call
(:class:`ManualDataParallel`, a :class:`trainer.step.gradients.Reducer` plugged into the
Trainer's gradient path):

1. The batch is cut along its leading axis into one contiguous slice per device, of
   :func:`split_sizes` examples (cumulative rounding of the exact shares: the sizes sum
   to the batch, each is within one example of ``batch * w_i / sum(w)``). The cut runs
   where the batch is (the first device), so each device receives only its slice.
2. The user's ``train_step`` runs once per slice under ``tf.device(device)``, unchanged.
   While a slice runs, the gradient path (reached through ``apply_gradients`` and
   through the default step, with or without XLA) hands each update to
   :meth:`ManualDataParallel.intercept`, which DEFERS it: it records the slice's gradients of
   ``scale * (sum of the slice's per-example losses + regularisation * n_slice) / C``
   (``C`` = examples per optimizer update) and its per-example losses, and returns the
   slice's mean loss. Forward and backward ops of a slice are placed on its device.
3. After the last slice, the gradients of each ``apply_gradients`` call are summed over
   the slices. Each slice's objective already carries ``n_slice / C``, so the sum is
   the example-weighted combination: exactly the gradient of the whole batch. The
   ordinary gradient path then runs ONCE on the sums, on the device of the variables:
   averaging correction for short batches, loss-scale unscaling (one loss scale for
   every device), clipping by global norm, the finiteness check, gradient accumulation
   (``perf.grad_accum_steps``), and one optimizer update of the single copy of the
   variables. The update equals the single-device update on the whole batch.
4. Outputs are combined: a train output is the example-weighted mean of the slices'
   values (so the returned ``apply_gradients`` value is the global-mean loss); an eval
   output with a leading axis (the per-example ``loss``) is concatenated, a scalar one
   weighted. Eval batches may be short: their split is computed in the graph.

Limits:

* Non-trainable state updated in the forward pass (BatchNorm moving statistics, running
  means) starts every slice from its value before the step and ends as the
  example-weighted mean of the slices' results (:mod:`trainer.step.replica_state`): one
  device's update on the whole batch for a running mean; BatchNorm's batch statistics in
  the forward pass are still each slice's own.
* Random ops (dropout) draw per slice: each slice's Keras draws have its index folded
  into their seeds (:mod:`trainer.step.random_streams`), so slices draw independent
  streams: the same distribution, not the same numbers as one device on the whole batch.
  With ``distribute.random_draws="global"`` a train slice's draws led by its examples
  are its rows of the whole batch's draw instead: the numbers of one device.
* All updates of a step are applied after every slice ran. A ``train_step`` with
  several ``apply_gradients`` calls whose later loss reads variables an earlier call
  updates (alternating GAN steps) sees their values from before the step.
* A ``train_step`` must update through ``self.apply_gradients``; one that calls
  ``optimizer.apply`` itself is rejected (each slice would apply its own update).
* With several devices, collectives inside the step (``self.all_gather``, TensorFlow's
  ``get_replica_context().all_gather`` / ``all_reduce`` / ``merge_call``, a
  synchronized BatchNormalization) are refused at trace time with one line: a slice
  cannot see the slices that have not run
  (:func:`trainer.distribution.collectives.refusing_replica_context`).
* ``perf.jit_compile`` is not applied with several devices (XLA cannot compile one
  device's access to variables on another), as under Mirrored.
* One process, its local devices. Devices compute concurrently only as far as TF's
  executor runs independent ops in parallel; measured numbers: benchmarks/README.md.

To choose weights, ``python -m trainer.manual --config=C --measure`` times each device
(:mod:`trainer.manual`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Sequence

import ml_collections
import tensorflow as tf
from absl import logging

from trainer.config import ConfigError
from trainer.distribution import collectives
from trainer.distribution.strategies import resolve_devices
from trainer.runtime import keras_compat, pinned_draws
from trainer.step.gradients import GradientPath, Reducer
from trainer.step.replica_state import SliceState

StepFn = Callable[[Any], dict]


def _cut_points(weights: Sequence[float]) -> list[float]:
    """Cumulative weight fractions before each cut (``len(weights) - 1`` of them)."""
    total = float(sum(weights))
    fractions, cumulative = [], 0.0
    for w in weights[:-1]:
        cumulative += float(w)
        fractions.append(cumulative / total)
    return fractions


def split_sizes(batch_size: int, weights: Sequence[float]) -> list[int]:
    """Examples per device for a batch of ``batch_size`` and non-negative ``weights``.

    Cumulative rounding: the cut after device ``i`` is at
    ``floor(batch_size * (w_0 + ... + w_i) / sum(w) + 0.5)``. The sizes sum exactly to
    ``batch_size`` and each is within one example of ``batch_size * w_i / sum(w)``.
    ``split_sizes(32, [1, 2, 1]) == [8, 16, 8]``.
    """
    bounds = [0] + [math.floor(batch_size * f + 0.5) for f in _cut_points(weights)]
    bounds.append(batch_size)
    return [b - a for a, b in zip(bounds, bounds[1:])]


@dataclasses.dataclass
class _Deferred:
    """One ``apply_gradients`` call of one device slice, held until every slice ran."""

    optimizer: Any
    variables: list
    grads: list
    per_example_loss: tf.Tensor


def _sum_gradients(grads: list):
    """The sum of one variable's gradients over the slices (None if it has none)."""
    present = [g for g in grads if g is not None]
    if not present:
        return None
    if all(isinstance(g, tf.IndexedSlices) for g in present):  # stays sparse: concatenated
        return tf.IndexedSlices(tf.concat([g.values for g in present], 0),
                                tf.concat([g.indices for g in present], 0),
                                present[0].dense_shape)
    return tf.add_n([tf.convert_to_tensor(g) for g in present])


def _weighted_mean(values: list, counts: list, total) -> tf.Tensor:
    """``sum(count_i * value_i) / total`` in float32, cast back to the values' dtype."""
    dtype = tf.convert_to_tensor(values[0]).dtype
    terms = [tf.cast(v, tf.float32) * tf.cast(c, tf.float32) for v, c in zip(values, counts)]
    return tf.cast(tf.math.divide_no_nan(tf.add_n(terms), tf.cast(total, tf.float32)), dtype)


class ManualDataParallel(Reducer):
    """Splits each batch over ``devices`` by weight; one combined update per step.

    The reducer of the gradient path under ``distribute.strategy="manual"``
    (``trainer.gradients.reducer``). Built on the host, used while ``tf.function``
    traces the step (the wrapped step functions run where the loop's replica function
    runs: in the replica context of the one-replica strategy).

    Attributes:
      devices: logical device names, in split order.
      weights: one non-negative float per device.
      train_sizes: examples per device of each training batch (sum: the global batch).
    """

    def __init__(self, config: ml_collections.ConfigDict, strategy: tf.distribute.Strategy):
        if strategy.num_replicas_in_sync != 1:
            raise ConfigError(
                f"distribute.strategy='manual' runs under a one-replica strategy, but this "
                f"Trainer was given {type(strategy).__name__} with "
                f"{strategy.num_replicas_in_sync} replicas; do not pass a strategy.")
        self._path: GradientPath | None = None
        self._strategy = strategy
        self.devices = resolve_devices(config.distribute)
        self.weights = [float(w) for w in config.distribute.device_weights] or (
            [1.0] * len(self.devices))
        batch = config.train.global_batch_size
        self.train_sizes = split_sizes(batch, self.weights)
        empty = [d for d, n in zip(self.devices, self.train_sizes) if n == 0]
        if empty:
            raise ConfigError(
                f"config.distribute.device_weights={tuple(config.distribute.device_weights)}"
                f" gives {', '.join(empty)} 0 of the {batch} examples of "
                f"train.global_batch_size (split {self.train_sizes}); raise its weight, use a "
                f"larger batch, or leave the device out of distribute.devices.")
        self._records: list[_Deferred] | None = None
        self._global_draws = config.distribute.random_draws == "global"
        logging.info("%s", self.describe())

    @property
    def supports_jit(self) -> bool:
        """XLA only with one device (it cannot compile access to another's variables)."""
        return len(self.devices) == 1

    @property
    def supports_collectives(self) -> bool:
        """A step's all_gather / all_reduce only with one device: the slices run one after
        another, so none can see the others' values."""
        return len(self.devices) == 1

    def attach(self, path: GradientPath) -> None:
        self._path = path

    def _slice_context(self, index: int, rows: tuple | None = None):
        """Where the ``index``-th device slice's step is traced: with several devices, a
        replica context whose collectives refuse
        (:func:`collectives.refusing_replica_context`) and Keras seeds keyed by ``index``
        (:func:`keras_compat.seed_key`); under ``distribute.random_draws="global"`` with
        ``rows`` (the slice's ``(start, size, total)`` rows of the batch): draws of those
        rows of the batch's draw instead (:func:`pinned_draws.draw_rows`)."""
        if self.supports_collectives:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(collectives.refusing_replica_context(self._strategy))
        if self._global_draws and rows is not None:
            stack.enter_context(pinned_draws.draw_rows(*rows))
        else:
            stack.enter_context(keras_compat.seed_key(index))
        return stack

    def describe(self) -> str:
        """One line: devices, weights and the training split."""
        parts = ", ".join(f"{d} x{n}" for d, n in zip(self.devices, self.train_sizes))
        weights = ", ".join(f"{w:g}" for w in self.weights)
        return (f"manual data parallelism: {parts} examples (weights {weights}); gradients "
                f"summed and applied once on the variables' device")

    # ----------------------------------------------------------- step wrapping
    @property
    def deferring(self) -> bool:
        """True while a device slice's step is being traced (updates are recorded)."""
        return self._records is not None

    def intercept(self, optimizer, variables: list, grads: list,
                  per_example_loss: tf.Tensor) -> tf.Tensor | None:
        """Called by the gradient path: while a slice runs, records and returns its loss.

        ``grads`` are the slice's gradients of its share of the scaled objective (see the
        module docstring). Returns the slice's mean loss (float32 scalar); the wrapper
        weights it by the slice's examples, which gives the global-mean loss. Outside a
        slice (the combined update) returns None: the normal path applies.
        """
        if not self.deferring:
            return None
        self._records.append(_Deferred(optimizer, list(variables), list(grads),
                                       per_example_loss))
        loss = tf.cast(per_example_loss, tf.float32)
        return tf.math.divide_no_nan(tf.reduce_sum(loss),
                                     tf.cast(tf.shape(loss)[0], tf.float32))

    def _split(self, batch, require_examples: bool) -> tuple[list, list, Any]:
        """``(slices, counts, total)``: the batch cut per device along axis 0.

        Static sizes when the batch size is static, else computed in the graph with the
        same rule. With ``require_examples`` a static slice of 0 examples raises.
        """
        first = tf.nest.flatten(batch)[0]
        total = first.shape[0]
        if total is not None:
            counts = split_sizes(total, self.weights)
            if require_examples and 0 in counts:
                raise ValueError(
                    f"A batch of {total} examples split by device_weights {self.weights} "
                    f"leaves a device with 0 examples ({counts}); use batches of at least "
                    f"{len(self.devices)} examples with drop_remainder=True.")
            bounds = [0] + [sum(counts[:i + 1]) for i in range(len(counts))]
        else:
            total = tf.shape(first, out_type=tf.int64)[0]
            n = tf.cast(total, tf.float64)
            bounds = ([tf.constant(0, tf.int64)]
                      + [tf.cast(tf.floor(n * f + 0.5), tf.int64) for f in _cut_points(self.weights)]
                      + [total])
            counts = [b - a for a, b in zip(bounds, bounds[1:])]
        slices = [tf.nest.map_structure(lambda t, a=a, b=b: t[a:b], batch)
                  for a, b in zip(bounds, bounds[1:])]
        return slices, counts, total

    def _update_device(self) -> str | None:
        """Where the combination and the update run: the first model variable's device."""
        variables = self._path.model.trainable_variables
        return getattr(variables[0], "value", variables[0]).device if variables else None

    def run_slice(self, step_fn: StepFn, batch, device: str, index: int = 0,
                  rows: tuple | None = None) -> tuple[Any, list[_Deferred]]:
        """Traces ``step_fn(batch)`` under ``tf.device(device)`` with updates deferred
        (``index``: the slice's position, keying its random draws; ``rows``: its
        ``(start, size, total)`` rows of the batch, see :meth:`_slice_context`).

        Returns the step's outputs and the ``apply_gradients`` calls it made (unapplied).
        """
        if self.deferring:
            raise RuntimeError("A device slice is already running; manual steps do not nest.")
        self._records = []
        try:
            with tf.device(device), self._slice_context(index, rows):
                outputs = step_fn(batch)
            return outputs, self._records
        finally:
            self._records = None

    def wrap_train(self, train_step: StepFn) -> StepFn:
        """The training step function the loop calls instead of ``train_step``.

        Runs ``train_step`` on each device's slice (each from the same forward state, which
        ends as the example-weighted mean of the slices': :class:`SliceState`), applies each
        ``apply_gradients`` call once on the summed gradients, and returns the example-weighted mean of the
        slices' outputs (float32 math, original dtypes).
        """

        def manual_train_step(batch):
            slices, counts, total = self._split(batch, require_examples=True)
            outputs, records = [], []
            state = SliceState(self._path.model)
            state.begin()
            seeds = (keras_compat.rewindable_seeds() if self._global_draws
                     else contextlib.nullcontext(None))
            with seeds as rewind:
                for i, (device, part) in enumerate(zip(self.devices, slices)):
                    if i:
                        state.next_slice()
                        if rewind:  # "global": every slice draws from the same seeds
                            rewind()
                    rows = (sum(counts[:i]), counts[i], total)
                    out, calls = self.run_slice(train_step, part, device, i, rows)
                    state.end_slice(counts[i])
                    outputs.append(out)
                    records.append(calls)
            with tf.device(self._update_device()):
                state.finish(total)
                self._apply(records)
                if not all(isinstance(o, dict) for o in outputs):
                    return outputs[0]  # the loop reports the broken contract
                return {key: _weighted_mean([o[key] for o in outputs], counts, total)
                        for key in outputs[0]}

        return manual_train_step

    def wrap_eval(self, eval_step: StepFn) -> StepFn:
        """The eval step function the loop calls instead of ``eval_step``.

        Runs ``eval_step`` on each device's slice (a short batch is split in the graph;
        a slice may be empty). Outputs with a leading axis (the per-example ``loss``)
        are concatenated in batch order; scalars are example-weighted means.
        """

        def manual_eval_step(batch):
            slices, counts, total = self._split(batch, require_examples=False)
            outputs = []
            for i, (device, part) in enumerate(zip(self.devices, slices)):
                with tf.device(device), self._slice_context(i):
                    outputs.append(eval_step(part))
            if not all(isinstance(o, dict) for o in outputs):
                return outputs[0]  # the loop reports the broken contract
            combined = {}
            for key in outputs[0]:
                values = [tf.convert_to_tensor(o[key]) for o in outputs]
                combined[key] = (tf.concat(values, 0) if values[0].shape.rank
                                 else _weighted_mean(values, counts, total))
            return combined

        return manual_eval_step

    def _apply(self, records: list[list[_Deferred]]) -> None:
        """Sums each deferred call's gradients over the slices and applies it once."""
        calls = [len(r) for r in records]
        if not calls[0]:
            raise RuntimeError(
                "distribute.strategy='manual': train_step made no self.apply_gradients call. "
                "Manual mode combines the devices' gradients inside apply_gradients; a step "
                "that calls optimizer.apply itself would apply one update per device.")
        if len(set(calls)) != 1:
            raise RuntimeError(
                f"train_step called apply_gradients {calls} times on the device slices "
                f"{self.devices}; manual mode needs the same calls on every slice.")
        for j, first in enumerate(records[0]):
            group = [r[j] for r in records]
            if any(g.optimizer is not first.optimizer
                   or [id(v) for v in g.variables] != [id(v) for v in first.variables]
                   for g in group):
                raise RuntimeError(
                    f"apply_gradients call {j + 1} of train_step used different optimizers "
                    f"or variables on different device slices; manual mode needs the same.")
            grads = [_sum_gradients([g.grads[k] for g in group])
                     for k in range(len(first.variables))]
            losses = tf.concat([tf.cast(g.per_example_loss, tf.float32) for g in group], 0)
            self._path.apply_grads(first.optimizer, first.variables, grads, losses)
