"""``Trainer``: the hooks a user overrides and the default train/eval steps.

What a *step* is lives here; *when* things happen (loops, eval cadence, logging,
checkpoints) lives in :mod:`trainer.loop`. This module knows nothing about files,
ports or processes.

Contexts:

* ``build_*`` hooks run in cross-replica context inside ``strategy.scope()``;
* ``train_step``, ``eval_step``, ``compute_loss``, ``update_metrics`` and
  ``apply_gradients`` run in REPLICA context, traced by ``tf.function`` (no numpy, no
  Python side effects that must happen every step);
* ``fit``, ``evaluate``, ``restore``, ``export`` are called eagerly from the host.
"""

from __future__ import annotations

import threading
from typing import Any

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from trainer import config as config_lib
from trainer import distribute, optimizers, precision

_SUM = tf.distribute.ReduceOp.SUM


def split_batch(batch) -> tuple[Any, Any]:
    """``(features, labels)`` of a batch: a 2-tuple, or a dict with a "label(s)" key."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, dict):
        for key in ("label", "labels"):
            if key in batch:
                return {k: v for k, v in batch.items() if k != key}, batch[key]
    raise ValueError(
        "The default steps expect batches of (features, labels) or a dict with a 'label' "
        f"key; got {type(batch).__name__}. Override train_step/eval_step for other layouts.")


def _batch_dim(tree) -> tf.Tensor:
    first = tf.nest.flatten(tree)[0]
    return tf.shape(first)[0]


def check_per_example_loss(per_example_loss: tf.Tensor, batch=None) -> tf.Tensor:
    """Raises at trace time unless ``per_example_loss`` has shape ``[batch_size]``.

    With ``batch`` given, the static batch size must match its first tensor's.
    """
    per_example_loss = tf.convert_to_tensor(per_example_loss)
    rank = per_example_loss.shape.rank
    if rank == 0:
        raise ValueError(
            "compute_loss returned a scalar; it must return the PER-EXAMPLE loss, shape "
            "[batch_size] (e.g. keras.losses.sparse_categorical_crossentropy(labels, "
            "logits, from_logits=True) without reducing). The framework averages by the "
            "GLOBAL batch so every replica count trains the same.")
    if rank != 1:
        raise ValueError(
            f"compute_loss returned shape {per_example_loss.shape}; it must return the "
            f"per-example loss, shape [batch_size]. Reduce the other axes yourself "
            f"(e.g. tf.reduce_mean(loss, axis=-1) over timesteps).")
    if batch is None:
        return per_example_loss
    expected = tf.nest.flatten(batch)[0].shape[:1]
    if not per_example_loss.shape[:1].is_compatible_with(expected):
        raise ValueError(
            f"compute_loss returned {per_example_loss.shape[0]} losses for a batch of "
            f"{expected[0]} examples; return one loss per example.")
    return per_example_loss


_PRE_REDUCED = threading.local()  # per replica thread: "gradients are already summed"


def _mark_reduction_switchable(optimizer: keras.optimizers.Optimizer) -> None:
    """Lets the framework apply already all-reduced gradients through ``optimizer``.

    A Keras optimizer sums gradients across replicas inside ``apply``.
    ``Trainer.apply_gradients`` all-reduces (then unscales, clips and checks) them
    itself, so while it applies (flag set in the calling replica thread) the Keras sum
    is skipped. A user step that calls ``optimizer.apply`` directly keeps the Keras
    behaviour.
    """
    if getattr(optimizer, "_trainer_switchable", False):
        return
    if not hasattr(optimizer, "_all_reduce_sum_gradients"):
        raise RuntimeError(
            f"{type(optimizer).__name__} has no _all_reduce_sum_gradients: this Keras "
            f"version ({keras.__version__}) changed how optimizers reduce gradients; "
            f"use the Keras version in setup.cfg.")
    keras_reduce = optimizer._all_reduce_sum_gradients

    def reduce(grads_and_vars):
        if getattr(_PRE_REDUCED, "active", False):
            return list(grads_and_vars)
        return keras_reduce(grads_and_vars)

    optimizer._all_reduce_sum_gradients = reduce
    optimizer._trainer_switchable = True


def _apply_reduced(optimizer: keras.optimizers.Optimizer, grads: list, variables: list) -> None:
    """Replica context: ``optimizer.apply`` of gradients that are already all-reduced."""
    _PRE_REDUCED.active = True
    try:
        optimizer.apply(grads, variables)
    finally:
        _PRE_REDUCED.active = False


class Trainer:
    """Base class of a training program; subclass it and override the hooks.

    Required hooks: ``build_model``, ``build_train_dataset``, ``compute_loss``.
    Everything else (distribution, global-batch loss averaging, mixed precision, loss
    scaling, clipping, metrics, progress) comes from ``config``.

    Attributes:
      config: the validated ``ConfigDict``.
      workdir: where the run writes (checkpoints, summaries, config); may be None.
      strategy: the ``tf.distribute.Strategy``.
      model, optimizer: built in ``strategy.scope()`` (optimizer variables too).
      step: global steps done so far (a Python int on the host).
    """

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | None = None,
                 strategy: tf.distribute.Strategy | None = None):
        config_lib.validate(config)
        self.config = config
        self.workdir = workdir
        self.strategy = strategy or distribute.build_strategy(config.distribute)
        replicas = self.strategy.num_replicas_in_sync
        config_lib.check_batch_divisible(
            "train.global_batch_size", config.train.global_batch_size, replicas)
        config_lib.check_batch_divisible(
            "eval.global_batch_size", self.eval_global_batch_size, replicas)
        keras.utils.set_random_seed(config.seed)
        precision.set_policy(config.precision.policy)
        with self.strategy.scope():
            self.model = self.build_model()
            if not isinstance(self.model, keras.Model):
                raise TypeError(f"build_model must return a keras.Model, got "
                                f"{type(self.model).__name__}.")
            self.optimizer = self.build_optimizer()
            self.train_metrics = self.build_metrics()
            self.eval_metrics = self.build_metrics()
            self.train_loss = keras.metrics.Mean(name="train_loss")
            self.eval_loss = keras.metrics.Mean(name="eval_loss")
            self.step_counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="step",
                                            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            self.precision = precision.PrecisionState(
                config.precision.policy, config.precision.initial_loss_scale,
                config.precision.growth_interval, self.step_counter)
        self._built_optimizers: set[int] = set()
        self.step = 0
        logging.info("%s", distribute.describe(self.strategy))

    # ------------------------------------------------------------------ hooks
    def build_model(self) -> keras.Model:
        """Returns the model (cross-replica context, inside ``strategy.scope()``)."""
        raise NotImplementedError("Override build_model() to return a keras.Model.")

    def build_optimizer(self) -> keras.optimizers.Optimizer:
        """Returns the optimizer; default: from ``config.optimizer`` (in scope)."""
        return optimizers.build_optimizer(self.config)

    def build_train_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        """Returns the training data for one input pipeline.

        Must yield PER-REPLICA batches of ``ctx.get_per_replica_batch_size(
        config.train.global_batch_size)`` examples, and repeat (training runs for
        ``train.steps`` steps). Shard by ``ctx.input_pipeline_id`` yourself (e.g. by
        file) or leave it to the framework, which then shards whole batches.
        """
        raise NotImplementedError("Override build_train_dataset(ctx) to return a tf.data.Dataset.")

    def build_eval_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset | None:
        """Returns the eval data (per-replica batches, finite), or None (default)."""
        return None

    def compute_loss(self, batch, outputs) -> tf.Tensor:
        """Replica context: the PER-EXAMPLE loss, shape ``[per_replica_batch]``."""
        raise NotImplementedError(
            "Override compute_loss(batch, outputs) to return the per-example loss, shape [b].")

    def build_metrics(self) -> dict[str, keras.metrics.Metric]:
        """Returns fresh metrics by name (called twice: train and eval sets)."""
        return {}

    def update_metrics(self, metrics: dict[str, keras.metrics.Metric], batch, outputs) -> None:
        """Replica context: default ``metric.update_state(labels, outputs)`` for each."""
        _, labels = split_batch(batch)
        for metric in metrics.values():
            metric.update_state(labels, outputs)

    def train_step(self, batch) -> dict[str, tf.Tensor]:
        """Replica context: one optimisation step on this replica's batch.

        Returns scalars by name; ``"loss"`` is required. The loop reports the mean of
        ``"loss"`` over the logging window and the last step's value of other keys.
        """
        features, _ = split_batch(batch)
        with tf.GradientTape() as tape:
            outputs = precision.outputs_to_float32(self.model(features, training=True))
            per_example_loss = check_per_example_loss(self.compute_loss(batch, outputs), batch)
        loss = self.apply_gradients(tape, per_example_loss)
        self.update_metrics(self.train_metrics, batch, outputs)
        return {"loss": loss}

    def eval_step(self, batch) -> dict[str, tf.Tensor]:
        """Replica context: forward pass and metric updates on this replica's batch.

        Returns ``{"loss": per_example_loss}`` (shape ``[b]``); the loop averages it
        over every eval example of every replica.
        """
        features, _ = split_batch(batch)
        outputs = precision.outputs_to_float32(self.model(features, training=False))
        per_example_loss = check_per_example_loss(self.compute_loss(batch, outputs), batch)
        self.update_metrics(self.eval_metrics, batch, outputs)
        return {"loss": per_example_loss}

    # ---------------------------------------------------------------- helpers
    def has_eval_dataset(self) -> bool:
        """True when the subclass overrides ``build_eval_dataset``."""
        return type(self).build_eval_dataset is not Trainer.build_eval_dataset

    @property
    def eval_global_batch_size(self) -> int:
        return self.config.eval.global_batch_size or self.config.train.global_batch_size

    def build_optimizer_variables(self, optimizer: keras.optimizers.Optimizer,
                                  variables: list) -> None:
        """Creates ``optimizer``'s slots for ``variables`` in scope (once per optimizer).

        Called by the framework for ``self.optimizer`` and the model; a custom step with
        a second optimizer calls it from ``build_model`` or after construction.
        """
        if id(optimizer) in self._built_optimizers:
            return
        with self.strategy.scope():
            optimizer.build(list(variables))
        _mark_reduction_switchable(optimizer)
        self._built_optimizers.add(id(optimizer))

    def _global_count(self, per_example_loss: tf.Tensor) -> tf.Tensor:
        """Examples in this step over all replicas (all-reduced only when not static)."""
        per_replica = self.config.train.global_batch_size // self.strategy.num_replicas_in_sync
        if per_example_loss.shape[0] == per_replica:
            return tf.constant(float(self.config.train.global_batch_size))
        local = tf.cast(tf.shape(per_example_loss)[0], tf.float32)
        return tf.distribute.get_replica_context().all_reduce(_SUM, local)

    def apply_gradients(self, tape: tf.GradientTape, per_example_loss: tf.Tensor,
                        variables: list | None = None,
                        optimizer: keras.optimizers.Optimizer | None = None) -> tf.Tensor:
        """Replica context: differentiates, all-reduces, clips, checks and applies.

        Call it after the ``with tf.GradientTape() as tape:`` block that computed
        ``per_example_loss`` (shape ``[b]``). The objective is the sum of per-example
        losses divided by the GLOBAL number of examples in the step (so 1, 2 or N
        replicas give the same update), plus the model's regularisation losses once.
        Gradients (and the loss) are summed across replicas in ONE batched all-reduce;
        then loss scaling is undone, gradients are clipped by global norm
        (``optimizer.clipnorm``) and checked for finiteness — all on the reduced values,
        so every replica takes the same decision. A non-finite step is skipped on every
        replica and counted in ``skipped_steps``.

        Returns the step's global-mean loss (the same value on every replica).
        """
        optimizer = optimizer or self.optimizer
        variables = list(self.model.trainable_variables if variables is None else variables)
        if id(optimizer) not in self._built_optimizers:
            raise RuntimeError(
                f"The optimizer {optimizer.name!r} has no variables yet. Build them in scope "
                f"before training: call self.build_optimizer_variables(optimizer, variables) "
                f"from build_model() (the framework does it for self.optimizer).")
        per_example_loss = tf.cast(check_per_example_loss(per_example_loss), tf.float32)
        global_count = self._global_count(per_example_loss)
        with tape:
            loss = tf.reduce_sum(per_example_loss) / global_count
            objective = loss
            if self.model.losses:
                objective += tf.nn.scale_regularization_loss(
                    tf.cast(tf.add_n(self.model.losses), tf.float32))
            scaled = self.precision.scale_loss(objective)
        grads = tape.gradient(scaled, variables)
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            raise ValueError("No gradient flows from the loss to any of the variables; check "
                             "that compute_loss uses the model outputs.")
        ctx = tf.distribute.get_replica_context()
        reduced = ctx.all_reduce(_SUM, [grads[i] for i in present] + [loss])
        loss = reduced[-1]
        reduced = self.precision.unscale(reduced[:-1])
        if self.config.optimizer.clipnorm > 0:
            reduced, _ = tf.clip_by_global_norm(reduced, self.config.optimizer.clipnorm)
        finite = precision.all_finite(reduced)
        self._apply_if_finite(optimizer, reduced, [variables[i] for i in present], finite)
        return loss

    def _apply_if_finite(self, optimizer, grads: list, variables: list,
                         finite: tf.Tensor) -> None:
        """Replica context: applies on every replica iff ``finite`` (the same everywhere).

        Keras's ``apply`` calls ``merge_call``, which may not sit inside a ``tf.cond`` in
        replica context; so the branch is taken in cross-replica context and the apply
        re-enters replica context with ``call_for_each_replica``.
        """
        state = self.precision

        def on_nonfinite():
            state.on_nonfinite()
            return tf.constant(False)

        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            def on_finite():
                _apply_reduced(optimizer, grads, variables)
                state.on_finite()
                return tf.constant(True)

            tf.cond(finite, on_finite, on_nonfinite)
            return

        def cross_replica(strategy, grads_, finite_):
            def on_finite():
                strategy.extended.call_for_each_replica(
                    lambda g: _apply_reduced(optimizer, g, variables), args=(grads_,))
                state.on_finite()
                return tf.constant(True)

            tf.cond(strategy.experimental_local_results(finite_)[0], on_finite, on_nonfinite)

        tf.distribute.get_replica_context().merge_call(cross_replica, args=(grads, finite))

    # ---------------------------------------------------------------- driving
    def fit(self) -> dict[str, float]:
        """Trains for ``config.train.steps`` steps (evaluating on the configured cadence).

        Returns the last values: ``train/loss``, ``train/NAME``, and ``eval/loss``,
        ``eval/NAME`` when there is an eval dataset (Python floats).
        """
        from trainer import loop

        return loop.fit(self)

    def evaluate(self) -> dict[str, float]:
        """One pass over the eval dataset (or ``eval.steps``): ``{"loss", NAME...}``."""
        from trainer import loop

        return loop.evaluate(self)

    def restore(self, step: int | None = None) -> int | None:
        """Restores the latest (or the given) checkpoint in ``workdir``; returns its step.

        Sets every saved variable (model, optimizers, loss scale, step counter) and
        ``self.step``; None when ``workdir`` holds no checkpoint. Works across strategies
        and replica counts. On multi-worker runs call it on every worker. ``fit()``
        calls it itself when this Trainer has not trained yet. Raises
        ``trainer.checkpoint.CheckpointError`` naming the variable when the checkpoint
        is missing, unreadable or does not fit the model. See :mod:`trainer.checkpoint`.
        """
        from trainer import checkpoint

        return checkpoint.restore(self, step)

    def export(self, path: str) -> None:
        """Writes the model's inference function to ``path`` as a SavedModel.

        Keras ``model.export`` (``serve`` endpoint and ``serving_default`` signature),
        loadable by ``tf.saved_model.load`` without this package.
        """
        from trainer import checkpoint

        checkpoint.export(self, path)
