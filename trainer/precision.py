"""Dtype policy, replica-consistent dynamic loss scaling, and non-finite step accounting.

The framework owns loss scaling instead of wrapping ``keras.optimizers.LossScaleOptimizer``:
Keras 3.15 decides finiteness on one replica's *local* gradients, so an inf produced on
another replica is applied and the weights become NaN for good. Here finiteness is
decided on the *all-reduced* gradients (identical on every replica), so every replica
takes the same branch: apply, or skip and halve the scale.

Only ``mixed_float16`` scales the loss; ``float32`` and ``mixed_bfloat16`` never do
(bfloat16 has float32's exponent range), and get the same replica-consistent
non-finite check and skip when ``train.on_nonfinite`` is "skip" or "stop" (its
default "auto" checks only under ``mixed_float16``).

Contexts: :class:`PrecisionState` is created in ``strategy.scope()``; ``scale_loss``
and ``unscale`` run in replica context; ``on_finite`` / ``on_nonfinite`` run once per
update in cross-replica context (inside the merge_call of ``Trainer.apply_gradients``)
or, under strategies without merge_call (default, MultiWorker, TPU), in replica
context on values that are identical on every replica.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import keras
import tensorflow as tf

from trainer.errors import UserError
from trainer.runtime.tracing import per_object_function

_ONLY_FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA


def set_policy(policy: str) -> None:
    """Sets the Keras global dtype policy; call before the model is built."""
    keras.mixed_precision.set_global_policy(policy)


def uses_loss_scaling(policy: str) -> bool:
    """True for ``mixed_float16``, the only policy with (dynamic) loss scaling."""
    return policy == "mixed_float16"


def float16_warning(policy: str, slow_devices: Sequence[str]) -> str | None:
    """The start-up warning for ``mixed_float16`` on ``slow_devices`` (devices without
    fast float16: :func:`trainer.distribution.strategies.slow_float16_devices`), naming the policy to
    use instead, or None. There float16 is emulated or runs on float32 units: slower
    than float32, not faster (the digits model on a 2-core Xeon: 0.03x float32's
    examples/s, benchmarks/README.md; the figure depends on the CPU, so the message
    names the command that measures it, not a ratio). The alternative is
    ``mixed_bfloat16`` on TPUs (their native half type), else ``float32``."""
    if not uses_loss_scaling(policy) or not slow_devices:
        return None
    alternative = ("mixed_bfloat16" if all(d.startswith("TPU") for d in slow_devices)
                   else "float32")
    return (f"precision.policy='mixed_float16' on {', '.join(slow_devices)}, without fast "
            f"float16: it runs slower than float32 there, not faster (python -m "
            f"benchmarks.speed.precision measures it); set precision.policy='{alternative}' "
            f"(--config.precision.policy={alternative}).")


@tf.autograph.experimental.do_not_convert
def outputs_to_float32(outputs):
    """Casts float16/bfloat16 model outputs to float32 so losses are computed in fp32.

    Equivalent to ending the model with ``keras.layers.Activation("linear",
    dtype="float32")``, which is still the recommended way (it keeps the cast inside
    the model for export).
    """

    def cast(t):
        if isinstance(t, tf.Tensor) and t.dtype in (tf.float16, tf.bfloat16):
            return tf.cast(t, tf.float32)
        return t

    return tf.nest.map_structure(cast, outputs)


class PrecisionState:
    """Loss-scale and skipped-step variables of a run (create in ``strategy.scope()``).

    ``step_counter`` counts completed steps (the loop increments it after each step).
    ``dynamic`` is True for ``mixed_float16``: the loss is multiplied by ``scale``
    before the backward pass; a non-finite all-reduced gradient skips the step and
    halves the scale; ``growth_interval`` finite steps in a row double it.
    For float32 / mixed_bfloat16 the scale stays 1 and nothing is multiplied.
    """

    def __init__(self, policy: str, initial_scale: float, growth_interval: int,
                 step_counter: tf.Variable):
        self.dynamic = uses_loss_scaling(policy)
        self.growth_interval = growth_interval
        self.scale = tf.Variable(
            initial_scale if self.dynamic else 1.0, dtype=tf.float32, trainable=False,
            name="loss_scale", aggregation=_ONLY_FIRST)
        self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                      name="loss_scale_good_steps", aggregation=_ONLY_FIRST)
        self.skipped_steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                         name="skipped_steps", aggregation=_ONLY_FIRST)
        # 1-based global step of the latest skipped step (0: none yet).
        self.last_skipped_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                             name="last_skipped_step", aggregation=_ONLY_FIRST)
        # Non-finite updates in a row, and the longest such run since the host last
        # looked (train.on_nonfinite="rollback"; not checkpointed).
        self.nonfinite_streak = tf.Variable(0, dtype=tf.int64, trainable=False,
                                            name="nonfinite_streak", aggregation=_ONLY_FIRST)
        self.worst_streak = tf.Variable(0, dtype=tf.int64, trainable=False,
                                        name="worst_nonfinite_streak", aggregation=_ONLY_FIRST)
        self._step_counter = step_counter
        self._read_counters = per_object_function(
            lambda: (self.skipped_steps.read_value(), self.scale.read_value()), autograph=False)

    def counters(self) -> tuple[int, float]:
        """Host: ``(skipped_steps, loss scale)`` in one compiled read (eager reads of
        distributed variables cost more per logging window: benchmarks/README.md)."""
        skipped, scale = self._read_counters()
        return int(skipped), float(scale)

    @tf.autograph.experimental.do_not_convert
    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """Replica context: the loss to differentiate."""
        return loss * tf.cast(self.scale, loss.dtype) if self.dynamic else loss

    @tf.autograph.experimental.do_not_convert
    def unscale(self, grads: list) -> list:
        """Replica context: divides all-reduced gradients by the scale."""
        if not self.dynamic:
            return grads
        inv = 1.0 / self.scale
        return [map_values(g, lambda v: v * tf.cast(inv, v.dtype)) for g in grads]

    @tf.autograph.experimental.do_not_convert
    def on_finite(self) -> None:
        """Cross-replica context: after an applied step; grows the scale when due."""
        self.nonfinite_streak.assign(0)
        if not self.dynamic:
            return
        grow = self.good_steps + 1 >= self.growth_interval
        self.scale.assign(tf.where(grow, self.scale * 2.0, self.scale))
        self.good_steps.assign(tf.where(grow, tf.constant(0, tf.int64), self.good_steps + 1))

    @tf.autograph.experimental.do_not_convert
    def on_nonfinite(self) -> None:
        """Cross-replica context: after a skipped step; counts it and halves the scale."""
        self.skipped_steps.assign_add(1)
        self.last_skipped_step.assign(self._step_counter + 1)
        self.nonfinite_streak.assign_add(1)
        self.worst_streak.assign(tf.maximum(self.worst_streak, self.nonfinite_streak))
        if self.dynamic:
            self.scale.assign(tf.maximum(self.scale / 2.0, 1.0))
            self.good_steps.assign(0)


@dataclasses.dataclass(frozen=True)
class NonFinitePolicy:
    """What ``train.on_nonfinite`` means: the one place its values are interpreted.

    ``mode``: "auto", "skip", "stop" or "rollback" (config validation checks it);
    ``dynamic``: dynamic loss scaling (``mixed_float16``) is on."""

    mode: str
    dynamic: bool

    @property
    def checks_updates(self) -> bool:
        """Every update is checked for NaN/inf (and skipped if so). "auto" checks only
        where dynamic loss scaling needs it: the check gates every update on a reduction
        over all gradients (a tf.cond), which costs an overhead-bound step ~5-10%
        (benchmarks/README.md)."""
        return self.mode != "auto" or self.dynamic

    @property
    def stops(self) -> bool:
        """The run stops at the first loop that skipped an update."""
        return self.mode == "stop"

    @property
    def rolls_back(self) -> bool:
        """A blow-up restores the last checkpoint (:mod:`trainer.services.nonfinite`)."""
        return self.mode == "rollback"

    def warning(self) -> str | None:
        """What to tell the user about this setting at start-up, or None."""
        if self.dynamic and self.stops:
            return ("train.on_nonfinite='stop' with mixed_float16 also stops at a loss-scale "
                    "overflow, which dynamic loss scaling normally skips; use 'skip'.")
        return None


class NonFiniteError(UserError, FloatingPointError):
    """NaN/inf where training cannot go on: gradients under ``train.on_nonfinite="stop"``,
    weights at a checkpoint save, or too many rollbacks; the message names the step and
    the last good checkpoint and says what to do (one ``Non-finite error`` line, exit 1)."""

    prefix = "Non-finite error"


@tf.autograph.experimental.do_not_convert
def map_values(grad, fn):
    """Applies ``fn`` to a dense gradient, or to the values of an ``IndexedSlices``."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


@tf.autograph.experimental.do_not_convert
def all_finite(grads: list) -> tf.Tensor:
    """True when every gradient element is finite (a sum is NaN/inf otherwise)."""
    sums = [tf.reduce_sum(tf.cast(g.values if isinstance(g, tf.IndexedSlices) else g,
                                  tf.float32)) for g in grads]
    return tf.math.is_finite(tf.add_n(sums)) if sums else tf.constant(True)
