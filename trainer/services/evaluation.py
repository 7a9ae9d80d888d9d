"""Periodic evaluation during ``fit()`` as a service.

:class:`PeriodicEvaluation` ends a train loop at every multiple of ``eval.every_steps``
(0: only at the end), evaluates there (``trainer.evaluate()``: a full pass, or
``eval.steps`` batches) and hands ``{"eval/loss": ..., "eval/NAME": ...}`` to every
callback's ``on_eval_end``. The last step of a run is always evaluated, also when the
run stops early. Only a loop that advanced the step is evaluated: after a rollback
(:mod:`trainer.services.nonfinite`) the restored step was evaluated when first reached,
and evaluating it again would add a duplicate record and count for early stopping as
an evaluation without improvement. Inactive when the Trainer has no eval dataset.
"""

from __future__ import annotations

import math
from typing import Any

from trainer.callbacks import Callback


class PeriodicEvaluation(Callback):
    """Evaluates at ``eval.every_steps`` multiples and at the end of training."""

    def __init__(self, config, enabled: bool):
        self.every = config.eval.every_steps
        self.total = config.train.steps
        self.enabled = enabled
        self._evaluated_at: int | None = None
        self._last_step = 0  # the step at the previous loop end (or at the start)

    def next_boundary(self, step: int) -> float:
        if not (self.enabled and self.every):
            return math.inf
        return (step // self.every + 1) * self.every

    def _evaluate(self, trainer: Any) -> None:
        logs = {f"eval/{k}": v for k, v in trainer.evaluate().items()}
        self._evaluated_at = trainer.step
        trainer.callbacks.on_eval_end(trainer, logs)

    def on_fit_start(self, trainer: Any) -> None:
        self._evaluated_at, self._last_step = None, trainer.step

    def on_loop_end(self, trainer: Any) -> None:
        advanced, self._last_step = trainer.step > self._last_step, trainer.step
        if self.enabled and advanced and (trainer.step >= self.total
                                          or (self.every and trainer.step % self.every == 0)):
            self._evaluate(trainer)

    def on_train_end(self, trainer: Any) -> None:
        if trainer.driver.stopped_by == "preemption":
            return  # save and exit quickly; the restarted run evaluates
        if self.enabled and self._evaluated_at != trainer.step:
            self._evaluate(trainer)
