"""The outer driver behind ``Trainer.fit()`` / ``Trainer.evaluate()``.

*When* things happen lives here: how many steps one ``tf.function`` call runs
(``train.steps_per_loop``, an in-graph ``tf.range`` loop over the distributed
iterator), and the logging / eval cadence. Loop boundaries are cut so that every
``train.log_every_steps`` and ``eval.every_steps`` multiple, and ``train.steps``
itself, end a loop exactly: the number of steps per call is a tensor argument, so a
shorter loop does not retrace.

The in-graph loops are built in one place, :class:`CompiledLoops`. The step function
is its own ``tf.function``, traced once; the loop carries its last outputs, which start
as zeros of the traced output shapes, so the step appears once in the loop's graph.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import tensorflow as tf
from absl import logging

from trainer import data

if TYPE_CHECKING:
    from trainer.trainer import Trainer

_MEAN = tf.distribute.ReduceOp.MEAN


class NonFiniteError(FloatingPointError):
    """Raised with ``train.on_nonfinite="stop"`` when a step's gradients are NaN/inf."""


def _check_outputs(outputs, hook: str) -> None:
    if not isinstance(outputs, dict) or "loss" not in outputs:
        raise TypeError(f"{hook} must return a dict with a 'loss' entry; got {outputs!r}.")


@tf.autograph.experimental.do_not_convert
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
    return tf.autograph.experimental.do_not_convert(
        lambda: tf.nest.map_structure(lambda t: tf.zeros(t.shape, t.dtype), local))


class CompiledLoops:
    """The ``tf.function`` loops of one Trainer (cross-replica context).

    ``train(iterator, n)`` runs ``n >= 1`` steps and returns the last step's outputs,
    averaged over replicas. ``evaluate(iterator, n)`` runs ``n`` eval steps, or until
    the iterator is exhausted when ``n < 0``; results accumulate in the eval metrics.
    """

    def __init__(self, trainer: "Trainer"):
        from trainer.trainer import no_autograph, user_hook

        strategy = trainer.strategy
        train_step_fn, eval_step_fn = user_hook(trainer.train_step), user_hook(trainer.eval_step)
        if trainer.manual is not None:  # distribute.strategy="manual": see trainer.manual
            train_step_fn = trainer.manual.wrap_train(train_step_fn)
            eval_step_fn = trainer.manual.wrap_eval(eval_step_fn)

        @no_autograph
        def replica_train(batch):
            outputs = train_step_fn(batch)
            _check_outputs(outputs, "train_step")
            trainer.train_loss.update_state(outputs["loss"])
            return outputs

        @no_autograph
        def replica_eval(batch):
            outputs = eval_step_fn(batch)
            _check_outputs(outputs, "eval_step")
            trainer.eval_loss.update_state(outputs["loss"])

        @tf.function(autograph=False)
        def train_step(iterator):
            outputs = strategy.run(replica_train, args=(next(iterator),))
            trainer.step_counter.assign_add(1)
            return outputs

        @tf.function
        def train(iterator, num_steps):
            outputs = strategy.run(_zeros_like_outputs(train_step, iterator, strategy))
            for _ in tf.range(num_steps):
                outputs = train_step(iterator)
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


def _ensure_built(trainer: "Trainer", dist_dataset) -> None:
    """Builds an unbuilt model from the dataset's element spec, then the optimizer."""
    model = trainer.model
    if not model.built or not model.trainable_variables:
        from trainer.trainer import split_batch

        spec = dist_dataset.element_spec
        spec = tf.nest.map_structure(lambda s: getattr(s, "_value_specs", [s])[0], spec)
        try:
            features, _ = split_batch(spec)
        except ValueError as error:
            raise ValueError(
                "The model has no variables yet and the batch layout is custom; build it in "
                "build_model() (e.g. start with keras.Input(shape)).") from error
        dummy = tf.nest.map_structure(
            lambda s: tf.zeros([d or 1 for d in s.shape], s.dtype), features)
        with trainer.strategy.scope():
            model(dummy, training=False)
    trainer.build_optimizer_variables(trainer.optimizer, model.trainable_variables)


