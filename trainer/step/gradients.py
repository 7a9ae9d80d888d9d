"""The gradient path: per-example loss -> global-mean gradients -> loss scale ->
accumulation -> all-reduce -> clip -> finite check -> apply.

One :class:`GradientPath` per Trainer owns it (``trainer.step.gradients``);
``Trainer.apply_gradients`` and the default ``train_step`` go through it. How the
gradients of a step reach the update is a :class:`Reducer`: the default sums them
across the strategy's replicas in one batched all-reduce; manual data parallelism
(:mod:`trainer.distribution.data_parallel`) is another reducer plugged in here.

Averaging. The objective of one optimizer update is

    sum(per-example losses of the update) / C  +  regularisation,

C = examples in the update over all replicas and all K = ``perf.grad_accum_steps``
micro-steps. Each replica differentiates

    scale * (sum(local losses) + regularisation * n_local) / C_static,

C_static = global_batch_size * K, n_local = its examples in this micro-step. Summed over
replicas and micro-steps that is scale * (sum of all losses + C * reg) / C_static;
multiplying by C_static / C (C all-reduced with the gradients; with K = 1 and a batch of
static full size C = C_static is known and nothing is multiplied) gives the exact
objective for any batch sizes: a short final batch, a replica with no examples, a
partial accumulation window after a mid-window resume.

Accumulation (K > 1). Every call adds the LOCAL gradients to per-replica accumulators,
no gradient communication; every K-th global step (step_counter + 1 a multiple of K, the
same on every replica) all-reduces the sums ONCE, then unscales, clips, checks and
applies as for K = 1, and zeroes the accumulators. Only the loss and the example count
(2 scalars) are all-reduced per micro-step, for the returned global-mean loss.

Branching: :func:`trainer.step.update_context.in_update_context` is the one place that
decides where an update may branch (replica or cross-replica context); the update logic
(:meth:`GradientPath._apply_or_skip`) is written once against its operation sets.

Contexts: everything here runs in REPLICA context while a step is traced, except
:meth:`GradientPath.build_optimizer_variables` (host, cross-replica).
"""

from __future__ import annotations

from typing import Callable

import keras
import ml_collections
import tensorflow as tf

from trainer import data, optimizers, precision
from trainer.errors import HookError, InputError
from trainer.runtime import keras_compat
from trainer.runtime.tracing import no_autograph
from trainer.step import sparse_gradients
from trainer.step.ema import ExponentialMovingAverage
from trainer.step.grad_norm import GradientNormStats
from trainer.step.update_context import Accumulators, in_update_context

_SUM = tf.distribute.ReduceOp.SUM


@no_autograph
def check_per_example_loss(per_example_loss: tf.Tensor, batch=None) -> tf.Tensor:
    """Raises at trace time unless ``per_example_loss`` has shape ``[batch_size]``.

    With ``batch`` given, the static batch size must match its first tensor's.
    """
    per_example_loss = tf.convert_to_tensor(per_example_loss)
    rank = per_example_loss.shape.rank
    if rank == 0:
        raise InputError(
            "compute_loss returned a scalar; it must return the PER-EXAMPLE loss, shape "
            "[batch_size] (e.g. keras.losses.sparse_categorical_crossentropy(labels, "
            "logits, from_logits=True) without reducing). The framework averages by the "
            "GLOBAL batch so every replica count trains the same.")
    if rank != 1:
        raise InputError(
            f"compute_loss returned shape {per_example_loss.shape}; it must return the "
            f"per-example loss, shape [batch_size]. Reduce the other axes yourself "
            f"(e.g. tf.reduce_mean(loss, axis=-1) over timesteps).")
    if batch is None:
        return per_example_loss
    expected = tf.nest.flatten(batch)[0].shape[:1]
    if not per_example_loss.shape[:1].is_compatible_with(expected):
        raise InputError(
            f"compute_loss returned {per_example_loss.shape[0]} losses for a batch of "
            f"{expected[0]} examples; return one loss per example.")
    return per_example_loss


