"""The doctor's section (8), and the measurement behind (5): the execution planner
(:mod:`trainer.loop.plan`) run on the real run until it decides.

The Trainer of the config is built with ``perf.plan="auto"`` measured whatever the
run's length (``perf.plan_min_run_s=0``), an open-ended ``train.steps`` and no training
progress (the run has no end to estimate); it stops at the planner's decision (its
rehearsal's end, :mod:`trainer.loop.rehearsal`, which no deadline interrupts: its
trials are bounded by ``perf.plan_trial_s`` and ``perf.plan_rounds``), or at the first
loop end past the doctor's deadline. The report is the decision's run event
(``{"source", "chosen", "baseline", "plans", ...}``) with ``applicable``.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import ml_collections

from trainer.callbacks import Callback
from trainer.telemetry.progress import plan_line
from trainer.trainer import resolve_trainer_class


class _Deadline(Callback):
    """Stops a run at the first loop end past ``deadline`` (``time.monotonic``)."""

    def __init__(self, deadline: float | None):
        self.deadline = deadline

    def on_loop_end(self, trainer) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            trainer.request_stop("the doctor's time budget is spent")


def measure_plan(config: ml_collections.ConfigDict, deadline: float | None = None,
                 force: bool = False, say: Callable[[str], None] = lambda line: None
                 ) -> dict[str, Any]:
    """(8) The planner's measurement on the real run, stopped once it decides (or at
    ``deadline``, ``time.monotonic``). ``force``: measure even when the config says
    ``perf.plan="fixed"``. ``say`` gets the planner's decision line."""
    if config.perf.plan == "fixed" and not force:
        return {"applicable": False, "note": "perf.plan='fixed': the configured plan runs"}
    measured = copy.deepcopy(config)
    measured.update_from_flattened_dict({
        "perf.plan": "auto", "perf.plan_min_run_s": 0.0, "train.steps": 10**7,
        "telemetry.progress": "off"})
    trainer = resolve_trainer_class(config.trainer)(measured, None,
                                                    callbacks=[_Deadline(deadline)])
    records: list[dict] = []

    def on_event(record: dict) -> None:
        if record["kind"] == "plan":
            records.append(record)
            say(f"doctor:     {plan_line(record)}")
            trainer.request_stop("the plan is measured")

    trainer.events.subscribe(on_event)
    trainer.fit()
    if not records:
        stopped = ("the time budget ran out" if deadline is not None
                   and time.monotonic() > deadline else "the run stopped")
        return {"applicable": False, "note": f"{stopped} before the plan was decided"}
    return {"applicable": True, **{k: v for k, v in records[0].items() if k != "time"}}
