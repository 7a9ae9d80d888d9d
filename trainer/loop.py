"""The loop driver behind ``Trainer.fit()`` / ``Trainer.evaluate()``.

*When* things happen lives here: how many steps one ``tf.function`` call runs
(``train.steps_per_loop``, an in-graph ``tf.range`` loop over the distributed
iterator), the logging cadence, and the loop boundaries the callbacks ask for
(``Callback.next_boundary``: eval, checkpoints, profiler windows). Every logging
boundary and ``train.steps`` itself end a loop exactly: the number of steps per call
is a tensor argument, so a shorter loop does not retrace.

The in-graph loops are built in one place, :class:`CompiledLoops`. The step function
is its own ``tf.function``, traced once; the loop carries its last outputs, which start
as zeros of the traced output shapes, so the step appears once in the loop's graph.

Stopping. ``request_stop`` (any callback, any worker) and a preemption notice set a
local flag; after the callbacks of every loop boundary the workers agree on the flags
(one small all-reduce per loop on multi-worker runs, nothing on one worker), so every
worker stops at the same step. Inside a gradient-accumulation window the stop waits for
the window's last step. Then ``on_train_end`` runs (the final checkpoint), and
``fit()`` returns, or raises :class:`trainer.preemption.Preempted` after a preemption.

Contexts: the driver runs on the host in cross-replica context; the compiled loops call
the steps in replica context.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import numpy as np
import tensorflow as tf
from absl import logging

from trainer import data, host_collectives
from trainer.callbacks import Callback, CallbackList
from trainer.preemption import Preempted
from trainer.tracing import no_autograph

_MEAN = tf.distribute.ReduceOp.MEAN


def next_boundary(step: int, every: int) -> float:
    """The first multiple of ``every`` after ``step`` (inf when ``every`` is 0)."""
    return (step // every + 1) * every if every > 0 else math.inf


def _replica_spec(spec):
    """One replica's spec of a distributed dataset/iterator ``element_spec``
    (``PerReplicaSpec`` on several local replicas holds one spec per replica)."""
    return tf.nest.map_structure(lambda s: getattr(s, "_value_specs", [s])[0], spec)


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
      train_loss, eval_loss: ``keras.metrics.Mean`` of the steps' ``"loss"``.
    """

    def __init__(self, strategy: tf.distribute.Strategy, train_step: Callable,
                 eval_step: Callable, step_counter: tf.Variable, train_loss, eval_loss):
        @no_autograph
        def replica_train(batch):
            outputs = train_step(batch)
            _check_outputs(outputs, "train_step")
            train_loss.update_state(outputs["loss"])
            return outputs

        @no_autograph
        def replica_eval(batch):
            outputs = eval_step(batch)
            _check_outputs(outputs, "eval_step")
            eval_loss.update_state(outputs["loss"])

        @tf.function(autograph=False)
        def one_step(iterator):
            outputs = strategy.run(replica_train, args=(next(iterator),))
            step_counter.assign_add(1)
            return outputs

        @tf.function
        def train(iterator, num_steps):
            outputs = strategy.run(_zeros_like_outputs(one_step, iterator, strategy))
            for _ in tf.range(num_steps):
                outputs = one_step(iterator)
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


def metric_values(loss_metric, metrics: dict) -> dict[str, float]:
    """``{"loss": ..., NAME: ...}`` as Python floats (reduced over replicas and workers:
    Keras metric variables are ON_READ/SUM, read in cross-replica context)."""
    values = {"loss": float(loss_metric.result())}
    for name, metric in metrics.items():
        values[name] = float(metric.result())
    return values


def reset_metrics(loss_metric, metrics: dict) -> None:
    loss_metric.reset_state()
    for metric in metrics.values():
        metric.reset_state()


class History(Callback):
    """What ``fit()`` returns: the latest ``train/*`` and ``eval/*`` values."""

    def __init__(self):
        self.results: dict[str, float] = {}

    def on_log(self, trainer, logs: dict[str, float]) -> None:
        self.results.update({k: v for k, v in logs.items() if k.startswith("train/")})

    def on_eval_end(self, trainer, logs: dict[str, float]) -> None:
        self.results.update({k: v for k, v in logs.items() if k.startswith("eval/")})


