"""Example callbacks (the worked example of docs/guide.md, "Callbacks")."""

from __future__ import annotations

from absl import logging

import trainer


class StopAtMetric(trainer.Callback):
    """Stops training once an evaluation reaches ``target`` for ``metric`` (max mode).

    ``on_eval_end`` runs on every worker with the same (all-reduced) logs, and
    ``request_stop`` is agreed across workers at the loop boundary, so a multi-worker
    run stops everywhere at the same step, saves a final checkpoint and exits 0.
    """

    def __init__(self, metric: str = "eval/accuracy", target: float = 0.95):
        self.metric, self.target = metric, target

    def on_eval_end(self, trainer, logs: dict[str, float]) -> None:
        value = logs[self.metric]
        if value >= self.target:
            logging.info("%s %.4f >= %g at step %d", self.metric, value, self.target,
                         trainer.step)
            trainer.request_stop(f"{self.metric} reached {self.target:g}")
