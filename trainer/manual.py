"""Manual data parallelism: each batch split over mixed or uneven devices by weight.

``distribute.strategy="manual"`` with ``distribute.devices`` and
``distribute.device_weights`` (default: equal). Where Mirrored gives every replica the
same batch (so the slowest device sets the pace), this mode gives each device a share
of the batch proportional to its weight. It runs under a one-replica
``OneDeviceStrategy`` on the FIRST listed device, which holds the single copy of the
variables, receives the input and applies the update (list the device that should hold
them first): the input pipeline yields GLOBAL batches and ``strategy.run`` calls the
step function once. This module owns what happens inside that call
(:class:`ManualDataParallel`, wired in by ``trainer/loop.py`` and ``Trainer``):

1. The batch is cut along its leading axis into one contiguous slice per device, of
   :func:`split_sizes` examples (cumulative rounding of the exact shares: the sizes sum
   to the batch, each is within one example of ``batch * w_i / sum(w)``). The cut runs
   where the batch is (the first device), so each device receives only its slice.
2. The user's ``train_step`` runs once per slice under ``tf.device(device)``, unchanged.
   While a slice runs, ``Trainer._reduce_and_apply`` (reached through
   ``apply_gradients`` and through the default step, with or without XLA) DEFERS to
   :meth:`ManualDataParallel.defer`: it records the slice's gradients of
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

* Non-trainable state updated in the forward pass (BatchNorm moving statistics) is
  updated once per slice, in device order, from that slice's statistics.
* Random ops (dropout) draw per slice: the same distribution, not the same numbers as
  one device on the whole batch.
* All updates of a step are applied after every slice ran. A ``train_step`` with
  several ``apply_gradients`` calls whose later loss reads variables an earlier call
  updates (alternating GAN steps) sees their values from before the step.
* A ``train_step`` must update through ``self.apply_gradients``; one that calls
  ``optimizer.apply`` itself is rejected (each slice would apply its own update).
* ``perf.jit_compile`` is not applied with several devices (XLA cannot compile one
  device's access to variables on another), as under Mirrored.
* One process, its local devices. Devices compute concurrently only as far as TF's
  executor runs independent ops in parallel; see README for measured numbers.

Helper to choose weights (times one forward/backward of an equal share of a training
batch on each device and suggests weights proportional to speed):

    python -m trainer.manual --config=path/to/config.py --measure [--repeats 20]

Without ``--measure`` it prints the split the config gives.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import ml_collections
import tensorflow as tf
from absl import logging

from trainer.config import ConfigError

if TYPE_CHECKING:
    from trainer.trainer import Trainer

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


def resolve_devices(dcfg: ml_collections.ConfigDict) -> list[str]:
    """The manual mode's devices, checked, as logical device names (``/device:GPU:1``).

    ``distribute.devices``, or else every logical GPU, or else every logical CPU (with
    ``distribute.virtual_devices=N``: the N logical CPUs). Call after
    ``distribute.configure_devices``. Raises ``ConfigError`` for a name that is not a
    device of this process, a device listed twice, or ``device_weights`` of another
    length.
    """
    available = {}
    for device in tf.config.list_logical_devices():
        spec = tf.DeviceSpec.from_string(device.name)
        available[(spec.device_type, spec.device_index)] = device.name
    requested = list(dcfg.devices) or [
        d.name for d in (tf.config.list_logical_devices("GPU")
                         or tf.config.list_logical_devices("CPU"))]
    names: list[str] = []
    for name in requested:
        try:
            spec = tf.DeviceSpec.from_string(name)
        except (ValueError, TypeError) as error:
            raise ConfigError(f"config.distribute.devices: {name!r} is not a device name "
                              f"such as '/gpu:0' or '/cpu:1' ({error}).") from error
        canonical = available.get((spec.device_type, spec.device_index))
        if canonical is None or spec.job not in (None, "localhost"):
            raise ConfigError(
                f"config.distribute.devices: {name!r} is not a device of this process, which "
                f"has {', '.join(available.values())}. Manual mode uses local devices; for "
                f"several CPU devices set distribute.virtual_devices=N.")
        if canonical in names:
            raise ConfigError(f"config.distribute.devices lists {canonical} twice; give "
                              f"each device once and raise its weight instead.")
        names.append(canonical)
    weights = dcfg.device_weights
    if weights and len(weights) != len(names):
        raise ConfigError(
            f"config.distribute.device_weights has {len(weights)} weights for "
            f"{len(names)} devices ({', '.join(names)}); give one weight per device, or set "
            f"distribute.devices.")
    return names


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


class ManualDataParallel:
    """Splits each batch over ``devices`` by weight; one combined update per step.

    Held by the Trainer as ``trainer.manual`` (None under the other strategies). Built
    in ``Trainer.__init__`` (host), used while ``tf.function`` traces the step (the
    wrapped step functions run where the loop's replica function runs: in the replica
    context of the one-replica strategy).

    Attributes:
      devices: logical device names, in split order.
      weights: one non-negative float per device.
      train_sizes: examples per device of each training batch (sum: the global batch).
    """

    def __init__(self, trainer: "Trainer"):
        if trainer.strategy.num_replicas_in_sync != 1:
            raise ConfigError(
                f"distribute.strategy='manual' runs under a one-replica strategy, but this "
                f"Trainer was given {type(trainer.strategy).__name__} with "
                f"{trainer.strategy.num_replicas_in_sync} replicas; do not pass a strategy.")
        config = trainer.config
        self._trainer = trainer
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
        logging.info("%s", self.describe())

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

    def defer(self, optimizer, variables: list, grads: list,
              per_example_loss: tf.Tensor) -> tf.Tensor:
        """Called by ``Trainer._reduce_and_apply`` while a slice runs: records, no update.

        ``grads`` are the slice's gradients of its share of the scaled objective (see the
        module docstring). Returns the slice's mean loss (float32 scalar); the wrapper
        weights it by the slice's examples, which gives the global-mean loss.
        """
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
        variables = self._trainer.model.trainable_variables
        return getattr(variables[0], "value", variables[0]).device if variables else None

    def run_slice(self, step_fn: StepFn, batch, device: str) -> tuple[Any, list[_Deferred]]:
        """Traces ``step_fn(batch)`` under ``tf.device(device)`` with updates deferred.

        Returns the step's outputs and the ``apply_gradients`` calls it made (unapplied).
        """
        if self.deferring:
            raise RuntimeError("A device slice is already running; manual steps do not nest.")
        trainer = self._trainer
        if trainer._jit_grads is not None and len(self.devices) > 1:
            logging.warning(
                "perf.jit_compile=True is not applied under distribute.strategy='manual' with "
                "%d devices (XLA cannot compile a device's access to the variables on %s); "
                "training without XLA.", len(self.devices), self.devices[0])
            trainer._jit_grads = None
        self._records = []
        try:
            with tf.device(device):
                outputs = step_fn(batch)
            return outputs, self._records
        finally:
            self._records = None

    def wrap_train(self, train_step: StepFn) -> StepFn:
        """The training step function the loop calls instead of ``train_step``.

        Runs ``train_step`` on each device's slice, applies each ``apply_gradients`` call
        once on the summed gradients, and returns the example-weighted mean of the
        slices' outputs (float32 math, original dtypes).
        """

        def manual_train_step(batch):
            slices, counts, total = self._split(batch, require_examples=True)
            outputs, records = [], []
            for device, part in zip(self.devices, slices):
                out, calls = self.run_slice(train_step, part, device)
                outputs.append(out)
                records.append(calls)
            with tf.device(self._update_device()):
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
            for device, part in zip(self.devices, slices):
                with tf.device(device):
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
            self._trainer._reduce_and_apply(first.optimizer, first.variables, grads, losses)


# --------------------------------------------------------------- measuring helper
def measure(trainer: "Trainer", repeats: int = 20) -> list[dict[str, float]]:
    """Times the training forward/backward of an equal share of a batch on each device.

    Host, eager. Takes the first training batch, keeps ``global_batch // n_devices``
    examples, and times ``trainer.train_step`` on them under each device (updates
    deferred and discarded, so the variables do not change). Returns one dict per
    device: ``device``, ``seconds`` (median), ``examples_per_s`` and ``suggested_weight``
    (speed relative to the slowest device, 2 decimals).
    """
    from trainer import data, loop

    manual = trainer.manual
    if manual is None:
        raise ConfigError("measure() needs distribute.strategy='manual' (set "
                          "--config.distribute.strategy=manual).")
    cfg = trainer.config
    dataset = data.distribute(trainer.strategy, trainer.build_train_dataset,
                              cfg.train.global_batch_size, deterministic=True)
    loop._ensure_built(trainer, dataset)
    share = max(1, cfg.train.global_batch_size // len(manual.devices))
    batch = tf.nest.map_structure(lambda t: t[:share], next(iter(dataset)))
    results = []
    for device in manual.devices:
        def forward_backward(part, device=device):
            _, calls = manual.run_slice(trainer.train_step, part, device)
            return [g for call in calls for g in call.grads if g is not None]

        fn = tf.function(forward_backward)
        tf.nest.map_structure(lambda t: t.numpy(), fn(batch))  # trace and warm up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            tf.nest.map_structure(lambda t: t.numpy(), fn(batch))
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        results.append({"device": device, "seconds": seconds,
                        "examples_per_s": share / seconds})
    slowest = min(r["examples_per_s"] for r in results)
    for r in results:
        r["suggested_weight"] = round(r["examples_per_s"] / slowest, 2)
    return results


def _main(argv: list[str]) -> None:
    from absl import flags

    from trainer import config as config_lib

    if len(argv) > 1:
        raise SystemExit(f"Unexpected arguments: {' '.join(argv[1:])}")
    config = flags.FLAGS["config"].value
    try:
        config_lib.validate(config)
        if config.distribute.strategy != "manual":
            raise ConfigError("trainer.manual needs --config.distribute.strategy=manual "
                              "(and distribute.devices / distribute.virtual_devices).")
        trainer = config_lib.resolve_trainer_class(config.trainer)(config)
    except ConfigError as error:
        raise SystemExit(f"Configuration error: {error}") from error
    print(trainer.manual.describe())
    if not flags.FLAGS["measure"].value:
        return
    results = measure(trainer, flags.FLAGS["repeats"].value)
    print(f"{'device':<28}{'ms/step':>10}{'examples/s':>14}{'weight':>9}")
    for r in results:
        print(f"{r['device']:<28}{r['seconds'] * 1e3:>10.2f}{r['examples_per_s']:>14.0f}"
              f"{r['suggested_weight']:>9.2f}")
    weights = ",".join(f"{r['suggested_weight']:g}" for r in results)
    print(f"suggested: --config.distribute.device_weights=\"({weights})\"")


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Experiment config file.")
    flags.DEFINE_bool("measure", False, "Time each device and suggest device_weights.")
    flags.DEFINE_integer("repeats", 20, "Timed forward/backward passes per device.")
    flags.mark_flags_as_required(["config"])
    app.run(_main)