def _warn_nonfinite_loss(trainer: "Trainer", loss: float) -> None:
    """Logs (once per fit) that the window's train loss is NaN/inf, and what to do."""
    if trainer._checks_finite:
        what = (f"{int(trainer.precision.skipped_steps.numpy())} update(s) skipped so far "
                f"(precision/skipped_steps)")
    else:
        what = ("updates are NOT checked (train.on_nonfinite='auto' without mixed_float16), "
                "so the weights may now be NaN; set train.on_nonfinite='skip' to skip such "
                "updates or 'stop' to stop at the first")
    logging.warning("Train loss is %s in the window ending at step %d: %s. Lower "
                    "optimizer.learning_rate, set optimizer.clipnorm, or check the data and "
                    "compute_loss.", loss, trainer.step, what)


def _loops(trainer: "Trainer") -> CompiledLoops:
    if getattr(trainer, "_compiled_loops", None) is None:
        trainer._compiled_loops = CompiledLoops(trainer)
    return trainer._compiled_loops


def _metric_values(loss_metric, metrics: dict) -> dict[str, float]:
    values = {"loss": float(loss_metric.result())}
    for name, metric in metrics.items():
        values[name] = float(metric.result())
    return values


def _reset(loss_metric, metrics: dict) -> None:
    loss_metric.reset_state()
    for metric in metrics.values():
        metric.reset_state()


def evaluate(trainer: "Trainer") -> dict[str, float]:
    """One pass over the eval dataset (``eval.steps`` batches when > 0)."""
    if not trainer.has_eval_dataset():
        raise ValueError(f"{type(trainer).__name__} has no eval dataset: override "
                         f"build_eval_dataset(ctx) to evaluate.")
    if getattr(trainer, "_eval_dataset", None) is None:
        trainer._eval_dataset = data.distribute(
            trainer.strategy, trainer.build_eval_dataset, trainer.eval_global_batch_size,
            deterministic=trainer.config.train.deterministic, what="build_eval_dataset")
        _ensure_built(trainer, trainer._eval_dataset)
    _reset(trainer.eval_loss, trainer.eval_metrics)
    _loops(trainer).evaluate(iter(trainer._eval_dataset),
                             tf.constant(trainer.config.eval.steps, tf.int64))
    return _metric_values(trainer.eval_loss, trainer.eval_metrics)


def _train_iterator(trainer: "Trainer"):
    """The distributed train iterator, positioned at ``trainer.step``.

    A second ``fit()`` on the same Trainer (e.g. after raising ``train.steps``)
    continues with the iterator it left; otherwise (first call, or after a restore
    moved ``trainer.step``) the dataset is built and skips the batches already
    consumed, which is exact for deterministic pipelines and costs time linear in the
    steps skipped.
    """
    cached = getattr(trainer, "_train_iterator_at", None)
    if cached is not None and cached[0] == trainer.step:
        return cached[1]
    cfg = trainer.config
    train_dataset = data.distribute(
        trainer.strategy, trainer.build_train_dataset, cfg.train.global_batch_size,
        deterministic=cfg.train.deterministic, skip_batches=trainer.step)
    _ensure_built(trainer, train_dataset)
    return iter(train_dataset)


