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

AutoGraph: framework code that runs while a step is traced is marked
``no_autograph`` (it uses ``tf.cond`` where it branches on tensors), so a run does
not pay AutoGraph's conversion of every framework function at its first step. A
hook the user overrides (``train_step``, ``eval_step``, ``compute_loss``,
``update_metrics``) is still converted (:func:`user_hook`): Python ``if``/``for`` on
tensors works there as in any ``tf.function``.
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

no_autograph = tf.autograph.experimental.do_not_convert


def user_hook(method):
    """``method`` (a bound Trainer hook) ready to call while a step is traced.

    A user's override is AutoGraph-converted (once per function; cached by AutoGraph);
    the framework's own default is returned as is (it is ``no_autograph``).
    """
    func = getattr(method, "__func__", None)
    if func is None or func is getattr(Trainer, func.__name__, None):
        return method
    converted = tf.autograph.to_graph(func)
    return lambda *args, **kwargs: converted(method.__self__, *args, **kwargs)


@no_autograph
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


@no_autograph
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


@no_autograph
def _apply_reduced(optimizer: keras.optimizers.Optimizer, grads: list, variables: list) -> None:
    """Replica context: ``optimizer.apply`` of gradients that are already all-reduced."""
    _PRE_REDUCED.active = True
    try:
        optimizer.apply(grads, variables)
    finally:
        _PRE_REDUCED.active = False


@no_autograph
def _cast_all(grads: list, dtypes: list) -> list:
    """Casts float32 accumulated gradients back to their variables' dtypes."""
    return [tf.cast(g, d) for g, d in zip(grads, dtypes)]


