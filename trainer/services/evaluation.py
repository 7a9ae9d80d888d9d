"""Periodic evaluation during ``fit()`` as a service.

:class:`PeriodicEvaluation` ends a train loop at every multiple of ``eval.every_steps``
(0: only at the end), evaluates there (``trainer.evaluate()``: a full pass, or
``eval.steps`` batches) and hands ``{"eval/loss": ..., "eval/NAME": ...}`` to every
callback's ``on_eval_end``. The last step of a run is always evaluated, also when the
run stops early. Inactive when the Trainer has no eval dataset. A pass abandoned by a
stop signal (:mod:`trainer.eval_pass`) reports nothing; the loop then saves and exits.
"""

from __future__ import annotations

import math
from typing import Any

from absl import logging

from trainer.callbacks import Callback
from trainer.eval_pass import EvalAbandoned


class PeriodicEvaluation(Callback):
    """Evaluates at ``eval.every_steps`` multiples and at the end of training."""

    def __init__(self, config, enabled: bool):
        self.every = config.eval.every_steps
        self.total = config.train.steps
        self.enabled = enabled
        self._evaluated_at: int | None = None

    def next_boundary(self, step: int) -> float:
        if not (self.enabled and self.every):
            return math.inf
        return (step // self.every + 1) * self.every

    def _evaluate(self, trainer: Any) -> None:
        try:
            logs = {f"eval/{k}": v for k, v in trainer.evaluate().items()}
        except EvalAbandoned as abandoned:  # a stop signal: the loop saves and exits
            logging.warning("%s", abandoned)
            return
        self._evaluated_at = trainer.step
        trainer.callbacks.on_eval_end(trainer, logs)

    def on_fit_start(self, trainer: Any) -> None:
        self._evaluated_at = None

    def on_loop_end(self, trainer: Any) -> None:
        if self.enabled and (trainer.step >= self.total
                             or (self.every and trainer.step % self.every == 0)):
            self._evaluate(trainer)

    def on_train_end(self, trainer: Any) -> None:
        if trainer.driver.stopped_by == "preemption":
            return  # save and exit quickly; the restarted run evaluates
        if self.enabled and self._evaluated_at != trainer.step:
            self._evaluate(trainer)
