"""What a run does about NaN/inf: ``train.on_nonfinite`` on the host side.

The gradient path decides per update, on the all-reduced gradients and identically on
every replica, whether to apply or skip (:mod:`trainer.gradients`). This service acts
between loops: with ``"stop"`` it raises :class:`NonFiniteError` at the first loop that
skipped a step; whatever the mode, the first logging window whose train loss is NaN/inf
logs one warning saying what happened to the updates and what to do.
"""

from __future__ import annotations

import math
from typing import Any

from absl import logging

from trainer.callbacks import Callback


class NonFiniteError(FloatingPointError):
    """Raised with ``train.on_nonfinite="stop"`` when a step's gradients are NaN/inf."""


class NonFiniteGuard(Callback):
    """Stops on skipped steps under ``"stop"``; warns once per fit on a NaN/inf loss."""

    def __init__(self, config):
        self.stop = config.train.on_nonfinite == "stop"
        self._skipped_before = 0
        self._warned = False

    def on_fit_start(self, trainer: Any) -> None:
        self._skipped_before = int(trainer.precision.skipped_steps.numpy())
        self._warned = False

    def on_loop_end(self, trainer: Any) -> None:
        if self.stop and int(trainer.precision.skipped_steps.numpy()) > self._skipped_before:
            bad = int(trainer.precision.last_skipped_step.numpy())
            raise NonFiniteError(
                f"Non-finite gradients (NaN/inf) at step {bad}; the update was not "
                f"applied (train.on_nonfinite='stop'). Lower the learning rate, enable "
                f"optimizer.clipnorm, or check the data and the loss for NaN.")

    def on_log(self, trainer: Any, logs: dict[str, float]) -> None:
        loss = logs.get("train/loss", 0.0)
        if math.isfinite(loss) or self._warned:
            return
        self._warned = True
        if trainer.gradients.checks_finite:
            what = (f"{int(trainer.precision.skipped_steps.numpy())} update(s) skipped so far "
                    f"(precision/skipped_steps)")
        else:
            what = ("updates are NOT checked (train.on_nonfinite='auto' without "
                    "mixed_float16), so the weights may now be NaN; set "
                    "train.on_nonfinite='skip' to skip such updates or 'stop' to stop at the "
                    "first")
        logging.warning("Train loss is %s in the window ending at step %d: %s. Lower "
                        "optimizer.learning_rate, set optimizer.clipnorm, or check the data "
                        "and compute_loss.", loss, trainer.step, what)
