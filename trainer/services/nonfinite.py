"""What a run does about NaN/inf and loss blow-ups between loops: ``train.on_nonfinite``.

The gradient path decides per update, on the all-reduced gradients and identically on
every replica, whether to apply or skip (:mod:`trainer.step.gradients`). This service acts at
loop boundaries:

* ``"stop"``: raises :class:`NonFiniteError` at the first loop that skipped a step.
* ``"rollback"``: when the all-reduced gradients were non-finite on
  ``train.rollback_after`` consecutive steps, or the loop's last loss exceeds
  ``train.loss_upper_bound`` (> 0; Model Garden's recovery condition), every worker
  restores weights and optimizer state from the last checkpoint (the step goes back to
  that checkpoint's step) and training goes on. The data iterator does NOT go back: the
  window that produced the blow-up is skipped, as large-model practice does (so the
  input position no longer equals the step: a later resume from a checkpoint written
  after a rollback repeats those batches). A rollback event (:mod:`trainer.run_context`)
  reports it: one console line and a ``{"kind": "rollback", "step": restored,
  "from_step": ...}`` record in ``metrics.jsonl``. At most ``train.max_rollbacks``
  times; then, or with no checkpoint yet, :class:`NonFiniteError`. Every worker takes
  the same decision: the streak and the loss are all-reduced values.
* every mode: the first logging window whose train loss is NaN/inf logs one warning
  saying what happened to the updates and what to do. (A checkpoint is never written
  with non-finite weights: :mod:`trainer.checkpoint.service` checks before it saves.)
"""

from __future__ import annotations

import math
from typing import Callable

from absl import logging

from trainer.errors import UserError
from trainer.precision import NonFiniteError, NonFinitePolicy
from trainer.run_context import RunContext, Service
from trainer.run_context import RunEvents

__all__ = ["NonFiniteError", "NonFiniteGuard"]


class NonFiniteGuard(Service):
    """Stops or rolls back per ``train.on_nonfinite``; warns once per fit on a NaN loss.

    Args:
      config: the run's config (``train.*``).
      policy: what ``train.on_nonfinite`` means (the gradient path's).
      events: the run's events (a rollback is reported there).
      last_good: ``workdir -> str``: the newest checkpoint that verifies, for the
        messages of a stop and of a rollback with nothing to restore (``"step 200
        (/w/checkpoints/200)"``, ``"none (no complete checkpoint in /w)"``).
    """

    def __init__(self, config, policy: NonFinitePolicy, events: RunEvents,
                 last_good: Callable[[str | None], str]):
        cfg = config.train
        self.last_good = last_good
        self.policy = policy
        self.rollback_after, self.max_rollbacks = cfg.rollback_after, cfg.max_rollbacks
        self.loss_upper_bound = cfg.loss_upper_bound
        self.events = events
        self.rollbacks = 0
        self._skipped_before = 0
        self._warned = False

    def on_fit_start(self, run: RunContext) -> None:
        self._skipped_before = run.precision.counters()[0]
        self._warned = False
        run.precision.worst_streak.assign(0)

    def on_loop_end(self, run: RunContext) -> None:
        if self.policy.stops:
            if run.precision.counters()[0] > self._skipped_before:
                bad = int(run.precision.last_skipped_step.numpy())
                raise NonFiniteError(
                    f"Non-finite gradients (NaN/inf) at step {bad}; the update was not "
                    f"applied (train.on_nonfinite='stop'; the last good checkpoint is "
                    f"{self.last_good(run.workdir)}). Lower the learning rate, enable "
                    f"optimizer.clipnorm, or check the data and the loss for NaN; then "
                    f"run again to resume from that checkpoint.")
        elif self.policy.rolls_back:
            why = self._blow_up(run)
            if why:
                self._rollback(run, why)

    def _blow_up(self, run: RunContext) -> str | None:
        """Why this loop must be rolled back, or None."""
        streak = int(run.precision.worst_streak.numpy())
        run.precision.worst_streak.assign(0)
        if streak >= self.rollback_after:
            return (f"{streak} non-finite step(s) in a row (train.rollback_after="
                    f"{self.rollback_after})")
        if self.loss_upper_bound > 0:
            loss = float(run.last_outputs["loss"])
            if not loss <= self.loss_upper_bound:
                return f"loss {loss:.4g} > train.loss_upper_bound={self.loss_upper_bound:g}"
        return None

    def _rollback(self, run: RunContext, why: str) -> None:
        step = run.step
        if self.rollbacks >= self.max_rollbacks:
            raise NonFiniteError(
                f"Step {step}: {why}, and the run already rolled back {self.rollbacks} "
                f"time(s) (train.max_rollbacks={self.max_rollbacks}). Lower "
                f"optimizer.learning_rate, set optimizer.clipnorm, or check the data.")
        try:
            restored = run.restore()
        except UserError as error:  # e.g. every checkpoint on disk is corrupt
            raise NonFiniteError(f"Step {step}: {why}, and the rollback could not restore "
                                 f"a checkpoint: {error}") from error
        if restored is None:
            raise NonFiniteError(
                f"Step {step}: {why}, and there is no checkpoint to roll back to (the last "
                f"good checkpoint is {self.last_good(run.workdir)}). Set "
                f"checkpoint.every_steps so one exists before a blow-up, or lower "
                f"optimizer.learning_rate.")
        self.rollbacks += 1
        run.gradients.reset_accumulators()
        run.reset_train_window()  # the window's means held the blown-up steps
        run.precision.nonfinite_streak.assign(0)
        self.events.rollback(restored, step, why, self.rollbacks, self.max_rollbacks)

    def on_log(self, run: RunContext, logs: dict[str, float]) -> None:
        loss = logs.get("train/loss", 0.0)
        if math.isfinite(loss) or self._warned:
            return
        self._warned = True
        if run.gradients.checks_finite:
            what = (f"{run.precision.counters()[0]} update(s) skipped so far "
                    f"(precision/skipped_steps)")
        else:
            what = ("updates are NOT checked (train.on_nonfinite='auto' without "
                    "mixed_float16), so the weights may now be NaN; set "
                    "train.on_nonfinite='skip' to skip such updates, 'rollback' to go back "
                    "to the last checkpoint, or 'stop' to stop at the first")
        logging.warning("Train loss is %s in the window ending at step %d: %s. Lower "
                        "optimizer.learning_rate, set optimizer.clipnorm, or check the data "
                        "and compute_loss.", loss, run.step, what)