class Reducer:
    """How the gradients of a step reach the update. This default: the strategy's replicas
    each compute their own batch and :class:`GradientPath` all-reduces their gradients.

    A reducer may wrap the step functions the loop traces (``wrap_train``,
    ``wrap_eval``) and take over an ``apply_gradients`` call (``intercept`` returns the
    loss to return instead of updating; None lets the normal path run).
    """

    supports_jit = True  # the default train_step may XLA-compile forward + backward
    supports_collectives = True  # a step's all_gather / all_reduce see every replica

    def attach(self, path: "GradientPath") -> None:
        """Called once by the GradientPath this reducer is plugged into."""

    def wrap_train(self, step_fn: Callable) -> Callable:
        return step_fn

    def wrap_eval(self, step_fn: Callable) -> Callable:
        return step_fn

    def intercept(self, optimizer, variables: list, grads: list,
                  per_example_loss: tf.Tensor) -> tf.Tensor | None:
        return None


def _cast_all(grads: list, dtypes: list) -> list:
    """Casts float32 accumulated gradients back to their variables' dtypes."""
    return [tf.cast(g, d) for g, d in zip(grads, dtypes)]


class GradientPath:
    """Owns the gradient path of one Trainer (see the module docstring).

    Args:
      config: the run's config (``train``, ``optimizer.clipnorm``, ``perf`` are read).
      strategy: the run's strategy.
      batch: the train batch (:class:`trainer.data.BatchSizes`).
      precision_state: loss scale and non-finite accounting (``trainer.precision``).
      step_counter: the global step variable (decides accumulation windows).
      model: the model whose ``losses`` (regularisation) join the objective and whose
        trainable variables are the default ``variables``.
      reducer: how gradients reach the update (default: :class:`Reducer`).
      ema: the weights' moving average, updated after every applied update (or None).
      direct_apply_owner: the Trainer class named when a traced train step applies
        through one of this path's optimizers itself (``optimizer.apply`` or
        ``apply_gradients``): the step is refused at trace time with a :class:`HookError`.
        None (the Trainer declares ``manual_optimization``): allowed, with Keras' own
        cross-replica sum.

    Create it in ``strategy.scope()`` (it holds :class:`GradientNormStats`).
    """

    def __init__(self, config: ml_collections.ConfigDict, strategy: tf.distribute.Strategy,
                 batch: data.BatchSizes, precision_state: precision.PrecisionState,
                 step_counter: tf.Variable, model: keras.Model, reducer: Reducer | None = None,
                 ema: ExponentialMovingAverage | None = None,
                 direct_apply_owner: str | None = None):
        self.config = config
        self.direct_apply_owner = direct_apply_owner
        self.strategy = strategy
        self.batch = batch
        self.precision = precision_state
        self.step_counter = step_counter
        self.model = model
        #: ``[(attribute path, variable)]``: the Trainer's own trainable variables
        #: (:mod:`trainer.step.owned_variables`), trained with the model's.
        self.owned: list = []
        # Bytes per all-reduce pack of the NEXT trace (the execution plan's choice).
        self.pack_bytes = int(config.distribute.grad_pack_bytes)
        self.plug(reducer or Reducer())
        # train.on_nonfinite="auto" checks only where dynamic loss scaling needs it: the
        # check gates every update on a reduction over all gradients (a tf.cond), which
        # costs an overhead-bound step several percent (benchmarks/README.md).
        self.nonfinite = precision.NonFinitePolicy(config.train.on_nonfinite,
                                                   precision_state.dynamic)
        self.checks_finite = self.nonfinite.checks_updates
        self.ema = ema
        # At least one sampled update per logging window (windows hold whole updates).
        updates_per_window = config.train.log_every_steps // config.perf.grad_accum_steps
        self.norms = GradientNormStats(
            max(1, min(config.telemetry.grad_norm_every, updates_per_window)))
        self._built: set[int] = set()
        self._accumulators: dict[int, Accumulators] = {}

    # ------------------------------------------------------------------- host
    def plug(self, reducer: Reducer) -> None:
        """Host: makes ``reducer`` this path's reducer (before the first step is traced)."""
        self.reducer = reducer
        reducer.attach(self)

    def build_optimizer_variables(self, optimizer: keras.optimizers.Optimizer,
                                  variables: list) -> None:
        """Host: creates ``optimizer``'s slots for ``variables`` in scope (once per
        optimizer), and its gradient accumulators with ``perf.grad_accum_steps > 1``.
        Raises :class:`HookError` for a Keras argument the path cannot honour
        (:func:`trainer.optimizers.check_arguments`) unless the Trainer declares
        ``manual_optimization``."""
        if id(optimizer) in self._built:
            return
        if self.direct_apply_owner is not None:  # (with manual_optimization: Keras' way)
            optimizers.check_arguments(
                optimizer, f"{self.direct_apply_owner}.build_optimizer_variables was given")
        with self.strategy.scope():
            optimizer.build(list(variables))
            if self.config.perf.grad_accum_steps > 1:
                self._accumulators[id(optimizer)] = Accumulators(list(variables))
        keras_compat.make_reduction_switchable(optimizer, self._direct_apply)
        self._built.add(id(optimizer))

    def _direct_apply(self, optimizer: keras.optimizers.Optimizer) -> None:
        """Trace time, replica context: a step applied through ``optimizer`` itself."""
        owner = self.direct_apply_owner
        if owner is None:
            return
        raise HookError(
            f"{owner}.train_step calls {type(optimizer).__name__}.apply (or apply_gradients) "
            f"itself: Keras then sums every replica's gradients, so a loss averaged per "
            f"replica trains differently on N replicas than on one, and loss scaling, "
            f"clipping and accumulation are skipped. Compute the per-example loss inside the "
            f"tape and call self.apply_gradients(tape, per_example_loss) (variables=, "
            f"optimizer= for another optimizer), or set manual_optimization = True on "
            f"{owner} to own the cross-replica scaling yourself.")

    def reset_accumulators(self) -> None:
        """Host: drops partial accumulation sums (after a rollback restored a checkpoint)."""
        for accumulators in self._accumulators.values():
            for slot in accumulators.grads:
                slot.assign(tf.zeros_like(slot))
            accumulators.count.assign(0.0)

    def trainable_variables(self) -> list:
        """The variables an update trains by default: the model's trainable variables,
        then the Trainer's own (:attr:`owned`)."""
        return [*self.model.trainable_variables, *(v for _, v in self.owned)]

    # ---------------------------------------------------------------- replica
    @property
    def static_count(self) -> int:
        """C_static: examples per optimizer update when every batch is full."""
        return self.batch.global_size * self.config.perf.grad_accum_steps

    @no_autograph
    def objective(self, per_example_loss: tf.Tensor) -> tf.Tensor:
        """Replica context, inside the tape: the scalar to differentiate (module doc)."""
        per_example_loss = tf.cast(per_example_loss, tf.float32)
        objective = tf.reduce_sum(per_example_loss)
        if self.model.losses:
            n_local = tf.cast(tf.shape(per_example_loss)[0], tf.float32)
            objective += tf.cast(tf.add_n(self.model.losses), tf.float32) * n_local
        return self.precision.scale_loss(objective / float(self.static_count))

    @no_autograph
    def apply(self, tape: tf.GradientTape, per_example_loss: tf.Tensor, variables: list,
              optimizer: keras.optimizers.Optimizer) -> tf.Tensor:
        """Replica context: differentiates the objective recorded on ``tape`` and updates.

        Returns this call's global-mean loss (the same value on every replica).
        """
        per_example_loss = check_per_example_loss(per_example_loss)
        with tape:
            objective = self.objective(per_example_loss)
        grads = tape.gradient(objective, variables)
        return self.apply_grads(optimizer, variables, grads, per_example_loss)

    @no_autograph
    def apply_grads(self, optimizer, variables: list, grads: list,
                    per_example_loss: tf.Tensor) -> tf.Tensor:
        """Replica context: gradients of :meth:`objective` (this replica's) -> update.

        Returns the global-mean loss of the step (or micro-step).
        """
        intercepted = self.reducer.intercept(optimizer, variables, grads, per_example_loss)
        if intercepted is not None:
            return intercepted
        if id(optimizer) not in self._built:
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
        reduce = (self.config.perf.sparse_reduce, self.strategy, self.pack_bytes,
                  self.config.distribute.grad_compression)
        if per_example_loss.shape[0] == self.batch.per_replica:  # statically full: C = C_static
            reduced, (loss_sum,) = sparse_gradients.all_reduce_sum(
                grads, variables, [loss_sum], *reduce)
            self._update(optimizer, variables, reduced, None)
            return loss_sum / float(self.static_count)
        reduced, (loss_sum, count) = sparse_gradients.all_reduce_sum(
            grads, variables, [loss_sum, n_local], *reduce)
        self._update(optimizer, variables, reduced, count)
        return loss_sum / count

    @no_autograph
    def _finalize(self, grads: list, count: tf.Tensor | None,
                  iterations) -> tuple[list, tf.Tensor]:
        """All-reduced scaled gradients -> (final gradients, all-finite flag).

        Corrects the averaging (``count`` examples instead of C_static; None: full),
        undoes loss scaling, clips by global norm and records the norm for the logs
        (``iterations``: the optimizer's update count). The flag is a constant True when
        this run does not check finiteness (``train.on_nonfinite``). Replica context.
        """
        if count is not None:
            factor = float(self.static_count) / count
            grads = [precision.map_values(g, lambda v: v * tf.cast(factor, v.dtype))
                     for g in grads]
        grads = self.precision.unscale(grads)
        norm = None
        if self.config.optimizer.clipnorm > 0:
            grads, norm = tf.clip_by_global_norm(grads, self.config.optimizer.clipnorm)
        if self.config.telemetry.grad_norm:
            if norm is None:
                self.norms.maybe_record(grads, iterations)
            else:
                self.norms.record(norm)
        return grads, (precision.all_finite(grads) if self.checks_finite
                       else tf.constant(True))

    @no_autograph
    def _update(self, optimizer, variables: list, reduced: list,
                count: tf.Tensor | None) -> None:
        """Replica context: finalizes all-reduced gradients and applies them (iff finite
        when this run checks finiteness)."""
        grads, finite = self._finalize(reduced, count, optimizer.iterations)
        if not self.checks_finite:  # no tf.cond: the update need not wait for a check
            keras_compat.apply_reduced(optimizer, grads, variables)
            self._after_apply(optimizer, variables)
            return
        in_update_context(
            lambda ops, values: self._apply_or_skip(ops, optimizer, variables, *values),
            (grads, finite))

    @no_autograph
    def _after_apply(self, optimizer, variables: list) -> None:
        """Where an update was applied (replica or cross-replica context): the EMA."""
        if self.ema is not None:
            self.ema.update(variables, optimizer.iterations)

    @no_autograph
    def _apply_or_skip(self, ops, optimizer, variables: list, grads: list,
                       finite: tf.Tensor) -> None:
        """Applies on every replica iff ``finite`` (the same everywhere), else counts a
        skipped step; the loss scale follows either way."""
        state = self.precision

        def on_finite():
            ops.apply(optimizer, grads, variables)
            self._after_apply(optimizer, variables)
            state.on_finite()
            return tf.constant(True)

        def on_nonfinite():
            state.on_nonfinite()
            return tf.constant(False)

        tf.cond(ops.first(finite), on_finite, on_nonfinite)

    @no_autograph
    def _accumulate(self, optimizer, variables: list, grads: list, n_local: tf.Tensor) -> None:
        """Replica context: adds local gradients; every K-th step reduces and applies.

        The decision ``(step_counter + 1) % K == 0`` reads a mirrored variable, so it is
        the same on every replica.
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

        def body(ops, local_values):
            def apply_window():
                reduced = ops.all_reduce(local_values)
                grads_, finite = ops.each(
                    lambda r: self._finalize(_cast_all(r[:-1], dtypes), r[-1],
                                             optimizer.iterations), reduced)
                if self.checks_finite:
                    self._apply_or_skip(ops, optimizer, variables, grads_, finite)
                else:
                    ops.apply(optimizer, grads_, variables)
                    self._after_apply(optimizer, variables)
                ops.each(zero)
                return tf.constant(True)

            tf.cond(tf.equal((self.step_counter + 1) % k, 0), apply_window,
                    lambda: tf.constant(False))

        in_update_context(
            body, [s.read_value() for s in slots] + [accumulators.count.read_value()])
