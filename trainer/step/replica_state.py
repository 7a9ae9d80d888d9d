"""State the forward pass updates, kept equal on every replica (by MEAN).

A Keras layer that updates a non-trainable weight in ``call`` (BatchNormalization's
moving statistics, a running mean, a normaliser) creates it with Keras' default
``aggregation="none"``. Under a Mirrored, multi-worker or TPU strategy every replica then
updates its own copy from its own batch: the copies drift apart without a word, the
forward passes read different values, and a checkpoint keeps replica 0's. (PyTorch DDP
broadcasts such buffers from rank 0 before each forward pass instead.)

The framework averages, which is what one replica on the global batch computes in the
common case: the model is built under :func:`averaged_state`, which gives every
floating-point non-trainable variable created with the default aggregation
``aggregation=MEAN``. Each ``assign`` in replica context then sets every replica's copy
to the mean of the values the replicas assign, at once (a read after the update, in the
same forward pass, sees the mean too). A running mean ``m <- a*m + (1-a)*mean(batch)``
equals the one-replica run on the global batch (replicas hold equal batches). The price
is one small all-reduce per assign, and such an assign cannot sit inside a ``tf.cond``
or a loop in the step (TensorFlow cannot synchronise replicas there): that step is
refused with one line (:mod:`trainer.checks.hooks`).

Left alone: integer state (counters, random-seed states), which must change the same way
on every replica (the replica-consistency check says when it does not), and a variable
whose aggregation or synchronization the user chose. A non-linear update (a running
maximum) averaged over replicas is not the global one; the docs say so.

Manual data parallelism runs its device slices one after another on ONE copy of the
variables: :class:`SliceState` starts each slice from the state before the step and
sets the example-weighted mean of the slices' results, the same rule.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import keras
import tensorflow as tf

from trainer.runtime import keras_compat

_DEFAULT_AGGREGATION = (None, tf.VariableAggregation.NONE)
_DEFAULT_SYNCHRONIZATION = (None, tf.VariableSynchronization.AUTO,
                            tf.VariableSynchronization.ON_WRITE)


def _floating(kwargs: dict) -> bool:
    dtype = kwargs.get("dtype")
    if dtype is None:
        dtype = getattr(kwargs.get("initial_value"), "dtype", None)
    return dtype is not None and tf.as_dtype(dtype).is_floating


@contextlib.contextmanager
def averaged_state() -> Iterator[None]:
    """Variables created inside: a floating-point non-trainable one with the default
    aggregation and synchronization gets ``aggregation=MEAN`` (see the module docstring).
    Use it around building the model, in ``strategy.scope()``."""

    def creator(next_creator, **kwargs):
        if (kwargs.get("trainable") is False
                and kwargs.get("aggregation") in _DEFAULT_AGGREGATION
                and kwargs.get("synchronization") in _DEFAULT_SYNCHRONIZATION
                and _floating(kwargs)):
            kwargs["aggregation"] = tf.VariableAggregation.MEAN
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


def forward_state(model: keras.Model, integers: bool = False) -> list:
    """The model's floating-point (and with ``integers`` integer) non-trainable variables
    that are not the weights of a frozen layer: what a forward pass may update (BatchNorm
    statistics, running means, counters). Call once the model is built."""
    weights = {id(v) for v in keras_compat.trainable_capable_variables(model)}
    kinds = (lambda d: d.is_floating or d.is_integer) if integers else (lambda d: d.is_floating)
    return [v for v in model.non_trainable_variables
            if id(v) not in weights and kinds(tf.as_dtype(v.dtype))]


class SliceState:
    """Manual data parallelism: the forward state as one device on the whole batch would
    leave it, from slices that run one after another on one copy of the variables.

    ``begin()`` before the first slice, ``next_slice()`` before each later one (restores
    the state the step started from), ``end_slice(n)`` after each (records the slice's
    result and example count), ``finish(total)`` after the last: floating-point state
    becomes the example-weighted mean of the slices' results, integer state the first
    slice's (a counter counts the step once). Called while the step is traced. A forward
    pass that reads the state after updating it sees its own slice's update (as
    BatchNorm normalises each slice by its own statistics).
    """

    def __init__(self, model: keras.Model):
        self.state = forward_state(model, integers=True)
        self._before: list = []
        self._results: list[tuple[list, Any]] = []

    def begin(self) -> None:
        self._before = [tf.identity(v) for v in self.state]
        self._results = []

    def next_slice(self) -> None:
        for variable, old in zip(self.state, self._before):
            variable.assign(old)

    def end_slice(self, examples) -> None:
        self._results.append(([tf.identity(v) for v in self.state], examples))

    def finish(self, total) -> None:
        if len(self._results) < 2:
            return
        for k, variable in enumerate(self.state):
            if not tf.as_dtype(variable.dtype).is_floating:
                variable.assign(self._results[0][0][k])
                continue
            terms = [tf.cast(values[k], tf.float32) * tf.cast(n, tf.float32)
                     for values, n in self._results]
            mean = tf.math.divide_no_nan(tf.add_n(terms), tf.cast(total, tf.float32))
            variable.assign(tf.cast(mean, variable.dtype))
