"""Early stopping: ``train.early_stopping`` (a service).

After each evaluation (``eval.every_steps``), compares ``metric`` (``"eval/NAME"``) with
the best value so far (``mode`` ``"min"`` or ``"max"``); a value better by more than
``min_delta`` is an improvement (the first evaluation sets the best). The run stops once
``patience`` evaluations after the best one brought no improvement, so a metric that
never improves stops the run after exactly ``patience + 1`` evaluations
(``patience=0``: at the first). The stop goes through
``run.request_stop``: every worker stops at the same step and the final checkpoint
is written; the stop event (:mod:`trainer.run_context`) says why and which step was best. With ``checkpoint.best_metric``
set to the same metric, the best checkpoint is kept in ``workdir/checkpoints_best``.
A metric the evaluation does not produce (or a Trainer without an eval dataset) is a
ConfigError when ``fit()`` starts, before any step, naming the ones it does produce.

The judgement (best value, its step, evaluations since) is kept in every checkpoint
(``services.early_stopping`` in its manifest) and taken back at every restore: a resumed
run stops at the same evaluation as the uninterrupted one, and a rollback forgets the
evaluations after the step it returns to. Each ``fit()`` that does not start from a
restore starts a fresh judgement.
"""

from __future__ import annotations

from typing import Any

from trainer.config import ConfigError
from trainer.run_context import RunContext, Service


class EarlyStopping(Service):
    """Requests a stop when ``config.train.early_stopping.metric`` stops improving."""

    checkpoint_key = "early_stopping"

    def __init__(self, config):
        es = config.train.early_stopping
        self.metric, self.mode = es.metric, es.mode
        self.patience, self.min_delta = es.patience, es.min_delta
        self.best: float | None = None
        self.best_step: int | None = None
        self.since_best = 0
        self._taken: Any = None  # the last restore whose state was taken back

    def checkpoint_state(self) -> dict | None:
        if not self.metric:
            return None
        return {"metric": self.metric, "mode": self.mode, "best": self.best,
                "best_step": self.best_step, "since_best": self.since_best}

    def _take_back(self, run: RunContext) -> None:
        """After a restore not taken back yet: its judgement (a checkpoint written
        without one, or judging another metric or mode: a fresh judgement)."""
        resumed = run.last_resume
        if resumed is None or resumed is self._taken:
            return
        self._taken = resumed
        saved = resumed.services.get(self.checkpoint_key) or {}
        if (saved.get("metric"), saved.get("mode")) != (self.metric, self.mode):
            saved = {}
        self.best, self.best_step = saved.get("best"), saved.get("best_step")
        self.since_best = int(saved.get("since_best", 0))

    def on_fit_start(self, run: RunContext) -> None:
        self.best, self.best_step, self.since_best = None, None, 0
        self._take_back(run)
        if not self.metric:
            return
        field = f"config.train.early_stopping.metric={self.metric!r}"
        if not run.has_eval_dataset:
            raise ConfigError(f"{field} needs an evaluation, but {run.trainer_name} "
                              f"has no eval dataset; override build_eval_dataset(ctx) or "
                              f"set the metric to '' (off).")
        # evaluate() reports exactly eval/loss and eval/NAME of build_metrics().
        produced = sorted({"eval/loss", *(f"eval/{name}" for name in run.eval_metric_names)})
        if self.metric not in produced:
            raise ConfigError(f"{field} is not among the evaluation's values "
                              f"({', '.join(produced)}); use one of them.")

    def _improves(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_eval_end(self, run: RunContext, logs: dict[str, float]) -> None:
        if not self.metric:
            return
        self._take_back(run)  # a rollback since the last evaluation
        value = logs[self.metric]
        if self._improves(value):
            self.best, self.best_step, self.since_best = value, run.step, 1
        else:
            self.since_best += 1
        if self.since_best > self.patience:
            reason = (f"early stopping: {self.metric} did not improve by more than "
                      f"{self.min_delta:g} for {self.patience + 1} evaluation(s); best "
                      f"{self.best:.6g} at step {self.best_step}")
            run.request_stop(reason)
