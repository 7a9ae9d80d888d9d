"""The loop driver behind ``Trainer.fit()`` / ``Trainer.evaluate()``.

*When* things happen lives here: how many steps one ``tf.function`` call runs
(``train.steps_per_loop``, an in-graph ``tf.range`` loop over the distributed
iterator), the logging cadence, and the loop boundaries the callbacks ask for
(``Callback.next_boundary``: eval, checkpoints, profiler windows). Every logging
boundary and ``train.steps`` itself end a loop exactly: the number of steps per call
is a tensor argument, so a shorter loop does not retrace.

The in-graph loops are built in one place (:mod:`trainer.loop.compiled_loops`), one set
per trace key (XLA setting, pack size) of the run's execution plan. Which plan each call
runs is the :class:`trainer.loop.plan.Planner`'s decision (its cache of measured plans:
:mod:`trainer.loop.plan_cache`), measured on a copy of the run that is then rewound
(:mod:`trainer.loop.rehearsal`).

Stopping. ``request_stop`` (any callback, any worker) and a preemption notice set a local
flag; after the callbacks of every loop boundary the workers agree on the flags (a small
all-reduce per loop with several workers), so every worker stops at one step. Inside a
gradient-accumulation window the stop waits for the window's last step; a notice at the
last step (its evaluation abandoned) is a preemption too. Then ``on_train_end`` runs (the
final checkpoint), and ``fit()`` returns, or raises :class:`trainer.errors.Preempted`,
with the outcome of the stop's save (the run's ``preemption`` event,
:mod:`trainer.checkpoint.stop_save`); the driver is never called back.

The services see only its run context (:mod:`trainer.loop.context`). Contexts: the
driver runs on the host in cross-replica context, the steps in replica context.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import tensorflow as tf
from absl import logging

from trainer import data
from trainer.callbacks import CallbackList
from trainer.checks import inputs
from trainer.data import resume
from trainer.data.iterator_release import release
from trainer.data.train_input import TrainInput, continuation_context
from trainer.distribution import host_collectives
from trainer.errors import Preempted
from trainer.loop import eval_pass, metric_readout, plan as plan_lib, rehearsal
from trainer.loop.compiled_loops import CompiledLoops, TrainableWatch, replica_spec
from trainer.run_context import next_multiple
from trainer.runtime import keras_compat
from trainer.step import random_streams, replica_state


class LoopDriver:
    """Runs ``fit()`` and ``evaluate()`` for one Trainer (``trainer.driver``).

    Keeps the compiled loops and the eval dataset across ``fit()`` calls (until
    :meth:`close`), and the train iterator from one ``fit()`` to the next that starts
    where it stopped with the same config (``train.steps`` aside) and resumed run
    (:mod:`trainer.data.train_input`).

    Args:
      trainer: the Trainer (its public attributes: config, strategy, model, optimizer, step,
        step_counter, gradients, metrics, dataset hooks).
      train_step, eval_step: the replica step functions (user hooks, ready to trace).
      history: the service whose ``results`` ``fit()`` returns
        (:class:`trainer.services.history.History`).
      state: ``() -> variables`` the run's next steps depend on, that the plan's
        rehearsal puts back (:mod:`trainer.loop.rehearsal`).
    """

    def __init__(self, trainer: Any, train_step: Callable, eval_step: Callable, history: Any,
                 state: Callable[[], list]):
        self.trainer = trainer
        self.history = history
        self._state = state
        self._train_step, self._eval_step = train_step, eval_step
        self._loops: dict[tuple, CompiledLoops] = {}  # by the plan's trace_key (XLA, packs)
        self._planner: plan_lib.Planner | None = None
        self._last_key = None  # the trace key of this fit()'s last loop call
        self._trainable = TrainableWatch()  # a layer (un)frozen: the step is traced again
        self._eval_dataset = None
        # What the restored checkpoint says about the run that wrote it (its step, worker
        # count and input layout; set through the run context's ``resumed``), or None.
        self.resumed: resume.Resumed | None = None
        self.input_report: dict = {}  # {"input_layout": ...} of the train dataset (checkpointed)
        self._stop_reason, self._preempt = None, False  # a stop's reason; preemption noticed
        self.stopped_by: str | None = None  # why the last fit() stopped early (None: steps)
        self.last_loop: tuple[int, float] = (0, 0.0)  # (steps, host seconds) of the last call
        self.last_outputs: dict[str, tf.Tensor] = {}  # the last call's outputs (last step)
        self.input = TrainInput(  # the train iterator of fit() calls
            self._train_dataset, lambda: continuation_context(trainer.config, self.resumed))
        self._last_fit: tuple = (None, None)  # (train graph, batch spec) after a fit()
        # Train windows are frequent: compiled. Evaluation reads as Keras does (eagerly).
        readout = metric_readout.MetricReadout
        self.train_readout = readout(trainer.train_loss, trainer.train_metrics, True)
        self.eval_readout = readout(trainer.eval_loss, trainer.eval_metrics, False)

    # ------------------------------------------------------------ building
    @property
    def planner(self) -> plan_lib.Planner:
        """The execution plan's planner (built once, at the first use)."""
        if self._planner is None:
            self._planner = plan_lib.build(self.trainer, self.train_batch_spec(),
                                           self._default_key[1], self._xla_lowering_error)
        return self._planner

    def _xla_lowering_error(self, setting: str) -> str | None:
        """The XLA lowering's error for the train step with XLA ``setting``, or None."""
        spec = self.train_batch_spec()
        if (dynamic := data.dynamic_shapes_problem(spec)) is not None:
            return dynamic
        if setting == "grads":
            return self.trainer.steps.xla_lowering_error(spec)
        return self._loops_for((setting, self._default_key[1])).lowering_error(spec)

    @property
    def loops(self) -> CompiledLoops:
        """The compiled loops of the current plan's XLA setting (evaluation uses the
        first loops built: the eval step never compiles with XLA)."""
        plan = self.planner.next_plan() if self._planner else None
        return self._loops_for(plan.trace_key if plan else self._default_key)

    @property
    def _default_key(self) -> tuple[str, int]:
        """The trace key of the configured plan, before the planner exists."""
        t = self.trainer
        return "grads" if t.steps.xla else "off", t.config.distribute.grad_pack_bytes

    def _loops_for(self, key: tuple[str, int]) -> CompiledLoops:
        """The loops of a plan's trace ``key`` (XLA setting, pack bytes:
        :mod:`trainer.loop.plan`; built once); sets what the step's next trace reads."""
        t, (setting, packs) = self.trainer, key
        t.steps.xla, t.gradients.pack_bytes = setting == "grads", packs
        if key not in self._loops:
            reducer = t.gradients.reducer
            self._loops[key] = CompiledLoops(
                t.strategy, reducer.wrap_train(self._train_step),
                reducer.wrap_eval(self._eval_step), t.step_counter, t.train_loss, t.eval_loss,
                jit_step=setting == "step", random_rows=random_streams.global_rows(t.config, t.batch))
        return self._loops[key]

    def ensure_built(self, dist_dataset=None, what: str = "build_train_dataset") -> None:
        """Checks the dataset's features against the model's inputs (when the model
        declares them), builds an unbuilt model from the element spec, then the
        optimizer's variables. ``what`` names the dataset hook in error messages."""
        t, model = self.trainer, self.trainer.model
        unbuilt = not model.built or not model.trainable_variables
        if unbuilt and dist_dataset is None:
            dist_dataset = self._distribute(t.hooks.dataset("build_train_dataset"), t.batch)
        features = None
        if dist_dataset is not None:
            spec = replica_spec(dist_dataset.element_spec)
            try:
                features, _ = data.split_batch(spec)
            except ValueError as error:
                if unbuilt:
                    raise ValueError(
                        "The model has no variables yet and the batch layout is custom; build "
                        "it in build_model() (e.g. start with keras.Input(shape)).") from error
            if features is not None:
                step = "train_step" if what == "build_train_dataset" else "eval_step"
                inputs.check_features(features, model, what, t.overrides(step))
        if unbuilt:
            dummy = data.zeros_for_spec(features)
            with t.strategy.scope(), replica_state.averaged_state():
                model(dummy, training=False)
        weights = [*keras_compat.trainable_capable_variables(model),  # frozen layers' too
                   *(v for _, v in t.gradients.owned)]  # the Trainer's own
        t.gradients.build_optimizer_variables(t.optimizer, weights)
        if t.ema is not None:
            t.ema.build(t.strategy, weights)

    def _distribute(self, dataset_fn, batch: data.BatchSizes,
                    what: str = "build_train_dataset", skip_batches: int = 0):
        config = self.trainer.config
        train = what == "build_train_dataset"
        return data.distribute(self.trainer.strategy, dataset_fn, batch,
                               deterministic=config.train.deterministic, what=what,
                               skip_batches=skip_batches,
                               resume_layout=(self.resumed.layout
                                              if train and self.resumed else None),
                               service=config.data.get("service", "") if train else "",
                               report=self.input_report if train else None,
                               must_end=not train and config.eval.steps < 0)

    def _train_dataset(self, step: int):
        """The distributed train dataset from ``step`` on (it skips the batches already
        consumed: exact for deterministic pipelines, time linear in the steps skipped);
        the model and optimizer built from its spec when they are not yet."""
        dataset = self._distribute(self.trainer.hooks.dataset("build_train_dataset"),
                                   self.trainer.batch, skip_batches=step)
        self.ensure_built(dataset)
        return dataset

    # ------------------------------------------------------------ evaluate
    def evaluate(self) -> dict[str, float]:
        """One pass over the eval dataset (``eval.steps`` batches when > 0); raises
        :class:`trainer.loop.eval_pass.EvalAbandoned` when a preemption abandons it."""
        t = self.trainer
        if not t.has_eval_dataset():
            raise ValueError(f"{type(t).__name__} has no eval dataset: override "
                             f"build_eval_dataset(ctx) to evaluate.")
        self._eval_input()
        self.eval_readout.reset()
        held = [iter(self._eval_dataset)]  # released off this thread (as the train one)
        try:
            eval_pass.run_pass(self._eval_loops().evaluate, held[0],
                               t.config.eval.steps, lambda: self._preempt,
                               f"eval at step {t.step}",
                               host_collectives.num_workers(t.strategy))
        except Exception as error:  # a user's mistake becomes one InputError
            found = inputs.loop_error(error, "build_eval_dataset", f"eval at step {t.step}")
            if found is None:
                raise
            raise found from error
        finally:
            release(held)
        return self.eval_readout.take()

    def _eval_loops(self) -> CompiledLoops:
        """Loops whose eval function exists already (the eval step never uses XLA)."""
        if self._loops:
            return next(iter(self._loops.values()))
        return self.loops

    def _eval_input(self) -> None:
        """Builds the distributed eval dataset once (and the model from it if needed)."""
        if self._eval_dataset is None:
            t = self.trainer
            self._eval_dataset = self._distribute(
                t.hooks.dataset("build_eval_dataset"), t.eval_batch, what="build_eval_dataset")
            self.ensure_built(self._eval_dataset, "build_eval_dataset")

    def train_graph(self) -> tf.Graph | None:
        """The graph of the compiled train loop as ``fit()`` traced it for the last loop
        call's plan (no retrace); None before the first ``fit()``. Its loop body calls the
        step function once: ``strategy.run`` of the train step on this worker's replicas."""
        loops = self._loops.get(self._last_key)
        if self.input.iterator is None or loops is None:
            return self._last_fit[0]
        return loops.train.get_concrete_function(
            self.input.iterator, tf.constant(1, tf.int64)).graph

    def train_batch_spec(self) -> Any:
        """The ``tf.TypeSpec`` structure of ONE replica's train batch in the current (or
        last) ``fit()`` (first replica's spec; all are alike); None before any ``fit()``."""
        if self.input.iterator is None:
            return self._last_fit[1]
        return replica_spec(self.input.iterator.element_spec)

    def _end_train_input(self, keep: bool = False) -> None:
        """Ends the current train iterator, keeping its graph and batch spec: ``keep``
        keeps it for the next ``fit()``, otherwise it (and a kept one) is destroyed on
        a background thread (:mod:`trainer.data.train_input`)."""
        if self.input.iterator is not None:
            self._last_fit = (self.train_graph(), self.train_batch_spec())
        self.input.end(keep)

    def close(self) -> None:
        """Drops everything a ``fit()`` or ``evaluate()`` built: the train iterator, the
        eval dataset and the traced loops (the Trainer stays usable: the next call
        builds them again)."""
        self._end_train_input()
        self._eval_dataset = None
        self._loops.clear()
        self._last_fit = (None, None)

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

    # ----------------------------------------------------------------- fit
    def fit(self, callbacks: CallbackList) -> dict[str, float]:
        """Trains until ``train.steps`` or an agreed stop; see the module docstring."""
        try:
            results = self._fit(callbacks)
        except BaseException:  # the iterator's position is unknown
            self._end_train_input()
            raise
        self._end_train_input(keep=True)
        return results

    def _fit(self, callbacks: CallbackList) -> dict[str, float]:
        t, cfg = self.trainer, self.trainer.config
        total, k = cfg.train.steps, cfg.perf.grad_accum_steps
        self.input.start(t.step)
        self._last_key = None
        if t.has_eval_dataset():  # its mistakes (e.g. no end) surface before training
            self._eval_input()
        planner = self.planner
        self._stop_reason, self._preempt, self.stopped_by = None, False, None
        self.train_readout.reset()
        window_steps, window_seconds = 0, 0.0
        callbacks.on_fit_start()  # when it raises, what started has ended
        try:
            plan_lib.announce(planner.adopt(self.resumed.plan if self.resumed else None)
                              or planner.single(), t.events, t.step)
            start = t.step  # undecided: the state before a first call that may rehearse
            snapshot = None if planner.decided else rehearsal.Snapshot(self._state())
            if t.step >= total:
                t.events.stop(t.step, f"{'workdir ' if t.workdir else ''}already at step "
                                      f"{t.step} >= train.steps={total}: nothing to train")
            while t.step < total:
                next_log = next_multiple(t.step, cfg.train.log_every_steps)
                plan = planner.next_plan()
                num_steps = int(min(plan.steps_per_loop, total - t.step,
                                    next_log - t.step, callbacks.next_boundary(t.step) - t.step))
                outputs, seconds = self._train_loop(plan.trace_key, num_steps)
                if snapshot is not None:  # the planner's first call
                    record = planner.after_call(plan, num_steps, seconds, total - start)
                    rewind = not planner.decided
                    if rewind:  # measuring: on a copy of the run, then from `start` again
                        record = self._rehearse(snapshot, num_steps, total - start)
                    plan_lib.announce(record, t.events, t.step)
                    snapshot = None
                    if rewind:
                        continue
                self.input.advance(num_steps)
                self.last_loop, self.last_outputs = (num_steps, seconds), outputs
                t.step += num_steps
                window_steps += num_steps
                window_seconds += seconds
                if t.step in (next_log, total):
                    logs = metric_readout.window_logs(
                        t, self.train_readout, outputs, window_steps, window_seconds)
                    window_steps, window_seconds = 0, 0.0
                    callbacks.on_log(logs)
                callbacks.on_loop_end()
                stop, preempt = self._agree()
                if (stop or preempt) and (t.step < total or preempt):
                    if t.step % k and t.step < total:
                        logging.info("stop at step %d waits for the end of the gradient "
                                     "accumulation window of %d steps.", t.step, k)
                        continue
                    self.stopped_by = "preemption" if preempt else self._stop_reason
                    if not preempt:  # a preemption is reported once its save is known
                        t.events.stop(t.step, self._stop_reason)
                    break
            if window_steps and self.stopped_by != "preemption":  # a stop inside a window
                callbacks.on_log(metric_readout.window_logs(
                    t, self.train_readout, outputs, window_steps, window_seconds))
            reported = len(t.events.records)
            callbacks.on_train_end()
            if self.stopped_by == "preemption":  # as the stop's save reported it
                record = (t.events.latest("preemption", since=reported)
                          or t.events.preemption(t.step, None, "none (no workdir)"))
                raise Preempted(t.step, record["saved"], record["last_good"])
        except BaseException:
            callbacks.on_fit_end(dict(self.history.results))
            raise
        results = dict(self.history.results)
        callbacks.on_fit_end(results)
        return results

    def _rehearse(self, snapshot: rehearsal.Snapshot, done: int, steps: int) -> dict:
        """The planner's measurement after its first call (``done`` steps) on a copy of
        the run (:mod:`trainer.loop.rehearsal`), rewound; the decision's fields."""
        record = rehearsal.rehearse(
            self.planner, lambda plan, n: self._train_loop(plan.trace_key, n)[1], snapshot,
            done, steps)
        self.train_readout.reset()  # the window's metrics, norms and accumulation: empty
        self.trainer.gradients.norms.take()
        self.trainer.gradients.reset_accumulators()
        self._end_train_input()
        self.input.start(self.trainer.step)
        return record

    def _train_loop(self, key: tuple[str, int], num_steps: int) -> tuple[dict, float]:
        """One call of the train loop of the plan's trace ``key`` on the fit's iterator:
        ``(outputs, host seconds)``; a user's mistake becomes one InputError."""
        if self._trainable.changed(self.trainer.model, self.trainer.step):  # (un)frozen
            self._loops.clear()
        loops = self._loops_for(key)
        start = time.perf_counter()
        try:
            loops.prepare(self.input.iterator)  # the first call of these loops traces the step
            outputs = loops.train(self.input.iterator, tf.constant(num_steps, tf.int64))
        except Exception as error:
            found = inputs.train_loop_error(error, self.trainer, self.input.dataset, num_steps)
            if found is None:
                raise
            raise found from error
        self._last_key = key  # traced: train_graph() will not trace
        return outputs, time.perf_counter() - start