class _Accumulators:
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
        self.manual = None  # distribute.strategy="manual": splits batches over devices
        if config.distribute.strategy == "manual":
            from trainer.manual import ManualDataParallel

            self.manual = ManualDataParallel(self)
        replicas = self.strategy.num_replicas_in_sync
        config_lib.check_batch_divisible(
            "train.global_batch_size", config.train.global_batch_size, replicas)
        config_lib.check_batch_divisible(
            "eval.global_batch_size", self.eval_global_batch_size, replicas)
        keras.utils.set_random_seed(config.seed)
        precision.set_policy(config.precision.policy)
        # Before build_model: it may call build_optimizer_variables for a second optimizer.
        self._built_optimizers: set[int] = set()
        self._accumulators: dict[int, _Accumulators] = {}
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
        self.step = 0
        logging.info("%s", optimizers.describe(config, self.optimizer))
        # train.on_nonfinite="auto" checks only where dynamic loss scaling needs it: the
        # check gates every update on a reduction over all gradients (a tf.cond), which
        # costs an overhead-bound step ~5-10% (benchmarks/README.md).
        self._checks_finite = (config.train.on_nonfinite != "auto"
                               or precision.uses_loss_scaling(config.precision.policy))
        if precision.uses_loss_scaling(config.precision.policy) and (
                config.train.on_nonfinite == "stop"):
            logging.warning(
                "train.on_nonfinite='stop' with mixed_float16 also stops at a loss-scale "
                "overflow, which dynamic loss scaling normally skips; use 'skip'.")
        self._jit_grads = self._build_jit_grads()

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

    @no_autograph
    def update_metrics(self, metrics: dict[str, keras.metrics.Metric], batch, outputs) -> None:
        """Replica context: default ``metric.update_state(labels, outputs)`` for each."""
        _, labels = split_batch(batch)
        for metric in metrics.values():
            metric.update_state(labels, outputs)

    @no_autograph
    def train_step(self, batch) -> dict[str, tf.Tensor]:
        """Replica context: one optimisation step on this replica's batch.

        Returns scalars by name; ``"loss"`` is required. The loop reports the mean of
        ``"loss"`` over the logging window and the last step's value of other keys.
        """
        if self._jit_grads is not None:
            grads, per_example_loss, outputs = self._jit_grads(batch)
            variables = list(self.model.trainable_variables)
            loss = self._reduce_and_apply(self.optimizer, variables, grads, per_example_loss)
        else:
            with tf.GradientTape() as tape:
                outputs, per_example_loss = self._forward_loss(batch)
            loss = self.apply_gradients(tape, per_example_loss)
        user_hook(self.update_metrics)(self.train_metrics, batch, outputs)
        return {"loss": loss}

    @no_autograph
    def eval_step(self, batch) -> dict[str, tf.Tensor]:
        """Replica context: forward pass and metric updates on this replica's batch.

        Returns ``{"loss": per_example_loss}`` (shape ``[b]``); the loop averages it
        over every eval example of every replica.
        """
        outputs, per_example_loss = self._forward_loss(batch, training=False)
        user_hook(self.update_metrics)(self.eval_metrics, batch, outputs)
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
        a second optimizer calls it from ``build_model`` or after construction. With
        ``perf.grad_accum_steps > 1`` it also creates that optimizer's gradient
        accumulators (one float32 sum per variable, plus the example count).
        """
        if id(optimizer) in self._built_optimizers:
            return
        with self.strategy.scope():
            optimizer.build(list(variables))
            if self.config.perf.grad_accum_steps > 1:
                self._accumulators[id(optimizer)] = _Accumulators(list(variables))
        _mark_reduction_switchable(optimizer)
        self._built_optimizers.add(id(optimizer))

    # ------------------------------------------------------- the gradient path
    #
    # Averaging. The objective of one optimizer update is
    #     sum(per-example losses of the update) / C  +  regularisation,
    # C = examples in the update over all replicas and all K = grad_accum_steps
    # micro-steps. Each replica differentiates
    #     scale * (sum(local losses) + regularisation * n_local) / C_static,
    # C_static = global_batch_size * K, n_local = its examples in this micro-step. Summed
    # over replicas and micro-steps that is scale * (sum of all losses + C * reg) /
    # C_static; multiplying by C_static / C (C all-reduced with the gradients; with K = 1
    # and a batch of static full size C = C_static is known and nothing is multiplied)
    # gives the exact objective for any batch sizes: a short final batch, a replica with
    # no examples, a partial accumulation window after a mid-window resume.
    #
    # Accumulation (K > 1). Every call adds the LOCAL gradients to per-replica
    # accumulators, no gradient communication; every K-th global step (step_counter + 1
    # a multiple of K, the same on every replica) all-reduces the sums ONCE, then
    # unscales, clips, checks and applies as for K = 1, and zeroes the accumulators.
    # Only the loss and the example count (2 scalars) are all-reduced per micro-step,
    # for the returned global-mean loss.

    @no_autograph
    def _forward(self, features, training: bool):
        """Replica context: the model call, through ``tf.recompute_grad`` when
        ``perf.recompute`` and training (activations are recomputed in the backward pass
        instead of kept; inputs and outputs are flattened for it)."""
        if not (training and self.config.perf.recompute):
            return self.model(features, training=training)
        outputs_structure = []

        def call(*flat_inputs):
            outputs = self.model(tf.nest.pack_sequence_as(features, list(flat_inputs)),
                                 training=True)
            outputs_structure.append(outputs)
            return tf.nest.flatten(outputs)

        flat = tf.recompute_grad(call)(*tf.nest.flatten(features))
        return tf.nest.pack_sequence_as(outputs_structure[0], flat)

    @no_autograph
    def _forward_loss(self, batch, training: bool = True) -> tuple[Any, tf.Tensor]:
        """Replica context: ``(float32 outputs, per-example loss [b])`` of the default steps."""
        features, _ = split_batch(batch)
        outputs = precision.outputs_to_float32(self._forward(features, training))
        loss = user_hook(self.compute_loss)(batch, outputs)
        return outputs, check_per_example_loss(loss, batch)

    def _build_jit_grads(self):
        """The XLA-compiled forward+backward of the default ``train_step``, or None.

        Compiles ``batch -> (gradients, per-example loss, outputs)`` with
        ``jit_compile=True`` (the iterator and the optimizer update stay outside).
        Multi-replica strategies fall back to the plain graph with one log line: a
        whole step with 2+ Mirrored replicas does not compile (cross-device resource
        access), and per-replica XLA is only verified here on virtual CPU devices.
        """
        if not self.config.perf.jit_compile:
            return None
        replicas = self.strategy.num_replicas_in_sync
        if isinstance(self.strategy, tf.distribute.TPUStrategy):
            logging.info("perf.jit_compile: not needed on TPU (every step is XLA-compiled).")
            return None
        if replicas > 1:
            logging.warning(
                "perf.jit_compile=True is not applied under %s with %d replicas (XLA is "
                "used with one replica per process only); training without XLA.",
                type(self.strategy).__name__, replicas)
            return None
        logging.info("perf.jit_compile: forward and backward pass compiled with XLA.")

        def forward_backward(batch):
            variables = list(self.model.trainable_variables)
            with tf.GradientTape() as tape:
                outputs, per_example_loss = self._forward_loss(batch)
                objective = self._scaled_objective(per_example_loss)
            return tape.gradient(objective, variables), per_example_loss, outputs

        return tf.function(forward_backward, jit_compile=True, autograph=False)

    @no_autograph
    def _static_count(self) -> int:
        """C_static: examples per optimizer update when every batch is full."""
        return self.config.train.global_batch_size * self.config.perf.grad_accum_steps

    @no_autograph
    def _is_full_batch(self, per_example_loss: tf.Tensor) -> bool:
        """True when the batch statically has the per-replica batch size."""
        per_replica = self.config.train.global_batch_size // self.strategy.num_replicas_in_sync
        return per_example_loss.shape[0] == per_replica

    @no_autograph
    def _scaled_objective(self, per_example_loss: tf.Tensor) -> tf.Tensor:
        """Replica context, inside the tape: the scalar to differentiate (see above)."""
        per_example_loss = tf.cast(per_example_loss, tf.float32)
        objective = tf.reduce_sum(per_example_loss)
        if self.model.losses:
            n_local = tf.cast(tf.shape(per_example_loss)[0], tf.float32)
            objective += tf.cast(tf.add_n(self.model.losses), tf.float32) * n_local
        return self.precision.scale_loss(objective / float(self._static_count()))

    @no_autograph
    def apply_gradients(self, tape: tf.GradientTape, per_example_loss: tf.Tensor,
                        variables: list | None = None,
                        optimizer: keras.optimizers.Optimizer | None = None) -> tf.Tensor:
        """Replica context: differentiates, all-reduces, clips, checks and applies.

        Call it after the ``with tf.GradientTape() as tape:`` block that computed
        ``per_example_loss`` (shape ``[b]``). The objective is the sum of per-example
        losses divided by the GLOBAL number of examples in the update (so 1, 2 or N
        replicas give the same update, also for a short final batch), plus the model's
        regularisation losses once. Gradients (and the loss) are summed across replicas
        in ONE batched all-reduce; then loss scaling is undone, gradients are clipped by
        global norm (``optimizer.clipnorm``) and, when ``train.on_nonfinite`` asks for it
        (always under ``mixed_float16``), checked for finiteness — all on the reduced
        values, so every replica takes the same decision. A non-finite update is then
        skipped on every replica and counted in ``skipped_steps``.

        With ``perf.grad_accum_steps=K > 1`` each call is a micro-step: gradients are
        accumulated locally and the update (one all-reduce, clip, check, apply) happens
        on every K-th global step, averaged over all K micro-batches.

        Returns this call's global-mean loss (the same value on every replica).
        """
        optimizer = optimizer or self.optimizer
        variables = list(self.model.trainable_variables if variables is None else variables)
        per_example_loss = check_per_example_loss(per_example_loss)
        with tape:
            objective = self._scaled_objective(per_example_loss)
        grads = tape.gradient(objective, variables)
        return self._reduce_and_apply(optimizer, variables, grads, per_example_loss)

    @no_autograph
    def _reduce_and_apply(self, optimizer, variables: list, grads: list,
                          per_example_loss: tf.Tensor) -> tf.Tensor:
        """Replica context: ``apply_gradients`` after ``tape.gradient``."""
        if self.manual is not None and self.manual.deferring:  # one device's slice
            return self.manual.defer(optimizer, variables, grads, per_example_loss)
        if id(optimizer) not in self._built_optimizers:
            raise RuntimeError(
                f"The optimizer {optimizer.name!r} has no variables yet. Build them in scope "
                f"before training: call self.build_optimizer_variables(optimizer, variables) "
                f"from build_model() (the framework does it for self.optimizer).")
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            raise ValueError("No gradient flows from the loss to any of the variables; check "
                             "that compute_loss uses the model outputs.")
        grads = [grads[i] for i in present]
        variables = [variables[i] for i in present]
        per_example_loss = tf.cast(per_example_loss, tf.float32)
        loss_sum = tf.reduce_sum(per_example_loss)
        n_local = tf.cast(tf.shape(per_example_loss)[0], tf.float32)
        ctx = tf.distribute.get_replica_context()
        if self.config.perf.grad_accum_steps > 1:
            loss_sum, count = ctx.all_reduce(_SUM, [loss_sum, n_local])
            self._accumulate(optimizer, variables, grads, n_local)
            return loss_sum / count
        if self._is_full_batch(per_example_loss):
            reduced = ctx.all_reduce(_SUM, grads + [loss_sum])
            self._finish(optimizer, variables, reduced[:-1], None)
            return reduced[-1] / float(self._static_count())
        reduced = ctx.all_reduce(_SUM, grads + [loss_sum, n_local])
        self._finish(optimizer, variables, reduced[:-2], reduced[-1])
        return reduced[-2] / reduced[-1]

    @no_autograph
    def _finalize(self, grads: list, count: tf.Tensor | None) -> tuple[list, tf.Tensor]:
        """All-reduced scaled gradients -> (final gradients, all-finite flag).

        Corrects the averaging (``count`` examples instead of C_static; None: full),
        undoes loss scaling and clips by global norm. The flag is a constant True when
        this run does not check finiteness (see ``train.on_nonfinite``). Pure
        computation, any context.
        """
        if count is not None:
            factor = float(self._static_count()) / count
            grads = [precision.map_values(g, lambda v: v * tf.cast(factor, v.dtype))
                     for g in grads]
        grads = self.precision.unscale(grads)
        if self.config.optimizer.clipnorm > 0:
            grads, _ = tf.clip_by_global_norm(grads, self.config.optimizer.clipnorm)
        return grads, (precision.all_finite(grads) if self._checks_finite
                       else tf.constant(True))

    @no_autograph
    def _finish(self, optimizer, variables: list, grads: list,
                count: tf.Tensor | None) -> None:
        """Replica context: finalizes all-reduced gradients and applies them (iff finite
        when this run checks finiteness)."""
        grads, finite = self._finalize(grads, count)
        if not self._checks_finite:  # no tf.cond: the update need not wait for a check
            _apply_reduced(optimizer, grads, variables)
            return
        self._apply_if_finite(optimizer, grads, variables, finite)

    @no_autograph
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

    @no_autograph
    def _accumulate(self, optimizer, variables: list, grads: list, n_local: tf.Tensor) -> None:
        """Replica context: adds local gradients; every K-th step reduces and applies.

        The decision ``(step_counter + 1) % K == 0`` reads a mirrored variable, so it is
        the same on every replica. Strategies that need ``merge_call`` (Mirrored,
        OneDevice) take it in cross-replica context, where the reduction
        (``batch_reduce_to``) and the apply (``call_for_each_replica``) may sit inside
        ``tf.cond``; the others (default, MultiWorker, TPU) take it in replica context
        with ``all_reduce``, which needs no ``merge_call``.
        """
        accumulators = self._accumulators[id(optimizer)]
        slots = accumulators.slots(variables)
        for slot, grad in zip(slots, grads):
            slot.assign_add(tf.cast(tf.convert_to_tensor(grad), tf.float32))
        accumulators.count.assign_add(n_local)
        k = self.config.perf.grad_accum_steps
        dtypes = [v.dtype for v in variables]

        def zero():
            for slot in slots:
                slot.assign(tf.zeros_like(slot))
            accumulators.count.assign(0.0)

        def is_apply_step():
            return tf.equal((self.step_counter + 1) % k, 0)

        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            def apply_in_replica():
                ctx = tf.distribute.get_replica_context()
                reduced = ctx.all_reduce(_SUM, [s.read_value() for s in slots]
                                         + [accumulators.count.read_value()])
                self._finish(optimizer, variables, _cast_all(reduced[:-1], dtypes),
                             reduced[-1])
                zero()
                return tf.constant(True)

            tf.cond(is_apply_step(), apply_in_replica, lambda: tf.constant(False))
            return

        def cross_replica(strategy, local_values):
            def apply():
                reduced = strategy.extended.batch_reduce_to(
                    _SUM, [(v, v) for v in local_values])
                grads_, finite_ = strategy.extended.call_for_each_replica(
                    lambda r: self._finalize(_cast_all(r[:-1], dtypes), r[-1]),
                    args=(reduced,))
                state = self.precision

                def on_finite():
                    strategy.extended.call_for_each_replica(
                        lambda g: _apply_reduced(optimizer, g, variables), args=(grads_,))
                    state.on_finite()
                    return tf.constant(True)

                def on_nonfinite():
                    state.on_nonfinite()
                    return tf.constant(False)

                tf.cond(strategy.experimental_local_results(finite_)[0], on_finite,
                        on_nonfinite)
                strategy.extended.call_for_each_replica(zero)
                return tf.constant(True)

            tf.cond(is_apply_step(), apply, lambda: tf.constant(False))

        local_values = [s.read_value() for s in slots] + [accumulators.count.read_value()]
        tf.distribute.get_replica_context().merge_call(cross_replica, args=(local_values,))

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
