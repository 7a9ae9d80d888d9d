"""The in-graph loops of one Trainer: ``train.steps_per_loop`` steps per ``tf.function``.

:class:`CompiledLoops` is the one place that builds them. The step function is its own
``tf.function``, traced once; the train loop is a ``tf.range`` loop over the distributed
iterator whose step count is a tensor argument (a shorter loop does not retrace), and it
carries its last outputs, which start as zeros of the traced output shapes, so the step
appears once in the loop's graph. The loop also carries each replica's sum of the
steps' ``"loss"`` and adds it to ``train_loss`` once per call (weighted by the steps):
one metric update per loop instead of one per step (2-3% of a small Mirrored step). Contexts: the loops are called in cross-replica
context; the step functions run in replica context.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from trainer.tracing import no_autograph

_MEAN = tf.distribute.ReduceOp.MEAN


def _check_outputs(outputs, hook: str) -> None:
    if not isinstance(outputs, dict) or "loss" not in outputs:
        raise TypeError(f"{hook} must return a dict with a 'loss' entry; got {outputs!r}.")


@no_autograph
def _zeros_like_outputs(step, iterator, strategy):
    """A replica function returning zeros shaped like one replica's outputs of ``step``.

    They start the loop-carried outputs, so the loop body holds the only copy of the
    step: peeling the first step out of the loop instead doubled the graph that
    TensorFlow optimises before the first call (+1.7 s on the transformer benchmark
    with 2 replicas). ``step`` (a ``tf.function``) is traced here, once; its call in the
    loop reuses the trace.
    """
    outputs = step.get_concrete_function(iterator).structured_outputs
    local = tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], outputs)
    for name, value in local.items():
        if not value.shape.is_fully_defined():
            raise ValueError(f"train_step returned {name!r} with shape {value.shape}, which "
                             f"is not fully known while tracing; return scalars (e.g. "
                             f"tf.reduce_mean of it).")
    return no_autograph(lambda: tf.nest.map_structure(lambda t: tf.zeros(t.shape, t.dtype), local))


class CompiledLoops:
    """The ``tf.function`` loops of one Trainer (cross-replica context).

    ``train(iterator, n)`` runs ``n >= 1`` steps and returns the last step's outputs,
    averaged over replicas. ``evaluate(iterator, n)`` runs ``n`` eval steps, or until
    the iterator is exhausted when ``n < 0``; results accumulate in the eval metrics.

    Args:
      strategy: the run's strategy.
      train_step, eval_step: replica functions ``batch -> dict`` (``"loss"`` required).
      step_counter: incremented after every train step.
      train_loss, eval_loss: ``keras.metrics.Mean`` of the steps' ``"loss"`` (train: the
        mean over the call's steps of each replica's ``"loss"``, averaged over elements).
    """

    def __init__(self, strategy: tf.distribute.Strategy, train_step: Callable,
                 eval_step: Callable, step_counter: tf.Variable, train_loss, eval_loss):
        @no_autograph
        def replica_train(batch):
            outputs = train_step(batch)
            _check_outputs(outputs, "train_step")
            return outputs

        @no_autograph
        def add_loss(total, loss):
            return total + tf.reduce_mean(tf.cast(loss, tf.float32))

        @no_autograph
        def record_loss(total, num_steps):
            count = tf.cast(num_steps, tf.float32)
            train_loss.update_state(total / count, sample_weight=count)

        @no_autograph
        def replica_eval(batch):
            outputs = eval_step(batch)
            _check_outputs(outputs, "eval_step")
            eval_loss.update_state(outputs["loss"])

        @tf.function(autograph=False)
        def one_step(iterator):
            outputs = strategy.run(replica_train, args=(next(iterator),))
            step_counter.assign_add(1, read_value=False)
            return outputs

        @tf.function
        def train(iterator, num_steps):
            outputs = strategy.run(_zeros_like_outputs(one_step, iterator, strategy))
            total = strategy.run(lambda: tf.constant(0.0))  # per replica: sum of step losses
            for _ in tf.range(num_steps):
                outputs = one_step(iterator)
                total = strategy.run(add_loss, args=(total, outputs["loss"]))
            strategy.run(record_loss, args=(total, num_steps))
            return {k: tf.reduce_mean(strategy.reduce(_MEAN, v, axis=None))
                    for k, v in outputs.items()}

        @tf.function
        def evaluate(iterator, num_steps):
            done = tf.constant(0, tf.int64)
            while num_steps < 0 or done < num_steps:
                optional = iterator.get_next_as_optional()
                if not optional.has_value():
                    break
                strategy.run(replica_eval, args=(optional.get_value(),))
                done += 1
            return done

        self.train = train
        self.evaluate = evaluate
