"""Collectives for a custom step: every replica's values, gathered or reduced.

:func:`all_gather` and :func:`all_reduce` (``Trainer.all_gather`` / ``Trainer.all_reduce``
in a ``train_step``; PyTorch Lightning's ``all_gather`` is the model) work the same on
one device, Mirrored replicas, several workers and TPU cores: replica context, every
replica must call them with the same structure, and on one replica they return the
value unchanged. ``all_gather`` concatenates along ``axis`` in replica order, which is
the order of the global batch (replica 0's examples first; workers in task order), and
it is differentiable: the gradient of a replica's input is the sum over the replicas of
the gradients of the gathered value, sliced back to that replica's part, so a loss over
the gathered values (a contrastive loss against every example of the global batch)
trains as it would on one replica with the whole batch.

Under manual data parallelism the device slices run one after another in one replica:
no slice can see the values of slices that have not run, so both refuse with one line
(use Mirrored over the same devices). So do TensorFlow's own collectives written as its
guides write them (``tf.distribute.get_replica_context().all_gather(...)``,
``all_reduce``, ``merge_call``): each slice's step runs inside
:func:`refusing_replica_context`, whose collectives raise the same line when the step is
traced (one replica's context would return this slice's values alone, silently).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from trainer.errors import ConfigError

_OPS = {"sum": tf.distribute.ReduceOp.SUM, "mean": tf.distribute.ReduceOp.MEAN}


def _manual_refusal(what: str) -> ConfigError:
    return ConfigError(
        f"{what} under distribute.strategy='manual' with several devices: the device "
        f"slices run one after another, so no slice can see the values of the others; "
        f"use distribute.strategy='mirrored' over the same devices (equal shares).")


class _RefusingReplicaContext(tf.distribute.ReplicaContext):
    """The replica context of one device slice under manual data parallelism: the
    strategy's one replica, whose collectives raise :func:`_manual_refusal`."""

    def all_gather(self, value, axis, options=None):
        raise _manual_refusal("tf.distribute.get_replica_context().all_gather")

    def all_reduce(self, reduce_op, value, options=None):
        raise _manual_refusal(
            "tf.distribute.get_replica_context().all_reduce (the step's own, or a "
            "BatchNormalization(synchronized=True)'s, which distribute.sync_batch_norm=True "
            "makes of every one; a plain one normalises each slice by its own statistics)")

    def merge_call(self, merge_fn, args=(), kwargs=None):
        raise _manual_refusal(
            f"tf.distribute.get_replica_context().merge_call (from "
            f"{getattr(merge_fn, '__qualname__', 'a merge function')})")


def refusing_replica_context(strategy: tf.distribute.Strategy) -> tf.distribute.ReplicaContext:
    """A context manager (``with refusing_replica_context(strategy):``) for tracing one
    device slice's step in ``strategy``'s one replica: inside, TensorFlow's replica-context
    collectives raise one ConfigError line (see the module docstring)."""
    return _RefusingReplicaContext(strategy, replica_id_in_sync_group=0)


def _context(what: str, reducer: Any) -> tf.distribute.ReplicaContext:
    if not getattr(reducer, "supports_collectives", True):
        raise _manual_refusal(what)
    context = tf.distribute.get_replica_context()
    if context is None:
        raise RuntimeError(f"{what} runs in replica context: call it inside train_step or "
                           f"eval_step, not on the host.")
    return context


def all_gather(value: Any, axis: int = 0, reducer: Any = None) -> Any:
    """Replica context: ``value`` (a tensor or a nest of tensors) of every replica,
    concatenated along ``axis`` in replica order; ``value`` itself on one replica.
    Differentiable (see the module docstring). ``reducer``: the gradient path's, which
    says whether collectives are possible (manual data parallelism: not)."""
    context = _context("all_gather", reducer)
    if context.num_replicas_in_sync == 1:
        return value
    return context.all_gather(value, axis)


def all_reduce(value: Any, op: str = "sum", reducer: Any = None) -> Any:
    """Replica context: the ``op`` (``"sum"`` or ``"mean"``) over the replicas of
    ``value`` (a tensor or a nest of tensors), the same on every replica; ``value``
    itself on one replica. Differentiable (TensorFlow's all-reduce gradient)."""
    if op not in _OPS:
        raise ValueError(f"all_reduce op={op!r} is not one of {', '.join(map(repr, _OPS))}.")
    context = _context("all_reduce", reducer)
    if context.num_replicas_in_sync == 1:
        return value
    return context.all_reduce(_OPS[op], value)
