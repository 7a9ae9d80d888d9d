"""The in-graph loops of one Trainer: ``train.steps_per_loop`` steps per ``tf.function``.

:class:`CompiledLoops` is the one place that builds them. The step function is its own
``tf.function``, traced once; the train loop is a ``tf.range`` loop over the distributed
iterator whose step count is a tensor argument (a shorter loop does not retrace).

Nothing flows through the loop but the iterator and the step count: each step writes
its outputs into per-replica variables (:class:`StepOutputSlots`: the last step's
outputs, and the running sum of the steps' ``"loss"``) and the loop reads them once at
its end, adds the mean loss to ``train_loss`` (one metric update per call, weighted by
the steps) and returns the last outputs. A value carried from one iteration to the next
costs a handful of control-flow ops per replica per step, a variable write one: on the
overhead-bound MLP with 2 Mirrored replicas, carrying the outputs and the loss sum cost
a measurable share of the step (benchmarks/README.md). Contexts: the loops are called in
cross-replica context; the step functions run in replica context.
"""

from __future__ import annotations

from typing import Callable

import keras
import tensorflow as tf
from absl import logging

from trainer.data import zeros_for_spec
from trainer.runtime.tracing import no_autograph, per_object_function
from trainer.step import random_streams

_MEAN = tf.distribute.ReduceOp.MEAN


def replica_spec(spec):
    """One replica's spec of a distributed dataset/iterator ``element_spec``
    (``PerReplicaSpec`` on several local replicas holds one spec per replica)."""
    return tf.nest.map_structure(lambda s: getattr(s, "_value_specs", [s])[0], spec)


