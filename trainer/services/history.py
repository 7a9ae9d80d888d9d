"""What ``fit()`` returns: the run's latest ``train/*`` and ``eval/*`` values.

Every ``fit()`` returns the same keys. A ``fit()`` that trains no step (the run is
finished: the notebook cell run again) or evaluates nothing still returns the run's
last values: those of this Trainer's previous ``fit()``, or, after a restore, those the
checkpoint kept (this service's state, ``"history"``); what the ``fit()`` logs and
evaluates replaces them key by key. A checkpoint written before this state existed
restores nothing (the ``fit()`` returns only what it produces itself).
"""

from __future__ import annotations

from typing import Any

from trainer.run_context import RunContext, Service

# Logged every window but not results: they describe the update, not the model.
_NOT_RESULTS = ("train/learning_rate", "train/grad_norm")


class History(Service):
    """Keeps the latest value of every ``train/*`` and ``eval/*`` key (``results``)."""

    checkpoint_key = "history"

    def __init__(self):
        self.results: dict[str, float] = {}
        self._taken: Any = None  # the last restore whose values were taken back

    def checkpoint_state(self) -> dict | None:
        return dict(self.results) or None

    def on_fit_start(self, run: RunContext) -> None:
        resumed = run.last_resume
        if resumed is not None and resumed is not self._taken:
            self._taken = resumed
            saved = resumed.services.get(self.checkpoint_key) or {}
            self.results = {key: float(value) for key, value in saved.items()}

    def on_log(self, run: RunContext, logs: dict[str, float]) -> None:
        self.results.update({k: v for k, v in logs.items() if k.startswith("train/")
                             and k not in _NOT_RESULTS})

    def on_eval_end(self, run: RunContext, logs: dict[str, float]) -> None:
        self.results.update({k: v for k, v in logs.items() if k.startswith("eval/")})
