"""What the run reports while it trains: progress, per-window performance numbers,
TensorBoard scalars, ``metrics.jsonl``, regression alerts and the setup report.

:class:`Telemetry` is a service (:class:`trainer.run_context.Service`). It is always on and light:
per train loop it only adds up the host wall time of the compiled loop call (no extra
device sync); per logging window (``train.log_every_steps``) it samples host/device
memory and utilisation once and writes one record. Every ``telemetry.probe_every_windows``
windows and at the first slow window of a streak, while probes stay within
``telemetry.probe_budget`` of the wall time, and whenever an alert fires (its cause is
judged from the current input), it runs the short input/compute probes
of :mod:`trainer.telemetry.probes` to estimate the input-wait fraction
(:mod:`trainer.telemetry.input_wait` decides when).

Granularity. The step function runs ``steps_per_loop`` steps per ``tf.function`` call,
so per-step times are per loop call: ``step_time_mean_s`` is the window's loop seconds
over its steps; ``step_time_p90_s`` is the 90th percentile, over the window's loop
calls, of (call seconds / call steps). Throughput counts loop-call time only (eval,
checkpoints and logging between loops are excluded). The first window of a ``fit()``
includes tracing and is marked ``perf/warmup``; it never feeds the regression median.
Nor does a window right after a probe (``perf/after_probe``): while the probe ran, the
train pipeline kept filling its prefetch buffer, so that window runs partly on stock;
nor, in a run the probe found input-bound, any window whose steps outran half the
probed seconds per batch of the pipeline alone (short windows run on that stock for
several windows, and would otherwise make the next window "slow").

Outputs (files only on the chief, and only when the Trainer has a workdir):

* console: :mod:`trainer.telemetry.progress` (``telemetry.progress``). Only the chief prints
  progress; alerts print everywhere. The setup report (:func:`setup_report`) and the
  run's events (:mod:`trainer.run_context`: restore, stop, rollback, preemption) are printed
  there too, so a plain script or a notebook calling ``fit()`` shows them; where the
  progress is off (or not the chief) they go to the log instead.
* TensorBoard (:mod:`trainer.telemetry.summaries`): ``workdir/train`` and ``workdir/eval``;
  train/eval values as ``loss``, ``accuracy``…, the rest under ``perf/``, ``mem/``,
  ``sys/``, ``precision/``; alerts as the text summary ``alerts`` and the scalar
  ``perf/regression_alert``.
* ``workdir/metrics.jsonl``: one JSON object per logging window and per evaluation;
  the keys are listed in :data:`TRAIN_KEYS` / :data:`EVAL_KEYS` and in docs/telemetry.md;
  and one per event (its ``kind``: ``restore``, ``resume``, ``stop``, ``rollback``,
  ``preemption``; ``goodput``, whose numbers go to TensorBoard's train run too). An event reported outside ``fit()`` (``Trainer.restore`` before it) is
  written and printed at the start of the next ``fit()``.
  ``telemetry.loggers`` chooses among these files ("jsonl", "tensorboard").

Extension points (how other services add to and read the records, so that one record
per window reaches every output): a *source* (``Telemetry(config, sources=[...])``) is
an object with ``values(run, logs) -> dict`` whose values are merged into every
train record (e.g. :class:`trainer.telemetry.flops.FlopsMeter`: ``train/flops_per_example``,
``train/tflops``, ``train/mfu``, ``train/hardware_flops_per_example``, ``train/hfu``;
the progress line leaves them out); a *sink*
(``sinks=[...]``) is an object with ``write(record)`` that receives every train and
eval record on the chief after the files (e.g. :class:`trainer.telemetry.loggers.MlflowLogger`).
The ``logs`` dict of ``on_log`` is shared by all callbacks and never modified.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from typing import Any, Sequence, TextIO

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from trainer.distribution import strategies
from trainer.run_context import RunContext, Service
from trainer.telemetry.input_wait import InputWait
from trainer.telemetry.alerts import RegressionDetector, likely_cause
from trainer.telemetry.progress import Progress, duration, event_line, progress_mode
from trainer.telemetry.summaries import SummaryWriters
from trainer.telemetry.system_stats import SystemSampler

#: Keys of every ``kind == "train"`` record of metrics.jsonl (values may be null where
#: noted in docs/telemetry.md), plus ``train/NAME`` for each value the step/metrics report.
TRAIN_KEYS = (
    "kind", "step", "time", "train/loss",
    "perf/steps_per_s", "perf/examples_per_s", "perf/step_time_mean_s", "perf/step_time_p90_s",
    "perf/loop_calls", "perf/warmup", "perf/after_probe", "perf/eta_s",
    "perf/input_wait_fraction", "perf/pipeline_examples_per_s", "perf/compute_examples_per_s",
    "perf/probe_step",
    "mem/host_rss_mb", "mem/host_memory_fraction", "mem/device_current_mb", "mem/device_peak_mb",
    "mem/gpu_memory_fraction",
    "sys/host_cpu_percent", "sys/process_cpu_percent", "sys/gpu_util_percent",
    "precision/skipped_steps", "precision/loss_scale",
    "perf/regression_alert", "alert",
    "train/flops_per_example", "train/tflops", "train/mfu",  # from run.telemetry.flops
    "train/hardware_flops_per_example", "train/hfu",
)
#: Keys of every ``kind == "eval"`` record, plus ``eval/NAME`` for each eval metric.
EVAL_KEYS = ("kind", "step", "time", "eval/loss")


def controls(cfg: ml_collections.ConfigDict) -> str:
    """The training controls that are on (EMA, early stopping, non-finite handling,
    gradient accumulation), or ``none``."""
    on = []
    if cfg.optimizer.ema_decay > 0:
        on.append(f"EMA of the weights (decay {cfg.optimizer.ema_decay:g})")
    es = cfg.train.early_stopping
    if es.metric:
        on.append(f"early stopping on {es.metric} ({es.mode}, patience {es.patience}, "
                  f"min_delta {es.min_delta:g})")
    train = cfg.train
    if train.on_nonfinite == "rollback":
        bound = (f" or loss > {train.loss_upper_bound:g}" if train.loss_upper_bound > 0
                 else "")
        on.append(f"rollback after {train.rollback_after} non-finite step(s){bound}, at "
                  f"most {train.max_rollbacks} time(s)")
    elif train.on_nonfinite in ("skip", "stop"):
        on.append(f"non-finite updates: {train.on_nonfinite}")
    if cfg.perf.grad_accum_steps > 1:
        on.append(f"gradient accumulation over {cfg.perf.grad_accum_steps} steps")
    return "; ".join(on) or "none"


def setup_report(run: RunContext) -> str:
    """One screen: devices and strategy, precision, XLA, batch, controls, outputs."""
    cfg = run.config
    policy = keras.mixed_precision.global_policy().name
    scaling = (f"dynamic loss scale from {cfg.precision.initial_loss_scale:g}"
               if run.precision.dynamic else "no loss scaling")
    xla = [run.steps.compiled()
           + (" (perf.plan=auto: other settings measured on runs over "
              f"{cfg.perf.plan_min_run_s:g} s; its 'plan:' line says which runs)"
              if cfg.perf.plan == "auto" else ""),
           f"auto-clustering={tf.config.optimizer.get_jit() or 'off'}"]
    if os.environ.get("TF_XLA_FLAGS"):
        xla.append(f"TF_XLA_FLAGS={os.environ['TF_XLA_FLAGS']}")
    chief = run.is_chief
    outputs = (f"{run.workdir} (train/, eval/, metrics.jsonl"
               f"{', profile/' if cfg.telemetry.profile_steps else ''})"
               if run.workdir and chief else "none (no workdir, or not the chief)")
    lines = [
        strategies.describe(run.strategy),
        f"  precision: {policy}, {scaling}",
        f"  XLA: {', '.join(xla)}",
        f"  batch: global {run.batch.global_size}, per replica "
        f"{run.batch.per_replica}; steps {run.step}->{cfg.train.steps}, "
        f"{cfg.train.steps_per_loop} per loop call, log every {cfg.train.log_every_steps}",
        f"  sparse gradients: perf.sparse_reduce={cfg.perf.sparse_reduce} (each table's "
        f"choice is logged when the step is traced)",
        f"  controls: {controls(cfg)}",
        f"  outputs: {outputs}",
    ]
    if cfg.telemetry.profile_steps:
        lines.append(f"  profiler windows: {cfg.telemetry.profile_steps}")
    return "\n".join(lines)


class Telemetry(Service):
    """Per-window throughput, timing, memory, utilisation, input wait, alerts, outputs.

    Args:
      config: the run's config (``train.*`` and ``telemetry.*`` are read).
      stream: where progress goes (default ``sys.stderr``).
      sources: objects whose ``values(run, logs)`` join every train record.
      sinks: objects whose ``write(record)`` gets every record (chief only).
      events: the run's :class:`trainer.run_context.RunEvents`; each event is written to
        ``metrics.jsonl`` and printed (see the module docstring).
    """

    def __init__(self, config: ml_collections.ConfigDict, stream: TextIO | None = None,
                 sources: Sequence[Any] = (), sinks: Sequence[Any] = (),
                 events: Any = None):
        self.config = config
        self._fitting = False
        self._pending_events: list[dict[str, Any]] = []  # reported outside fit()
        if events is not None:
            events.subscribe(self.on_event)
        self.stream = stream or sys.stderr
        self.sources, self.sinks = list(sources), list(sinks)
        self._source_keys: set[str] = set()  # left out of the progress line
        self.records: list[dict[str, Any]] = []  # this fit()'s train records, in order
        self._active_writers: SummaryWriters | None = None  # open during a fit() only
        self._sampler: SystemSampler | None = None
        self._input_wait = InputWait(config)

    # -------------------------------------------------------------- lifecycle
    def on_fit_start(self, run: RunContext) -> None:
        cfg = self.config
        self._chief = run.is_chief
        mode = progress_mode(cfg.telemetry.progress, self.stream)
        self.progress = Progress(mode if self._chief else "off", cfg.train.steps, self.stream)
        if run.workdir and self._chief:
            outputs = tuple(o for o in cfg.telemetry.loggers if o in ("jsonl", "tensorboard"))
            self._active_writers = SummaryWriters(run.workdir, outputs) if outputs else None
        self._sampler = SystemSampler(run.strategy)
        self._detector = RegressionDetector(cfg.telemetry.alert_drop, cfg.telemetry.alert_windows)
        self._loops: list[tuple[int, float]] = []
        self._seen_step = run.step
        self._windows = 0
        self._rate: float | None = None  # steps/s of the latest non-warm-up window
        self._input_wait.start_fit(run)
        self._fitting = True
        self._say(setup_report(run))
        pending, self._pending_events = self._pending_events, []
        for record in pending:
            self.on_event(record)

    def _take_loop(self, run: RunContext) -> None:
        """Records the loop that just ended (once, from whichever hook comes first)."""
        if self._seen_step != run.step:
            self._seen_step = run.step
            self._loops.append(run.last_loop)

    def on_loop_end(self, run: RunContext) -> None:
        self._take_loop(run)
        if self.progress.updating:
            eta = (self.config.train.steps - run.step) / self._rate if self._rate else None
            last = self.records[-1] if self.records else {}
            self.progress.update(run.step, last.get("train/loss"),
                                 last.get("perf/examples_per_s"), eta)

    def on_log(self, run: RunContext, logs: dict[str, float]) -> None:
        self._take_loop(run)
        record = self._window_record(run, logs)
        self.records.append(record)
        self._write(record)
        self.progress.line(self._summary_line(record))

    def _write(self, record: dict[str, Any]) -> None:
        if self._active_writers:
            self._active_writers.write(record)
        if self._chief:
            for sink in self.sinks:
                sink.write(record)

    def on_eval_end(self, run: RunContext, logs: dict[str, float]) -> None:
        record = {"kind": "eval", "step": run.step, "time": time.time(), **logs}
        self._write(record)
        self.progress.line(f"eval  step {run.step}: " + ", ".join(
            f"{k[5:]}={v:.4g}" for k, v in logs.items() if k.startswith("eval/")))

    def on_event(self, record: dict[str, Any]) -> None:
        """A run event (:mod:`trainer.run_context`): one ``metrics.jsonl`` record (chief with
        a workdir) and one console line; kept for the next ``fit()`` outside one."""
        if not self._fitting:
            self._pending_events.append(record)
            return
        if record["kind"] == "rollback":  # the step went back: the next loop is new
            self._seen_step = record["step"]
        if self._active_writers and record["kind"] == "goodput":  # numbers: TensorBoard too
            self._active_writers.write(record, logdir="train")
        elif self._active_writers:
            self._active_writers.write_jsonl(record)
        self._say(event_line(record))

    def _say(self, text: str) -> None:
        """On the console through the progress (chief), else in the log."""
        if self.progress.mode == "off":
            logging.info("%s", text)
        else:
            self.progress.line(text)

    def on_fit_end(self, run: RunContext, results: dict[str, float]) -> None:
        self._fitting = False
        self.progress.close()
        if self._active_writers:  # after a stop signal, within its grace period
            self._active_writers.close(self.config.checkpoint.preemption_grace_s
                                       if run.stopped_by == "preemption" else None)
            self._active_writers = None
        if self._sampler:
            self._sampler.close()
        self._input_wait.end_fit()

    # ---------------------------------------------------------------- windows
    def _window_record(self, run: RunContext, logs: dict[str, float]) -> dict[str, Any]:
        cfg = self.config
        loops, self._loops = self._loops, []
        self._windows += 1
        warmup = self._windows == 1
        steps = sum(n for n, _ in loops)
        seconds = sum(s for _, s in loops)
        step_s = seconds / max(steps, 1)
        per_call = sorted(s / n for n, s in loops)
        p90 = per_call[min(len(per_call) - 1, math.ceil(0.9 * len(per_call)) - 1)]
        examples_per_s = steps * run.batch.global_size / max(seconds, 1e-9)
        if not warmup:
            self._rate = steps / max(seconds, 1e-9)
        record: dict[str, Any] = {
            "kind": "train", "step": run.step, "time": time.time(),
            **{k: v for k, v in logs.items() if k.startswith("train/")},
            "perf/steps_per_s": steps / max(seconds, 1e-9),
            "perf/examples_per_s": examples_per_s,
            "perf/step_time_mean_s": step_s, "perf/step_time_p90_s": p90,
            "perf/loop_calls": len(loops), "perf/warmup": warmup,
            "perf/eta_s": (cfg.train.steps - run.step) / self._rate if self._rate else None,
        }
        for source in self.sources:
            values = source.values(run, logs)
            self._source_keys.update(values)
            record.update(values)
        record.update(self._sampler.sample())
        record["precision/skipped_steps"], record["precision/loss_scale"] = (
            run.precision.counters())
        # A window right after a probe was partly fed from the prefetch buffer that
        # filled while the probe ran, and so was any window whose steps outran the
        # pipeline alone (short windows can run on that stock for several windows): it
        # neither counts for nor breaks a slow streak.
        record["perf/after_probe"] = after_probe = self._input_wait.after_probe()
        from_stock = after_probe or self._input_wait.outran_the_pipeline(step_s)
        slow, fire = (False, False) if warmup or from_stock else self._detector.update(
            examples_per_s)
        if not warmup:
            self._input_wait.maybe_probe(run, self._windows, step_s,
                                         slow=slow and self._detector.streak == 1, alert=fire)
        record.update(self._input_wait.numbers(step_s, run.batch.global_size))
        record["perf/regression_alert"] = 0.0
        record["alert"] = None
        if fire:
            baseline = self._baseline()
            cause = likely_cause(record, baseline)
            median = self._detector.median()
            record["alert"] = (
                f"throughput regression: {examples_per_s:,.0f} examples/s for "
                f"{cfg.telemetry.alert_windows} windows, more than "
                f"{cfg.telemetry.alert_drop:.0%} below the running median {median:,.0f}; "
                f"likely cause: {cause}")
            record["perf/regression_alert"] = 1.0
            self.progress.clear()
            logging.warning("step %d: %s", run.step, record["alert"])
        return record

    def _baseline(self) -> dict[str, Any]:
        """Telemetry before the slow streak: median input wait and step time, skipped-step
        count."""
        streak = self.config.telemetry.alert_windows - 1  # earlier slow windows in records
        earlier = [r for r in self.records[:len(self.records) - streak] if not r["perf/warmup"]]
        waits = [r["perf/input_wait_fraction"] for r in earlier
                 if r["perf/input_wait_fraction"] is not None]
        steps = [r["perf/step_time_mean_s"] for r in earlier]
        return {"perf/input_wait_fraction": statistics.median(waits) if waits else None,
                "perf/step_time_mean_s": statistics.median(steps) if steps else None,
                "precision/skipped_steps": earlier[-1]["precision/skipped_steps"] if earlier else 0}

    def _summary_line(self, record: dict[str, Any]) -> str:
        total = self.config.train.steps
        train = ", ".join(f"{k[6:]}={v:.4g}" for k, v in record.items()
                          if k.startswith("train/") and k not in self._source_keys)
        parts = [f"step {record['step']}/{total}: {train}",
                 f"{record['perf/examples_per_s']:,.0f} ex/s",
                 f"step {record['perf/step_time_mean_s'] * 1e3:.2f} ms "
                 f"(p90 {record['perf/step_time_p90_s'] * 1e3:.2f})"]
        wait = record.get("perf/input_wait_fraction")
        if wait is not None:
            parts.append(f"input wait {wait:.0%}")
        parts.append(f"rss {record['mem/host_rss_mb']:,.0f} MB")
        if record.get("mem/device_peak_mb") is not None:
            parts.append(f"device peak {record['mem/device_peak_mb']:,.0f} MB")
        if record["precision/skipped_steps"]:
            parts.append(f"skipped {record['precision/skipped_steps']}")
        parts.append(f"ETA {duration(record['perf/eta_s'])}")
        return "  ".join(parts)