class LoopDriver:
    """Runs ``fit()`` and ``evaluate()`` for one Trainer (``trainer.driver``).

    Holds what lives across ``fit()`` calls: the compiled loops, the distributed eval
    dataset, and the train iterator with the step it is positioned at (a second
    ``fit()`` after raising ``train.steps`` continues with it).

    Args:
      trainer: the Trainer (its public attributes: config, strategy, model, optimizer,
        step, step_counter, gradients, metrics, dataset hooks).
      train_step, eval_step: the replica step functions (user hooks, ready to trace).
    """

    def __init__(self, trainer: Any, train_step: Callable, eval_step: Callable):
        self.trainer = trainer
        self.history = History()
        self._train_step, self._eval_step = train_step, eval_step
        self._loops: CompiledLoops | None = None
        self._eval_dataset = None
        self._iterator_at: tuple[int, Any] | None = None
        self._stop_reason: str | None = None
        self._preempt = False
        self.stopped_by: str | None = None  # why the last fit() stopped early (None: steps)
        self.last_loop: tuple[int, float] = (0, 0.0)  # (steps, host seconds) of the last call
        self._fit_iterator = None  # the train iterator of the current (or last) fit()

    # ------------------------------------------------------------ building
    @property
    def loops(self) -> CompiledLoops:
        if self._loops is None:
            t = self.trainer
            reducer = t.gradients.reducer
            self._loops = CompiledLoops(
                t.strategy, reducer.wrap_train(self._train_step),
                reducer.wrap_eval(self._eval_step), t.step_counter, t.train_loss, t.eval_loss)
        return self._loops

    def ensure_built(self, dist_dataset=None) -> None:
        """Builds an unbuilt model from the (train) dataset's element spec, then the
        optimizer's variables."""
        t = self.trainer
        model = t.model
        if not model.built or not model.trainable_variables:
            if dist_dataset is None:
                dist_dataset = self._distribute(t.build_train_dataset,
                                                t.config.train.global_batch_size)
            spec = _replica_spec(dist_dataset.element_spec)
            try:
                features, _ = data.split_batch(spec)
            except ValueError as error:
                raise ValueError(
                    "The model has no variables yet and the batch layout is custom; build it "
                    "in build_model() (e.g. start with keras.Input(shape)).") from error
            dummy = tf.nest.map_structure(
                lambda s: tf.zeros([d or 1 for d in s.shape], s.dtype), features)
            with t.strategy.scope():
                model(dummy, training=False)
        t.gradients.build_optimizer_variables(t.optimizer, model.trainable_variables)

    def _distribute(self, dataset_fn, global_batch_size: int, what: str = "build_train_dataset",
                    skip_batches: int = 0):
        return data.distribute(self.trainer.strategy, dataset_fn, global_batch_size,
                               deterministic=self.trainer.config.train.deterministic,
                               what=what, skip_batches=skip_batches)

    def _train_iterator(self):
        """The distributed train iterator, positioned at ``trainer.step``.

        Reused when it is still there (a second ``fit()``); otherwise the dataset is
        built and skips the batches already consumed, which is exact for deterministic
        pipelines and costs time linear in the steps skipped.
        """
        t = self.trainer
        if self._iterator_at is not None and self._iterator_at[0] == t.step:
            return self._iterator_at[1]
        dataset = self._distribute(t.build_train_dataset, t.config.train.global_batch_size,
                                   skip_batches=t.step)
        self.ensure_built(dataset)
        return iter(dataset)

    # ------------------------------------------------------------ evaluate
    def evaluate(self) -> dict[str, float]:
        """One pass over the eval dataset (``eval.steps`` batches when > 0)."""
        t = self.trainer
        if not t.has_eval_dataset():
            raise ValueError(f"{type(t).__name__} has no eval dataset: override "
                             f"build_eval_dataset(ctx) to evaluate.")
        if self._eval_dataset is None:
            self._eval_dataset = self._distribute(
                t.build_eval_dataset, t.eval_global_batch_size, what="build_eval_dataset")
            self.ensure_built(self._eval_dataset)
        reset_metrics(t.eval_loss, t.eval_metrics)
        self.loops.evaluate(iter(self._eval_dataset), tf.constant(t.config.eval.steps, tf.int64))
        return metric_values(t.eval_loss, t.eval_metrics)

    def train_graph(self) -> tf.Graph | None:
        """The graph of the compiled train loop as ``fit()`` traced it (no retrace);
        None before the first ``fit()``. Its loop body calls the step function once:
        ``strategy.run`` of the train step on this worker's replicas."""
        if self._fit_iterator is None or self._loops is None:
            return None
        return self._loops.train.get_concrete_function(
            self._fit_iterator, tf.constant(1, tf.int64)).graph

    def train_batch_spec(self) -> Any:
        """The ``tf.TypeSpec`` structure of ONE replica's train batch in the current (or
        last) ``fit()`` (first replica's spec; all are alike); None before any ``fit()``."""
        if self._fit_iterator is None:
            return None
        return _replica_spec(self._fit_iterator.element_spec)

    # ---------------------------------------------------------------- stop
    def request_stop(self, reason: str) -> None:
        """Host: asks every worker to stop at the end of the current loop."""
        if self._stop_reason is None:
            self._stop_reason = reason
            logging.info("stop requested at step %d: %s", self.trainer.step, reason)

    def request_preemption(self) -> None:
        """Host (e.g. a signal handler): checkpoint at the next boundary, then Preempted."""
        self._preempt = True

    def _agree(self) -> tuple[bool, bool]:
        """(stop, preempt) as every worker sees them: one all-reduce on multi-worker."""
        local = np.array([self._stop_reason is not None, self._preempt], np.int32)
        stop, preempt = host_collectives.sum_over_workers(self.trainer.strategy, local) > 0
        if stop and self._stop_reason is None:
            self._stop_reason = "requested on another worker"
        return bool(stop), bool(preempt)

    def _mean_over_workers(self, seconds: float) -> float:
        """Window seconds averaged over workers, so throughput logs agree everywhere."""
        workers = host_collectives.num_workers(self.trainer.strategy)
        if workers == 1:
            return seconds
        total = host_collectives.sum_over_workers(self.trainer.strategy,
                                                  np.array([seconds], np.float32))
        return float(total[0]) / workers

    # ----------------------------------------------------------------- fit
    def fit(self, callbacks: CallbackList) -> dict[str, float]:
        """Trains until ``train.steps`` or an agreed stop; see the module docstring."""
        t = self.trainer
        cfg = t.config
        total, k = cfg.train.steps, cfg.perf.grad_accum_steps
        iterator = self._fit_iterator = self._train_iterator()
        loops = self.loops
        self.history.results = {}
        self._stop_reason, self._preempt, self.stopped_by = None, False, None
        reset_metrics(t.train_loss, t.train_metrics)
        window_steps, window_seconds = 0, 0.0
        callbacks.on_fit_start(t)
        try:
            while t.step < total:
                next_log = next_boundary(t.step, cfg.train.log_every_steps)
                num_steps = int(min(cfg.train.steps_per_loop, total - t.step,
                                    next_log - t.step, callbacks.next_boundary(t.step) - t.step))
                start = time.perf_counter()
                try:
                    outputs = loops.train(iterator, tf.constant(num_steps, tf.int64))
                except tf.errors.OutOfRangeError as error:
                    raise ValueError(
                        f"build_train_dataset ran out of data at step {t.step + 1} of {total}; "
                        f"end it with .repeat() so training can run for train.steps.") from error
                seconds = time.perf_counter() - start
                self.last_loop = (num_steps, seconds)
                t.step += num_steps
                window_steps += num_steps
                window_seconds += seconds
                if t.step in (next_log, total):
                    logs = self._window_logs(outputs, window_steps, window_seconds)
                    window_steps, window_seconds = 0, 0.0
                    callbacks.on_log(t, logs)
                callbacks.on_loop_end(t)
                stop, preempt = self._agree()
                if (stop or preempt) and t.step < total:
                    if t.step % k:
                        logging.info("stop at step %d waits for the end of the gradient "
                                     "accumulation window of %d steps.", t.step, k)
                        continue
                    self.stopped_by = "preemption" if preempt else self._stop_reason
                    break
            if window_steps and self.stopped_by != "preemption":  # a stop inside a window
                callbacks.on_log(t, self._window_logs(outputs, window_steps, window_seconds))
            callbacks.on_train_end(t)
            if self.stopped_by == "preemption":
                raise Preempted(t.step)
            if self.stopped_by:
                logging.info("training stopped at step %d of %d: %s", t.step, total,
                             self.stopped_by)
        except BaseException:
            self._iterator_at = (t.step, iterator)
            callbacks.on_fit_end(t, dict(self.history.results))
            raise
        self._iterator_at = (t.step, iterator)
        results = dict(self.history.results)
        callbacks.on_fit_end(t, results)
        return results

    def _window_logs(self, outputs: dict, steps: int, seconds: float) -> dict[str, float]:
        """The ``on_log`` values of a window; resets the train metrics."""
        t = self.trainer
        values = {k: float(v) for k, v in outputs.items()}
        values.update(metric_values(t.train_loss, t.train_metrics))
        reset_metrics(t.train_loss, t.train_metrics)
        seconds = self._mean_over_workers(seconds)
        logs = {f"train/{k}": v for k, v in values.items()}
        logs["perf/steps_per_s"] = steps / max(seconds, 1e-9)
        logs["perf/examples_per_s"] = logs["perf/steps_per_s"] * t.config.train.global_batch_size
        return logs
