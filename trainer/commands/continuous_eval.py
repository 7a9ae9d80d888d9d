"""Evaluating a run's checkpoints apart from training: ``--mode=eval`` and ``continuous_eval``.

Model Garden's semantics, on this framework's checkpoints (:mod:`trainer.checkpoint.storage.reader`)::

    python -m trainer.main --config=... --workdir=DIR --mode=eval [--step=S]
    python -m trainer.main --config=... --workdir=DIR --mode=continuous_eval [--eval_timeout_s=T]

* ``eval``: restores DIR's latest checkpoint (or step ``S``), evaluates it once, prints
  ``{"step": S, "eval/loss": ..., "eval/NAME": ...}`` as one JSON line on stdout,
  records it (below) and returns.
* ``continuous_eval``: watches DIR's committed checkpoints (both checkpoint directories)
  and evaluates each new one as it appears. When several appeared while it was busy it
  evaluates the newest and skips the older ones (it never goes back to a step below one
  it evaluated). It stops after evaluating the checkpoint of the run's final step
  (``train.steps``), or when no new checkpoint appeared for ``timeout_s`` seconds
  (Model Garden's ``continuous_eval_timeout``, default one hour). A step already in
  its stream (an evaluator restarted with its group) is not evaluated again.

Commits: orbax writes a step into ``<step>.orbax-checkpoint-tmp-*`` and renames it when
complete; only renamed (committed) steps are listed, so a checkpoint still being
written is never read: the evaluator waits for its commit. A committed step removed by
the trainer's ``checkpoint.max_to_keep`` before it could be read is skipped with a
warning; another unreadable step is skipped with a warning too, unless it is the
final one (then :class:`CheckpointError`).

What it writes, only: ``DIR/eval/metrics.jsonl`` (records ``{"kind": "eval", "step",
"time", "eval/...": ...}``, the step being the checkpoint's) and TensorBoard event files
in ``DIR/eval`` (suffix ``.evaluator``; the trainer's own periodic evaluation writes
event files there too, under the same tags). Never checkpoints, ``DIR/metrics.jsonl``
or ``DIR/config.json``; no callback runs (a callback's ``on_eval_end`` may save).

Best checkpoint: with ``checkpoint.best_metric="eval/NAME"`` the evaluator keeps the
best checkpoint by ITS OWN results: whenever an evaluated step beats the best so far
(``checkpoint.best_mode``) it exports that model to ``DIR/eval/export/best`` with
``best.json`` (``{"step": S, "NAME": value}``), as the trainer does for its own best in
``DIR/export/best``. The trainer's best directory is not touched.

One device: an evaluator never joins the training group's collectives. A config whose
strategy resolves to ``multi_worker`` (``auto`` with TF_CONFIG set, as in every task of
a cluster) is evaluated with ``one_device`` instead, and so is any config in the
process TF_CONFIG names the ``evaluator`` task (:func:`evaluation_config`). TensorFlow's own
MultiWorkerMirroredStrategy counts an ``evaluator`` task as a cluster of its own
(``multi_worker_util.worker_count``); this module does not create it at all. A process
whose TF_CONFIG names it the ``evaluator`` task refuses ``--mode=train``
(:func:`check_mode`): it would write checkpoints beside the chief's.

Contexts: host, eager.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Callable

import ml_collections
import tensorflow as tf
from absl import logging

from trainer import cli
from trainer.checkpoint.storage.steps import steps_for
from trainer.checkpoint.state import CheckpointError
from trainer.config import ConfigError
from trainer.distribution import strategies
from trainer.telemetry.summaries import SummaryWriters
from trainer.trainer import Trainer, resolve_trainer_class

MODES = cli.MODES
EVAL_DIR = "eval"
BEST_EXPORT_DIR = os.path.join(EVAL_DIR, "export", "best")
EVALUATOR_TASK = "evaluator"
DEFAULT_TIMEOUT_S = cli.DEFAULT_EVAL_TIMEOUT_S
POLL_S = 1.0


def check_mode(mode: str, step: int | None = None) -> None:
    """Raises ConfigError for an unknown mode, ``step`` outside ``eval``, or ``train`` in
    the process TF_CONFIG names the ``evaluator`` task."""
    if mode not in MODES:
        raise ConfigError(f"--mode={mode!r} is not one of {', '.join(MODES)}.")
    if step is not None and mode != "eval":
        raise ConfigError(f"--step={step} selects the checkpoint of --mode=eval; "
                          f"--mode={mode} does not take it.")
    if mode == "train" and strategies.tf_config_task_type() == EVALUATOR_TASK:
        raise ConfigError(
            "TF_CONFIG names this process the 'evaluator' task, which does not train (it "
            "would write checkpoints and metrics beside the chief's). Run it with "
            "--mode=continuous_eval, as launch.multiworker --evaluator and the TFJob "
            "Evaluator replica do, or give it a 'chief' or 'worker' task.")


def evaluation_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config`` as an evaluator uses it: without the local checkpoint tier (an
    evaluator reads the workdir's checkpoints, never a training task's local copies),
    on ``one_device`` when the configured strategy would join a multi-worker group
    (``multi_worker``, or ``auto`` with TF_CONFIG set) and, in the process TF_CONFIG
    names the ``evaluator`` task, whatever it is (the evaluator uses one device, leaving
    the others to the training tasks)."""
    if config.checkpoint.local_every_steps:
        config = config.copy_and_resolve_references()
        config.checkpoint.local_every_steps = 0
    name = strategies.resolve_strategy_name(config.distribute)
    evaluator_task = strategies.tf_config_task_type() == EVALUATOR_TASK
    if name == "one_device" or (name != "multi_worker" and not evaluator_task):
        return config
    config = config.copy_and_resolve_references()
    config.distribute.strategy = "one_device"
    config.distribute.device_weights = ()  # a manual-mode setting
    logging.info("evaluating on one device (the configured strategy is %r%s)", name,
                 "; this is the evaluator task" if evaluator_task else "")
    return config


