"""Periodic evaluation during ``fit()`` as a service.

:class:`PeriodicEvaluation` ends a train loop at every multiple of ``eval.every_steps``
(0: only at the end), evaluates there (``run.evaluate()``, as ``Trainer.evaluate()``: a
full pass, or ``eval.steps`` batches) and announces ``{"eval/loss": ..., "eval/NAME": ...}``
(``run.announce_eval``): every callback's ``on_eval_end`` gets them once this hook
returns. The last step of a run is always evaluated, also when the run stops early.
Only a loop that advanced the step is evaluated: after a rollback
(:mod:`trainer.services.nonfinite`) the restored step was evaluated when first reached,
and evaluating it again would add a duplicate record and count for early stopping as
an evaluation without improvement. Inactive when the Trainer has no eval dataset. A
pass abandoned by a stop signal (:mod:`trainer.loop.eval_pass`) reports nothing; the loop
then saves and exits. ``seconds``: the evaluations' wall time so far (goodput's
evaluation time: :mod:`trainer.telemetry.goodput`).
"""

from __future__ import annotations

import time

from absl import logging

from trainer.loop.eval_pass import EvalAbandoned
from trainer.run_context import RunContext, Service, next_multiple


class PeriodicEvaluation(Service):
    """Evaluates at ``eval.every_steps`` multiples and at the end of training."""

    def __init__(self, config, enabled: bool):
        self.every = config.eval.every_steps
        self.total = config.train.steps
        self.enabled = enabled
        self._evaluated_at: int | None = None
        self._last_step = 0  # the step at the previous loop end (or at the start)
        self.seconds = 0.0  # the evaluations' wall time so far (this process)

    def next_boundary(self, step: int) -> float:
        return next_multiple(step, self.every if self.enabled else 0)

    def _evaluate(self, run: RunContext) -> None:
        started = time.monotonic()
        try:
            logs = {f"eval/{k}": v for k, v in run.evaluate().items()}
        except EvalAbandoned as abandoned:  # a stop signal: the loop saves and exits
            logging.warning("%s", abandoned)
            return
        finally:
            self.seconds += time.monotonic() - started
        self._evaluated_at = run.step
        run.announce_eval(logs)

    def on_fit_start(self, run: RunContext) -> None:
        self._evaluated_at, self._last_step = None, run.step

    def on_loop_end(self, run: RunContext) -> None:
        advanced, self._last_step = run.step > self._last_step, run.step
        if self.enabled and advanced and (run.step >= self.total
                                          or (self.every and run.step % self.every == 0)):
            self._evaluate(run)

    def on_train_end(self, run: RunContext) -> None:
        if run.stopped_by == "preemption":
            return  # save and exit quickly; the restarted run evaluates
        if self.enabled and self._evaluated_at != run.step:
            self._evaluate(run)
