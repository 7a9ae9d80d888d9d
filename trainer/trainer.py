"""``Trainer``: the hooks a user overrides, and the wiring of the framework's objects.

What a step is lives in the hooks (defaults: :mod:`trainer.step.default_steps`); the gradient path
in :mod:`trainer.step.gradients`; *when* things happen in the loop driver
(:mod:`trainer.loop.driver`) and the services (:mod:`trainer.service_order`: which, in
what order, and why), which see the run through a narrow context (:mod:`trainer.run_context`), not
the Trainer. Framework internals live on the objects a Trainer holds (``gradients``,
``steps``, ``driver``, ``context``, ``callbacks``, ``precision``), never as private
attributes a subclass could clobber.

Contexts:

* ``build_*`` hooks run in cross-replica context inside ``strategy.scope()``;
* ``train_step``, ``eval_step``, ``compute_loss``, ``update_metrics`` and
  ``apply_gradients`` run in REPLICA context, traced by ``tf.function`` (no numpy, no
  Python side effects that must happen every step); overrides are AutoGraph-converted
  (:func:`trainer.runtime.tracing.user_hook`);
* ``fit``, ``evaluate``, ``restore``, ``export``, ``request_stop``, ``close`` are called
  eagerly from the host.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from trainer import cli, optimizers, precision
from trainer import config as config_lib
from trainer.callbacks import Callback, CallbackList
from trainer.checkpoint import resume as checkpointing, state as checkpoint_state
from trainer.checks.hooks import Hooks
from trainer.data import split_batch
from trainer.distribution import batch_norm, collectives, strategies
from trainer.distribution.data_parallel import ManualDataParallel
from trainer.loop.context import LoopContext
from trainer.loop.driver import LoopDriver
from trainer.run_context import RunEvents
from trainer.runtime import keras_compat
from trainer.runtime.tracing import no_autograph
from trainer.service_order import build_services
from trainer.services.history import History
from trainer.step.default_steps import DefaultSteps
from trainer.step import owned_variables, random_streams, replica_state
from trainer.step.ema import ExponentialMovingAverage
from trainer.step.gradients import GradientPath
from tf_cluster.storage_schemes import absolute


class Trainer:
    """Base class of a training program; subclass it and override the hooks.

    Required hooks: ``build_model``, ``build_train_dataset``, ``compute_loss``.
    Everything else (distribution, global-batch loss averaging, mixed precision, loss
    scaling, clipping, metrics, progress, checkpoints) comes from ``config``.

    Args:
      config: the experiment config (``trainer.config.get_config()`` and overrides).
      workdir: where the run writes (checkpoints, summaries, config); None: nowhere. A
        relative path is made absolute here (as ``config.data.data_dir``).
      strategy: a ``tf.distribute.Strategy``; default: from ``config.distribute``.
      callbacks: :class:`trainer.Callback` objects run after the framework's services,
        in this order, then those of ``build_callbacks()``.

    Attributes:
      config, workdir, strategy; model, optimizer (built in ``strategy.scope()``);
      step: global steps done so far (a Python int on the host);
      batch, eval_batch: the train and eval batch sizes (:class:`trainer.data.BatchSizes`:
        ``global_size``, ``replicas``, ``per_replica``), checked at construction;
      train_metrics, eval_metrics, train_loss, eval_loss, step_counter, precision;
      gradients (the gradient path), steps (the default steps), driver (the loop),
      context (what the services see: :class:`trainer.run_context.RunContext`),
      callbacks (a :class:`trainer.callbacks.CallbackList`), ema (the weights' moving
      average, :mod:`trainer.step.ema`, or None); hooks (calls this class's hooks with the
      checks of :mod:`trainer.checks.hooks`); events (the run's restore/stop/rollback/
      preemption events, :class:`trainer.run_context.RunEvents`).

    Class attributes a subclass may set:
      manual_optimization: False (default): the train step updates through
        :meth:`apply_gradients`; a traced step that calls an optimizer's ``apply`` or
        ``apply_gradients`` itself is refused with one line (Keras would sum every
        replica's gradients: a per-replica mean loss trains N times faster on N replicas).
        True: the step owns its updates and their cross-replica scaling (Keras' sum), and
        the optimizer ``build_optimizer`` returns is used as it is (a
        ``LossScaleOptimizer`` is not taken apart, Keras' arguments are not checked:
        :func:`trainer.optimizers.adopt`).
    """

    manual_optimization: bool = False

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | None = None,
                 strategy: tf.distribute.Strategy | None = None,
                 callbacks: Sequence[Callback] = ()):
        config_lib.validate(config)
        self.config = config
        self.workdir = workdir = cli.resolve_paths(config, workdir)
        self.strategy = strategy or strategies.build_strategy(config.distribute)
        reducer = (ManualDataParallel(config, self.strategy)
                   if config.distribute.strategy == "manual" else None)
        self.batch = strategies.batch_sizes(
            "train.global_batch_size", config.train.global_batch_size, self.strategy)
        self.eval_batch = strategies.batch_sizes(
            "eval.global_batch_size", self.eval_global_batch_size, self.strategy)
        precision.set_policy(config.precision.policy)
        float16_warning = precision.float16_warning(
            config.precision.policy, strategies.slow_float16_devices(self.strategy))
        if float16_warning:
            logging.warning("%s", float16_warning)
        self.step = 0
        self.hooks = Hooks(self)  # every hook call goes through its checks
        self.events = RunEvents()  # restore, stop, rollback, preemption
        self.ema = (ExponentialMovingAverage(config.optimizer.ema_decay,
                                             every=config.optimizer.ema_every_steps)
                    if config.optimizer.ema_decay > 0 else None)  # built with the model
        with self.strategy.scope(), keras_compat.fresh_names():
            self.step_counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="step",
                                            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            random_streams.seed(config.seed, self.step_counter)  # + the step's global generator
            self.precision = precision.PrecisionState(
                config.precision.policy, config.precision.initial_loss_scale,
                config.precision.growth_interval, self.step_counter)
            # Before build_model: it may call build_optimizer_variables (a 2nd optimizer).
            self.gradients = GradientPath(
                config, self.strategy, self.batch, self.precision, self.step_counter, None,
                reducer, self.ema,
                direct_apply_owner=None if self.manual_optimization else type(self).__name__)
            with replica_state.averaged_state():  # forward-updated state: MEAN
                self.model = self.hooks.call("build_model")
            if config.distribute.sync_batch_norm:
                batch_norm.synchronize(self.model)
            unsynchronized = batch_norm.warning(self.model, self.strategy)
            if unsynchronized:
                logging.warning("%s", unsynchronized)
            keras_compat.losses_per_replica(self.model)
            self.gradients.model = self.model
            optimizer = self.hooks.call("build_optimizer")  # as it is for manual_optimization
            self.optimizer = optimizer if self.manual_optimization else optimizers.adopt(
                optimizer, f"{self.hooks.owner}.build_optimizer returned",
                config.precision.policy, self.precision)
            self.train_metrics = self.hooks.call("build_metrics")
            self.eval_metrics = self.hooks.call("build_metrics")
            self.train_loss = keras.metrics.Mean(name="train_loss")
            self.eval_loss = keras.metrics.Mean(name="eval_loss")
        self.gradients.owned = owned_variables.collect(self.hooks.owner, vars(self), self.strategy)
        logging.info("%s", optimizers.describe(config, self.optimizer))
        if self.gradients.nonfinite.warning():
            logging.warning("%s", self.gradients.nonfinite.warning())
        self.steps = DefaultSteps(
            config, self.model, self.optimizer, self.gradients,
            self.hooks.traced("compute_loss", Trainer.compute_loss),
            self.hooks.traced("update_metrics", Trainer.update_metrics),
            self.train_metrics, self.eval_metrics,
            custom_train_step=self.overrides("train_step"))
        self.driver = LoopDriver(self, self.hooks.traced("train_step", Trainer.train_step),
                                 self.hooks.traced("eval_step", Trainer.eval_step), History(),
                                 lambda: checkpoint_state.trajectory_variables(self.context))
        services, checkpointer = build_services(
            config, workdir, self.is_chief, self.has_eval_dataset(), self.driver.history,
            self.gradients.nonfinite, self.events)

        def restore_after_saves() -> int | None:  # a rollback's restore
            checkpointer.wait()  # the latest save may still be committing
            return checkpointing.restore(self.context)

        self.context = LoopContext(self, self.driver, restore_after_saves,
                                   lambda: self.callbacks.service_states())
        self.callbacks = CallbackList(services,
                                      [*callbacks, *self.hooks.call("build_callbacks")],
                                      self, self.context)

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

    def build_read_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset | None:
        """Optional: the train examples as read from storage, before preprocessing.

        Unbatched, finite or not, in any structure; e.g. the TFDS examples
        ``build_train_dataset`` starts from. Only the doctor uses it, to split the input
        time into reading and preprocessing. None (default): no split is reported.
        """
        return None

    def compute_loss(self, batch, outputs) -> tf.Tensor:
        """Replica context: the PER-EXAMPLE loss, shape ``[per_replica_batch]``."""
        raise NotImplementedError(
            "Override compute_loss(batch, outputs) to return the per-example loss, shape [b].")

    def build_metrics(self) -> dict[str, keras.metrics.Metric]:
        """Returns fresh metrics by name (called twice: train and eval sets)."""
        return {}

    def build_callbacks(self) -> list[Callback]:
        """Returns callbacks to run after the constructor's (default: none)."""
        return []

    @no_autograph
    def update_metrics(self, metrics: dict[str, keras.metrics.Metric], batch, outputs) -> None:
        """Replica context: default ``metric.update_state(labels, outputs)`` for each."""
        _, labels = split_batch(batch)
        for metric in metrics.values():
            metric.update_state(labels, outputs)

    @no_autograph
    def train_step(self, batch) -> dict[str, tf.Tensor]:
        """Replica context: one optimisation step on this replica's batch.

        Returns tensors by name, ``"loss"`` required (this replica's mean or per-example
        loss), each averaged over replicas and its elements: the loop logs the mean of
        ``"loss"`` over the logging window, the last step's value of other keys. A share
        of a global value (a loss divided by the global batch, as a
        ``manual_optimization`` step differentiates) logs 1/N of it on N replicas: return
        the per-example loss (docs/training.md). Default: forward, ``compute_loss``, the
        gradient path, ``update_metrics``.
        """
        return self.steps.train(batch)

    @no_autograph
    def eval_step(self, batch) -> dict[str, tf.Tensor]:
        """Replica context: forward pass and metric updates on this replica's batch.

        Returns ``{"loss": per_example_loss}`` (shape ``[b]``); the loop averages it
        over every eval example of every replica.
        """
        return self.steps.eval(batch)

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
        skipped on every replica and counted in ``precision.skipped_steps``. With
        ``perf.grad_accum_steps=K > 1`` each call is a micro-step (see
        :mod:`trainer.step.gradients`). Defaults: the model's trainable variables, then
        the trainable variables this Trainer holds itself (``self.log_temp =
        tf.Variable(...)`` made in ``build_model``: :mod:`trainer.step.owned_variables`),
        and ``self.optimizer``. Returns this call's global-mean loss (the same on every
        replica).
        """
        return self.gradients.apply(
            tape, per_example_loss,
            self.gradients.trainable_variables() if variables is None else list(variables),
            optimizer or self.optimizer)

    def all_gather(self, value, axis: int = 0):
        """Replica context: ``value`` (a tensor or nest) of every replica, concatenated
        along ``axis`` in the global batch's order; differentiable; ``value`` on one
        replica (:mod:`trainer.distribution.collectives`)."""
        return collectives.all_gather(value, axis, self.gradients.reducer)

    def all_reduce(self, value, op: str = "sum"):
        """Replica context: the ``"sum"`` or ``"mean"`` of ``value`` over the replicas."""
        return collectives.all_reduce(value, op, self.gradients.reducer)

    def build_optimizer_variables(self, optimizer: keras.optimizers.Optimizer,
                                  variables: list) -> None:
        """Creates ``optimizer``'s slots for ``variables`` in scope (once per optimizer).

        Called by the framework for ``self.optimizer`` and the model; a custom step with
        a second optimizer calls it from ``build_model`` or after construction.
        """
        self.gradients.build_optimizer_variables(optimizer, variables)

    # ---------------------------------------------------------------- helpers
    def overrides(self, hook: str) -> bool:
        """True when this Trainer's class overrides the hook named ``hook``."""
        return getattr(type(self), hook) is not getattr(Trainer, hook)

    def has_eval_dataset(self) -> bool:
        """True when the subclass overrides ``build_eval_dataset``."""
        return self.overrides("build_eval_dataset")

    @property
    def eval_global_batch_size(self) -> int:
        return self.config.eval.global_batch_size or self.config.train.global_batch_size

    @property
    def is_chief(self) -> bool:
        """True on the one process that writes files."""
        return strategies.is_chief(self.strategy)

    def request_stop(self, reason: str) -> None:
        """Stops training at the end of the current loop on EVERY worker (see
        :mod:`trainer.callbacks`); ``fit()`` then saves a final checkpoint and returns."""
        self.driver.request_stop(reason)

    # ---------------------------------------------------------------- driving
    def fit(self) -> dict[str, float]:
        """Trains for ``config.train.steps`` steps (or until a stop is requested).

        Resumes from the latest checkpoint in ``workdir`` when this Trainer has not
        trained yet. Returns the last values: ``train/loss``, ``train/NAME``, and
        ``eval/loss``, ``eval/NAME`` when there is an eval dataset (Python floats); the
        same keys on every call, also on a finished run that trains nothing (its last
        train values: :mod:`trainer.services.history`). Releases its summary writers and
        threads when it ends; its train iterator is kept for this Trainer's next
        ``fit()`` when it returned (the next one continues it if it starts at the step
        this one ended and only ``train.steps`` changed in the config) and released
        when it raised. SIGTERM/SIGINT with a workdir: a checkpoint at the next loop
        boundary, then ``Preempted``.
        """
        if self.step == 0:
            self.restore()  # sets self.step before the input is built
        return self.driver.fit(self.callbacks)

    def close(self) -> None:
        """Releases what this Trainer's runs built: the train iterator a ``fit()`` kept,
        the datasets, the traced loops (the summary writers, checkpoint managers and
        threads of a ``fit()`` are released at its end already; a Trainer collected
        without ``close()`` releases its iterator too, on a background thread).
        Idempotent; the Trainer stays usable (a later ``fit()`` or ``evaluate()``
        builds them again). ``with Trainer(...) as t:`` calls it on leaving the block."""
        self.driver.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def evaluate(self) -> dict[str, float]:
        """One pass over the eval dataset (or ``eval.steps``): ``{"loss", NAME...}``.

        With ``optimizer.ema_decay > 0`` the model holds the EMA weights meanwhile."""
        with self._averaged_weights():
            return self.driver.evaluate()

    def _averaged_weights(self):
        """Inside: the EMA weights when there is an EMA (built), else the weights as they are."""
        if self.ema is None:
            return contextlib.nullcontext()
        self.driver.ensure_built()
        return self.ema.swapped()

    def restore(self, step: int | None = None) -> int | None:
        """Restores the latest (or the given) checkpoint in ``workdir``; returns its step.

        Sets every saved variable (model, optimizers, loss scale, step counter) and
        ``self.step``; None when ``workdir`` holds no checkpoint. Works across strategies
        and replica counts. On multi-worker runs call it on every worker. Raises
        ``trainer.checkpoint.state.CheckpointError`` naming the variable when the
        checkpoint is missing, unreadable or does not fit the model.
        """
        restored = checkpointing.restore(self.context, step)
        if restored is not None:
            self.events.restore(restored, self.workdir)
        return restored

    def export(self, path: str) -> None:
        """Writes the model's inference function to ``path`` as a SavedModel.

        Keras ``model.export`` (``serve`` endpoint and ``serving_default`` signature),
        loadable by ``tf.saved_model.load`` without this package; the EMA weights with
        ``optimizer.ema_decay > 0``.
        """
        self.driver.ensure_built()
        with self._averaged_weights():
            self.model.export(absolute(path), format="tf_saved_model", verbose=False)


def resolve_trainer_class(path: str) -> type[Trainer]:
    """Imports ``"package.module:ClassName"`` and checks it is a Trainer subclass."""
    cls = cli.import_trainer_class(path)
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise config_lib.ConfigError(f"config.trainer={path!r} is not a subclass of "
                                     f"trainer.Trainer.")
    return cls
