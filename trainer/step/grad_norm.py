"""The global gradient norm for the logs (``train/grad_norm``), summed in the graph."""

from __future__ import annotations

import tensorflow as tf

from trainer.runtime.tracing import no_autograph, per_object_function


class GradientNormStats:
    """Sum and count of the global gradient norm of sampled updates, since :meth:`take`.

    The norm is of the all-reduced, unscaled gradients BEFORE clipping (the same value
    on every replica). Each replica adds to its own copy (``ON_READ`` variables, no
    communication, no host sync); the host reads the first replica's copy at log time.

    Sampling. Computing the norm is a full pass over the reduced gradients on every
    replica's critical path, between the all-reduce and the end of the step: a few
    percent of an overhead-bound step (benchmarks/README.md). So
    :meth:`maybe_record` computes it for every ``every``-th optimizer update only (a
    ``tf.cond`` on the optimizer's update count, the same on every replica) and the
    logged value is the mean over the window's sampled updates. Where the norm is
    computed anyway (clipping by global norm) :meth:`record` takes every update.
    Create in ``strategy.scope()``.
    """

    def __init__(self, every: int = 1):
        self.every = every
        on_read = dict(trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self.total = tf.Variable(0.0, name="grad_norm_sum", **on_read)
        self.count = tf.Variable(0.0, name="grad_norm_count", **on_read)
        self._take = per_object_function(self._read_and_reset, autograph=False)

    @no_autograph
    def record(self, norm: tf.Tensor) -> None:
        """Replica context: one update's norm."""
        self.total.assign_add(tf.cast(norm, tf.float32), read_value=False)
        self.count.assign_add(1.0, read_value=False)

    @no_autograph
    def maybe_record(self, grads: list, iterations) -> None:
        """Replica context: records the global norm of ``grads`` iff ``iterations`` (the
        optimizer's update count before this update) is a multiple of ``every``."""
        if self.every == 1:
            self.record(tf.linalg.global_norm(grads))
            return

        def sample():
            self.record(tf.linalg.global_norm(grads))
            return tf.constant(True)

        due = tf.equal(tf.math.floormod(tf.convert_to_tensor(iterations), self.every), 0)
        tf.cond(due, sample, lambda: tf.constant(False))

    def _read_and_reset(self) -> tuple[tf.Tensor, tf.Tensor]:
        total, count = self.total.read_value(), self.count.read_value()
        self.total.assign(0.0, read_value=False)
        self.count.assign(0.0, read_value=False)
        return total, count

    def take(self) -> float | None:
        """Host: the mean norm since the last call (None: no update sampled), then resets
        (one compiled call)."""
        total, count = (float(v) for v in self._take())
        return total / count if count else None
