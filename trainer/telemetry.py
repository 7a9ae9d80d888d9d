"""What the run reports while it trains: progress lines with throughput.

A :class:`trainer.loop.Component`: it measures only host-side wall time around each
compiled train loop (no extra device syncs), and logs one line per logging window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ml_collections
from absl import logging

from trainer.loop import Component

if TYPE_CHECKING:
    from trainer.trainer import Trainer


class Telemetry(Component):
    """Per-window throughput and progress logging."""

    def __init__(self, config: ml_collections.ConfigDict):
        self.global_batch_size = config.train.global_batch_size
        self.total_steps = config.train.steps
        self._window_steps = 0
        self._window_seconds = 0.0

    def on_train_loop_end(self, trainer: "Trainer", num_steps: int, seconds: float) -> None:
        self._window_steps += num_steps
        self._window_seconds += seconds

    def on_log(self, trainer: "Trainer", values: dict[str, float]) -> None:
        examples_per_s = self._window_steps * self.global_batch_size / max(
            self._window_seconds, 1e-9)
        logging.info("step %d/%d: %s, %.1f examples/s", trainer.step, self.total_steps,
                     ", ".join(f"{k}={v:.4g}" for k, v in values.items()), examples_per_s)
        self._window_steps, self._window_seconds = 0, 0.0

    def on_eval(self, trainer: "Trainer", values: dict[str, float]) -> None:
        logging.info("eval at step %d: %s", trainer.step,
                     ", ".join(f"{k}={v:.4g}" for k, v in values.items()))
