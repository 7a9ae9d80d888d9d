"""Where an optimizer update may branch, and the per-replica accumulators.

A Keras ``apply`` calls ``merge_call``, which may not sit inside a ``tf.cond`` in
replica context. :func:`in_update_context` is the ONE place that decides where an update
may branch: in replica context under strategies without merge_call (default,
MultiWorker, TPU), else in cross-replica context (Mirrored, OneDevice), re-entering
replica context for the apply. The update logic of :mod:`trainer.step.gradients` is written
once against the two operation sets, :class:`ReplicaOps` and :class:`CrossReplicaOps`.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from trainer.runtime import keras_compat
from trainer.runtime.tracing import no_autograph

_SUM = tf.distribute.ReduceOp.SUM


class Accumulators:
    """Per-replica gradient sums of one optimizer for ``perf.grad_accum_steps > 1``.

    Created in ``strategy.scope()``. Each replica adds its LOCAL (not yet all-reduced)
    gradients and example count in replica context (``ON_READ`` variables: a replica
    reads and writes its own copy, no communication); the apply step all-reduces the
    sums once. ``ON_READ``/``SUM`` keeps a checkpoint of a partial window sum-exact.
    """

    def __init__(self, variables: list):
        on_read = dict(trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.SUM)
        self.index = {id(v): i for i, v in enumerate(variables)}
        self.grads = [tf.Variable(tf.zeros(v.shape, tf.float32), name="grad_accum", **on_read)
                      for v in variables]
        self.count = tf.Variable(0.0, name="grad_accum_count", **on_read)

    def slots(self, variables: list) -> list:
        """The accumulators of ``variables`` (which must have been given at creation)."""
        missing = [v.name for v in variables if id(v) not in self.index]
        if missing:
            raise ValueError(
                f"No gradient accumulators for {missing}: with perf.grad_accum_steps > 1 "
                f"pass every variable this optimizer updates to "
                f"build_optimizer_variables(optimizer, variables).")
        return [self.grads[self.index[id(v)]] for v in variables]


class ReplicaOps:
    """Update operations in replica context (strategies without merge_call)."""

    def __init__(self):
        self._ctx = tf.distribute.get_replica_context()

    #: Whether every replica of the run is in this process (then :meth:`local_values`
    #: holds them all). In replica context a replica sees only itself.
    one_process = False

    def all_reduce(self, values: list) -> list:
        return self._ctx.all_reduce(_SUM, values)

    def all_gather(self, value: tf.Tensor) -> tf.Tensor:
        """Every replica's ``value`` concatenated on axis 0 (same shape on each)."""
        return self._ctx.all_gather(value, axis=0)

    def each(self, fn: Callable, *args) -> Any:
        return fn(*args)

    def first(self, value):
        return value

    def apply(self, optimizer, grads: list, variables: list) -> None:
        keras_compat.apply_reduced(optimizer, grads, variables)


class CrossReplicaOps:
    """Update operations in cross-replica context (inside ``merge_call``)."""

    def __init__(self, strategy: tf.distribute.Strategy):
        self._strategy = strategy
        self.one_process = (len(strategy.extended.worker_devices)
                            == strategy.num_replicas_in_sync)

    def all_reduce(self, values: list) -> list:
        return self._strategy.extended.batch_reduce_to(_SUM, [(v, v) for v in values])

    def all_gather(self, value) -> tf.Tensor:
        """Every replica's ``value`` (per-replica, same shape on each) concatenated on
        axis 0."""
        return self._strategy.gather(value, axis=0)

    def local_values(self, value) -> list:
        """This process's replicas' components of ``value``, in replica order."""
        return list(self._strategy.experimental_local_results(value))

    def each(self, fn: Callable, *args) -> Any:
        return self._strategy.extended.call_for_each_replica(fn, args=args)

    def first(self, value):
        return self._strategy.experimental_local_results(value)[0]

    def apply(self, optimizer, grads: list, variables: list) -> None:
        self.each(lambda g: keras_compat.apply_reduced(optimizer, g, variables), grads)


@no_autograph
def in_update_context(body: Callable, values) -> Any:
    """Replica context: runs ``body(ops, values)`` where it may ``tf.cond`` around an
    optimizer apply or a collective; ``ops`` is a :class:`ReplicaOps` or
    :class:`CrossReplicaOps`. Returns what ``body`` returns (plain tensors: the same on
    every replica)."""
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        return body(ReplicaOps(), values)
    return tf.distribute.get_replica_context().merge_call(
        lambda strategy, values_: body(CrossReplicaOps(strategy), values_), args=(values,))