def next_boundary(step: int, every: int) -> float:
    """The first multiple of ``every`` after ``step`` (inf when ``every`` is 0)."""
    return (step // every + 1) * every if every > 0 else math.inf


class Component:
    """Something that acts at loop boundaries (telemetry, checkpoints, profiler).

    All methods run on the host between ``tf.function`` calls, on every worker (a
    component that writes files checks ``distribute.is_chief`` itself). Defaults do
    nothing.
    """

    def next_boundary(self, step: int) -> float:
        """The next step at which a train loop must end for this component."""
        return math.inf

    def on_fit_start(self, trainer: "Trainer") -> None:
        """Before the first train loop (after any restore)."""

    def on_train_loop_end(self, trainer: "Trainer", num_steps: int, seconds: float) -> None:
        """After each train loop of ``num_steps`` steps that took ``seconds``."""

    def on_log(self, trainer: "Trainer", values: dict[str, float]) -> None:
        """At each ``train.log_every_steps`` boundary with the window's train values."""

    def on_eval(self, trainer: "Trainer", values: dict[str, float]) -> None:
        """After each evaluation during fit()."""

    def on_fit_end(self, trainer: "Trainer", results: dict[str, float]) -> None:
        """After the last step (also when fit() raises: then ``results`` is partial)."""


def components(trainer: "Trainer") -> list[Component]:
    """The components a fit() run uses, in call order."""
    from trainer import checkpoint, profiler, telemetry

    return [telemetry.Telemetry(trainer.config), profiler.ProfilerWindows(trainer.config),
            checkpoint.Checkpointer(trainer)]


def fit(trainer: "Trainer") -> dict[str, float]:
    """Trains until ``train.steps``; see the module docstring for the cadence."""
    cfg = trainer.config
    total = cfg.train.steps
    has_eval = trainer.has_eval_dataset()
    parts = components(trainer)
    if trainer.step == 0:
        trainer.restore()  # latest checkpoint in workdir: sets trainer.step before the input
    iterator = _train_iterator(trainer)
    loops = _loops(trainer)
    results: dict[str, float] = {}
    _reset(trainer.train_loss, trainer.train_metrics)
    stop_on_nonfinite = cfg.train.on_nonfinite == "stop"
    skipped_before = int(trainer.precision.skipped_steps.numpy())
    warned_nonfinite = False
    for part in parts:
        part.on_fit_start(trainer)
    try:
        while trainer.step < total:
            next_log = next_boundary(trainer.step, cfg.train.log_every_steps)
            next_eval = next_boundary(trainer.step, cfg.eval.every_steps) if has_eval else math.inf
            num_steps = int(min([cfg.train.steps_per_loop, total - trainer.step,
                                 next_log - trainer.step, next_eval - trainer.step]
                                + [p.next_boundary(trainer.step) - trainer.step for p in parts]))
            start = time.perf_counter()
            try:
                outputs = loops.train(iterator, tf.constant(num_steps, tf.int64))
            except tf.errors.OutOfRangeError as error:
                raise ValueError(
                    f"build_train_dataset ran out of data at step {trainer.step + 1} of "
                    f"{total}; end it with .repeat() so training can run for train.steps."
                ) from error
            seconds = time.perf_counter() - start
            trainer.step += num_steps
            if stop_on_nonfinite and int(trainer.precision.skipped_steps.numpy()) > skipped_before:
                bad = int(trainer.precision.last_skipped_step.numpy())
                raise NonFiniteError(
                    f"Non-finite gradients (NaN/inf) at step {bad}; the update was not "
                    f"applied (train.on_nonfinite='stop'). Lower the learning rate, enable "
                    f"optimizer.clipnorm, or check the data and the loss for NaN.")
            for part in parts:
                part.on_train_loop_end(trainer, num_steps, seconds)
            if trainer.step in (next_log, total):
                values = {k: float(v) for k, v in outputs.items()}
                values.update(_metric_values(trainer.train_loss, trainer.train_metrics))
                if not math.isfinite(values["loss"]) and not warned_nonfinite:
                    warned_nonfinite = True
                    _warn_nonfinite_loss(trainer, values["loss"])
                results.update({f"train/{k}": v for k, v in values.items()})
                _reset(trainer.train_loss, trainer.train_metrics)
                for part in parts:
                    part.on_log(trainer, values)
            if has_eval and trainer.step in (next_eval, total):
                eval_values = evaluate(trainer)
                results.update({f"eval/{k}": v for k, v in eval_values.items()})
                for part in parts:
                    part.on_eval(trainer, eval_values)
    finally:
        trainer._train_iterator_at = (trainer.step, iterator)
        for part in parts:
            part.on_fit_end(trainer, results)
    return results