class StepOutputSlots:
    """Per-replica variables a train step writes its outputs into (replica context).

    ``last[name]``: the last step's ``name`` output on this replica; ``loss_sum``: the sum
    of the steps' mean ``"loss"`` since the last :meth:`take_loss_sum`. ``ON_READ``
    variables: each replica writes its own copy, no communication. Created eagerly in
    ``strategy.scope()`` from one replica's traced outputs (shapes fully known).
    """

    def __init__(self, strategy: tf.distribute.Strategy, local_outputs: dict):
        on_read = dict(trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        with strategy.scope():
            self.last = {name: tf.Variable(tf.zeros(value.shape, value.dtype),
                                           name=f"last_{name}", **on_read)
                         for name, value in local_outputs.items()}
            self.loss_sum = tf.Variable(0.0, name="loss_sum", **on_read)

    @no_autograph
    def write(self, outputs: dict) -> None:
        """Replica context: records one step's outputs."""
        for name, value in outputs.items():
            self.last[name].assign(value, read_value=False)
        loss = tf.cast(outputs["loss"], tf.float32)
        self.loss_sum.assign_add(loss if loss.shape.rank == 0 else tf.reduce_mean(loss),
                                 read_value=False)

    @no_autograph
    def take_loss_sum(self) -> tf.Tensor:
        """Replica context: this replica's loss sum, reset to 0."""
        total = self.loss_sum.read_value()
        self.loss_sum.assign(0.0, read_value=False)  # after the read: tf.function orders them
        return total


class CompiledLoops:
    """The ``tf.function`` loops of one Trainer (cross-replica context).

    ``prepare(iterator)`` once, then ``train(iterator, n)`` runs ``n >= 1`` steps and
    returns the last step's outputs, averaged over replicas. ``evaluate(iterator, n)``
    runs ``n`` eval steps, or until the iterator is exhausted when ``n < 0``; results
    accumulate in the eval metrics.

    Args:
      strategy: the run's strategy.
      train_step, eval_step: replica functions ``batch -> dict`` (``"loss"`` required;
        checked by :mod:`trainer.checks.hooks`, which the Trainer wraps them in).
      jit_step: compile the whole replica train step with XLA (``tf.function(
        jit_compile=True)``: forward, backward, gradient path, optimizer update and metric
        updates; the iterator and the output slots stay outside). One replica only.
      step_counter: incremented after every train step.
      random_rows: > 0 (the per-replica batch, ``distribute.random_draws="global"``): the
        train step's random draws are its rows of one global draw
        (:func:`trainer.step.random_streams.keyed`); 0: each replica its own stream.
      train_loss, eval_loss: ``keras.metrics.Mean`` of the steps' ``"loss"`` (train: the
        mean over the call's steps of each replica's ``"loss"``, averaged over elements).
    """

    def __init__(self, strategy: tf.distribute.Strategy, train_step: Callable,
                 eval_step: Callable, step_counter: tf.Variable, train_loss, eval_loss,
                 jit_step: bool = False, random_rows: int = 0):
        self.slots: StepOutputSlots | None = None  # created by prepare()
        # Per-replica random streams, keyed inside the XLA function: a key read outside
        # would be a tensor of whichever loop graph first traced it (the plan's trials').
        keyed_train = random_streams.keyed(train_step, step_counter, random_rows)
        if jit_step:
            keyed_train = per_object_function(keyed_train, jit_compile=True, autograph=False)
        self._train_step = keyed_train
        keyed_eval = random_streams.keyed(eval_step, step_counter)

        @no_autograph
        def replica_eval(batch):
            eval_loss.update_state(keyed_eval(batch)["loss"])

        @per_object_function(autograph=False)
        def one_step(iterator):
            outputs = strategy.run(keyed_train, args=(next(iterator),))
            step_counter.assign_add(1, read_value=False)
            return outputs

        @per_object_function(autograph=False)
        def step_and_write(iterator):
            strategy.run(self.slots.write, args=(one_step(iterator),))

        @no_autograph
        def finish(num_steps):
            """Replica context, after the loop: the loss metric and the last outputs."""
            count = tf.cast(num_steps, tf.float32)
            train_loss.update_state(self.slots.take_loss_sum() / count, sample_weight=count)
            return {name: slot.read_value() for name, slot in self.slots.last.items()}

        @per_object_function
        def train(iterator, num_steps):
            if self.slots is None:
                raise RuntimeError("CompiledLoops.prepare(iterator) must run before train().")
            for _ in tf.range(num_steps):
                step_and_write(iterator)
            outputs = strategy.run(finish, args=(num_steps,))
            return {k: tf.reduce_mean(strategy.reduce(_MEAN, v, axis=None))
                    for k, v in outputs.items()}

        @per_object_function
        def evaluate(iterator, num_steps):
            done = tf.constant(0, tf.int64)
            while num_steps < 0 or done < num_steps:
                optional = iterator.get_next_as_optional()
                if not optional.has_value():
                    break
                strategy.run(replica_eval, args=(optional.get_value(),))
                done += 1
            return done

        self._one_step = one_step
        self._strategy = strategy
        self.train = train
        self.evaluate = evaluate

    def lowering_error(self, batch_spec) -> str | None:
        """With ``jit_step``: lowers the XLA train step for one replica's batch of
        ``batch_spec`` (zeros; traced and lowered, nothing runs, no state changes) and
        returns the error, or None when it lowers. Host; one replica."""
        batch = zeros_for_spec(batch_spec)

        def lower(replica_batch):  # in replica context, as the loop calls the step
            self._train_step.experimental_get_compiler_ir(replica_batch)(stage="hlo")

        try:
            self._strategy.run(lower, args=(batch,))
        except Exception as error:  # any failure drops the plan, with the reason
            return f"{type(error).__name__}: {error}"
        return None

    def prepare(self, iterator) -> None:
        """Host, before the first ``train`` call: traces the step on ``iterator``'s
        element spec (the trace ``train`` reuses) and creates the output slots from it."""
        if self.slots is not None:
            return
        outputs = self._one_step.get_concrete_function(iterator).structured_outputs
        local = {name: self._strategy.experimental_local_results(value)[0]
                 for name, value in outputs.items()}
        self.slots = StepOutputSlots(self._strategy, local)


# ---------------------------------------------------------------- trainable watch
# Which variables the traced train step updates, and when that set changes.
#
# A traced step differentiates the model's trainable variables as they were when it was
# traced. A layer frozen or unfrozen later (between two ``fit()`` calls, or by a callback
# at a loop boundary) changes that set: :class:`TrainableWatch` tells the loop driver, which
# then traces the step again, once. The optimizer already holds state for every weight of
# a frozen layer (:func:`trainer.runtime.keras_compat.trainable_capable_variables`). Host only.
class TrainableWatch:
    """Remembers the trainable variables the step was last traced with."""

    def __init__(self):
        self._traced: tuple[int, ...] | None = None

    def changed(self, model: keras.Model, step: int) -> bool:
        """True (with one log line) when ``model``'s trainable variables differ from those
        of the last call; records the current set either way."""
        current = tuple(id(v) for v in model.trainable_variables)
        changed = self._traced is not None and current != self._traced
        if changed:
            logging.info("trainable variables changed (%d -> %d) at step %d: the train "
                         "step is traced again.", len(self._traced), len(current), step)
        self._traced = current
        return changed