def build_trainer(config: ml_collections.ConfigDict, workdir: str) -> Trainer:
    """The Trainer of ``config.trainer`` on the evaluation strategy, reading ``workdir``.

    Raises ConfigError when the Trainer has no eval dataset.
    """
    trainer = resolve_trainer_class(config.trainer)(evaluation_config(config), workdir)
    if not trainer.has_eval_dataset():
        raise ConfigError(f"{type(trainer).__name__} has no eval dataset; override "
                          f"build_eval_dataset(ctx) to evaluate its checkpoints.")
    return trainer


def evaluate_checkpoint(trainer: Trainer, step: int | None = None) -> tuple[int, dict[str, float]]:
    """Restores the latest (or ``step``'s) checkpoint and evaluates it once.

    Returns ``(step, {"eval/loss": ..., "eval/NAME": ...})``. Raises CheckpointError when
    there is no such checkpoint or it cannot be read.
    """
    restored = trainer.restore(step)
    if restored is None:
        raise CheckpointError(f"{trainer.workdir} holds no checkpoint to evaluate; train "
                              f"first, or pass the --workdir of a run that saved one.")
    return restored, {f"eval/{k}": float(v) for k, v in trainer.evaluate().items()}


class EvalStream:
    """The evaluator's records: ``workdir/eval/metrics.jsonl`` and TensorBoard events in
    ``workdir/eval`` (opened at the first write)."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.path = os.path.join(workdir, EVAL_DIR, "metrics.jsonl")
        self._writers: SummaryWriters | None = None

    def steps(self) -> set[int]:
        """The steps already recorded (lines that do not parse are ignored)."""
        if self._writers is not None:
            self._writers.flush()
        if not tf.io.gfile.exists(self.path):
            return set()
        found = set()
        with tf.io.gfile.GFile(self.path) as f:
            for line in f:
                try:
                    found.add(int(json.loads(line)["step"]))
                except (ValueError, KeyError, TypeError):
                    continue
        return found

    def write(self, step: int, logs: dict[str, float]) -> dict:
        """Appends the record of ``step`` and returns it."""
        if self._writers is None:
            self._writers = SummaryWriters(
                self.workdir, logdirs={"eval": os.path.join(self.workdir, EVAL_DIR)},
                jsonl=self.path, filename_suffix=".evaluator")
        record = {"kind": "eval", "step": int(step), "time": time.time(), **logs}
        self._writers.write(record)
        return record

    def close(self) -> None:
        if self._writers is not None:
            self._writers.close()
            self._writers = None


class BestExport:
    """Exports the best evaluated model by ``checkpoint.best_metric`` (``eval/...`` only;
    inactive otherwise) to ``workdir/eval/export/best``; see the module docstring."""

    def __init__(self, trainer: Trainer):
        cfg = trainer.config.checkpoint
        self.trainer = trainer
        self.metric = cfg.best_metric if cfg.best_metric.startswith("eval/") else ""
        self.sign = 1.0 if cfg.best_mode == "max" else -1.0
        self.target = os.path.join(trainer.workdir, BEST_EXPORT_DIR)
        self.best = -math.inf
        marker = os.path.join(self.target, "best.json")
        if self.metric and tf.io.gfile.exists(marker):  # a restarted evaluator
            with tf.io.gfile.GFile(marker) as f:
                saved = json.load(f).get(self.metric.partition("/")[2])
            self.best = -math.inf if saved is None else self.sign * float(saved)

    def update(self, step: int, logs: dict[str, float]) -> bool:
        """Exports the model as it is now (``step``'s) if ``logs`` beat the best so far."""
        if not self.metric:
            return False
        if self.metric not in logs:
            raise ConfigError(f"config.checkpoint.best_metric={self.metric!r} is not among "
                              f"the eval values ({', '.join(sorted(logs))}).")
        value = float(logs[self.metric])
        if not self.sign * value > self.best:
            return False
        self.best = self.sign * value
        if tf.io.gfile.exists(self.target):
            tf.io.gfile.rmtree(self.target)
        self.trainer.export(self.target)
        with tf.io.gfile.GFile(os.path.join(self.target, "best.json"), "w") as f:
            f.write(json.dumps({"step": int(step), self.metric.partition("/")[2]: value}))
        logging.info("step %d is the best so far (%s=%.6g): exported to %s", step,
                     self.metric, value, self.target)
        return True


class ContinuousEvaluator:
    """Evaluates each new committed checkpoint of ``trainer.workdir`` (module docstring).

    Args:
      trainer: a Trainer built for evaluation (:func:`build_trainer`).
      timeout_s: stop when no new checkpoint appeared for this long (seconds).
      poll_s: seconds between two looks at the checkpoint directories.
      sleep, clock: ``time.sleep`` and ``time.monotonic`` (a test injects its own, e.g.
        a sleep that commits a checkpoint).
    """

    def __init__(self, trainer: Trainer, timeout_s: float = DEFAULT_TIMEOUT_S,
                 poll_s: float = POLL_S, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic):
        self.trainer = trainer
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.sleep, self.clock = sleep, clock
        self.final = trainer.config.train.steps
        self.stream = EvalStream(trainer.workdir)
        self.steps = steps_for(trainer.workdir)  # where its checkpoints live
        self.best = BestExport(trainer)
        self.evaluated: list[int] = []  # the steps this run evaluated, in order
        self.last: dict[str, float] = {}  # the last evaluation: {"step": S, "eval/...": ...}

    def _committed(self) -> list[int]:
        return sorted({s for s, _ in self.steps.candidates(warn_incomplete=False)})

    def run(self) -> list[int]:
        """Runs until the final step is evaluated or the timeout; returns the steps
        evaluated by this call, in order."""
        done = self.stream.steps()
        last = max(done, default=-1)
        if done:
            logging.info("continuous_eval: steps up to %d are already in %s", last,
                         self.stream.path)
        waited_for: set[int] = set()
        since = self.clock()
        logging.info("continuous_eval: watching %s for checkpoints up to step %d (stops "
                     "after %g s without a new one)", self.trainer.workdir, self.final,
                     self.timeout_s)
        try:
            while last < self.final:
                pending = [s for s in self._committed() if s > last]
                if not pending:
                    if self.clock() - since > self.timeout_s:
                        logging.warning("continuous_eval: no new checkpoint in %s for %g s "
                                        "(--eval_timeout_s); stopping at step %d.",
                                        self.trainer.workdir, self.timeout_s, last)
                        break
                    for step in {s for s, _ in self.steps.incomplete()} - waited_for:
                        logging.info("continuous_eval: step %d is being written; waiting "
                                     "for its commit", step)
                        waited_for.add(step)
                    self.sleep(self.poll_s)
                    continue
                step = pending[-1]
                if len(pending) > 1:
                    logging.info("continuous_eval: skipping step(s) %s, superseded by %d "
                                 "while busy", ", ".join(map(str, pending[:-1])), step)
                self._evaluate(step)
                last, since = step, self.clock()
        finally:
            self.stream.close()
        return list(self.evaluated)

    def _evaluate(self, step: int) -> None:
        try:
            _, logs = evaluate_checkpoint(self.trainer, step)
        except CheckpointError as error:
            if step not in self._committed():
                logging.warning("continuous_eval: step %d was removed (checkpoint.max_to_keep) "
                                "before it could be read; skipped.", step)
                return
            if step >= self.final:
                raise
            logging.warning("continuous_eval: skipping step %d: %s", step, error)
            return
        self.stream.write(step, logs)
        self.evaluated.append(step)
        self.last = {"step": step, **logs}
        self.best.update(step, logs)
        logging.info("eval  step %d: %s", step, ", ".join(
            f"{k[5:]}={v:.4g}" for k, v in sorted(logs.items())))


def run(config: ml_collections.ConfigDict, workdir: str, mode: str, step: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, float]:
    """The command line's ``eval`` / ``continuous_eval`` modes (see the module docstring).

    Returns the last evaluation's ``{"step": S, "eval/...": ...}`` (empty when
    continuous_eval evaluated nothing). Raises ConfigError / CheckpointError.
    """
    check_mode(mode, step)
    if mode == "train":
        raise ConfigError("continuous_eval.run evaluates; --mode=train is trainer.fit().")
    trainer = build_trainer(config, workdir)
    if mode == "eval":
        stream = EvalStream(workdir)
        try:
            restored, logs = evaluate_checkpoint(trainer, step)
            stream.write(restored, logs)
        finally:
            stream.close()
        result = {"step": restored, **logs}
        print(json.dumps(result, sort_keys=True), flush=True)
        return result
    evaluator = ContinuousEvaluator(trainer, timeout_s=timeout_s)
    evaluator.run()
    return evaluator.last
