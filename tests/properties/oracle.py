"""What a drawn run must do, from the documented rules (README "How a run is driven",
"Training controls", "Checkpoints"), written independently of the loop driver.

:func:`config_error_fields` says which fields a ConfigError must name (before any step).
:func:`simulate` walks the run loop by loop: where loops end (every ``steps_per_loop``
steps, cut at every multiple of ``log_every_steps``, ``eval.every_steps`` and
``checkpoint.every_steps`` and at ``train.steps``), which records ``metrics.jsonl``
gets in which order, which steps are checkpointed, where a poisoned batch skips an
update, rolls back or stops the run, where a requested or early stop ends it (at the
end of an accumulation window). Early stopping depends on the evaluation values the
run produced: the simulation reads them in order from the actual records and applies
the documented rule to them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Sequence

from tests.properties.strategies import Case


def config_error_fields(case: Case) -> set[str]:
    """The invalid drawn fields (one of them must be named), empty when the config is
    valid."""
    o = case.overrides
    k = o["perf.grad_accum_steps"]
    bad = {field for field in ("train.steps_per_loop", "train.log_every_steps")
           if o[field] < 1}
    bad |= {field for field in ("train.steps", "checkpoint.every_steps") if o[field] % k}
    if not 0 <= o["optimizer.ema_decay"] < 1:
        bad.add("optimizer.ema_decay")
    if o["train.early_stopping.patience"] < 0:
        bad.add("train.early_stopping.patience")
    metric = o["train.early_stopping.metric"]
    produced = ("eval/loss", "eval/accuracy") if case.eval_dataset else ()
    if metric and metric not in produced:  # a typo, or no evaluation at all
        bad.add("train.early_stopping.metric")
    return bad


def _next_multiple(step: int, every: int) -> float:
    return (step // every + 1) * every if every > 0 else math.inf


class EarlyStoppingRule:
    """The documented rule: the first evaluation sets the best; a value better by more
    than ``min_delta`` is a new best; the stop comes once ``patience`` evaluations after
    the best brought no improvement (``patience=0``: at the first evaluation)."""

    def __init__(self, case: Case):
        o = case.overrides
        self.metric = o["train.early_stopping.metric"]
        self.mode = o["train.early_stopping.mode"]
        self.patience = o["train.early_stopping.patience"]
        self.min_delta = o["train.early_stopping.min_delta"]
        self.best: float | None = None
        self.without_improvement = 0

    def stops_after(self, record: dict) -> bool:
        if not self.metric:
            return False
        value = record.get(self.metric, math.nan)
        better = (value < self.best - self.min_delta if self.mode == "min"
                  else value > self.best + self.min_delta) if self.best is not None else True
        if better:
            self.best, self.without_improvement = value, 0
        else:
            self.without_improvement += 1
        return self.without_improvement >= self.patience


@dataclasses.dataclass
class Expected:
    """The simulated run: ``records`` as ``(kind, step, loss_is_nan)`` for train
    records and ``(kind, step, None)`` for the others, in file order; the checkpointed
    steps; the step it ends at; ``error``: "nonfinite" when it must end in a
    NonFiniteError (else None); ``rollback_loop``: (loop start, checkpoint step, loop
    end, that end is logged) of a rollback."""

    records: list[tuple[str, int, bool | None]] = dataclasses.field(default_factory=list)
    saved: set[int] = dataclasses.field(default_factory=set)
    final: int = 0
    error: str | None = None
    rollback_loop: tuple[int, int, int, bool] | None = None


class _Run:
    """The state the simulation carries from loop to loop."""

    def __init__(self, case: Case, start: int, evals: Iterator[dict], stop_at: int | None):
        o = case.overrides
        self.case, self.o = case, o
        self.total, self.k = o["train.steps"], o["perf.grad_accum_steps"]
        self.eval_on = case.eval_dataset
        self.eval_every = o["eval.every_steps"] if case.eval_dataset else 0
        self.ckpt = o["checkpoint.every_steps"]
        self.mode = o["train.on_nonfinite"]
        self.evals, self.stop_at = evals, stop_at
        self.rule = EarlyStoppingRule(case)
        self.step, self.window, self.window_nan = start, 0, False
        self.weights_nan = False
        self.poison = case.poison_step  # None once its batch is consumed
        self.stop = False
        self.evaluated_at: int | None = None
        self.out = Expected(saved=set())

    def poisoned_update(self, a: int, b: int) -> int | None:
        """The step whose update the poisoned batch spoils, when in the loop (a, b]: the
        end of the accumulation window of micro-step ``poison + 1``."""
        if self.poison is None or not a <= self.poison < b:
            return None
        return -(-(self.poison + 1) // self.k) * self.k

    def evaluate(self) -> None:
        self.out.records.append(("eval", self.step, None))
        self.evaluated_at = self.step
        if self.rule.stops_after(next(self.evals, {})):
            self.stop = True

    def save(self) -> None:
        """A checkpoint; NaN weights are never saved: the run ends in an error instead."""
        if self.weights_nan:
            self.out.error = "nonfinite"
        else:
            self.out.saved.add(self.step)


def simulate(case: Case, eval_records: Sequence[dict], start: int = 0,
             stop_at: int | None = None) -> Expected:
    """The run of ``case`` from ``start`` (a resume) with a stop requested at the first
    loop end at or after ``stop_at``; ``eval_records``: the run's eval records in order
    (their values drive early stopping)."""
    r = _Run(case, start, iter(eval_records), stop_at)
    o, out = r.o, r.out
    spillover = None  # the update a poisoned micro-step spoils, once its window ends
    while r.step < r.total:
        a = r.step
        b = int(min(a + o["train.steps_per_loop"], r.total,
                    _next_multiple(a, o["train.log_every_steps"]),
                    _next_multiple(a, r.eval_every), _next_multiple(a, r.ckpt)))
        if r.poison is not None and a <= r.poison < b:
            r.window_nan, spillover, r.poison = True, r.poisoned_update(a, b), None
        spoiled = spillover is not None and a < spillover <= b
        # A step's loss comes before its update: NaN weights spoil the steps after it.
        r.window_nan = r.window_nan or r.weights_nan or (
            spoiled and r.mode == "auto" and spillover < b)
        if spoiled:
            spillover = None
            r.weights_nan = r.mode == "auto"
        r.step, r.window = b, r.window + b - a
        if b % o["train.log_every_steps"] == 0 or b == r.total:
            out.records.append(("train", b, r.window_nan))
            r.window, r.window_nan = 0, False
        # on_loop_end, services in their order: non-finite guard, evaluation (+ early
        # stopping), checkpoints, then the test's stop request.
        if spoiled and r.mode == "stop":
            out.error, out.final = "nonfinite", b
            return out
        if spoiled and r.mode == "rollback":
            restored = (a // r.ckpt) * r.ckpt if r.ckpt else 0
            if restored <= 0:
                out.error, out.final = "nonfinite", b
                return out
            out.rollback_loop = (a, restored, b, b % o["train.log_every_steps"] == 0
                                 or b == r.total)
            out.records.append(("rollback", restored, None))
            r.step, r.window_nan = restored, False
        # Only a loop that advanced the step is evaluated (not the step a rollback restored).
        if r.eval_on and r.step == b and (r.step >= r.total
                                          or (r.eval_every and r.step % r.eval_every == 0)):
            r.evaluate()
        if r.step >= r.total or (r.ckpt and r.step % r.ckpt == 0):
            r.save()
            if out.error:
                out.final = r.step
                return out
        if stop_at is not None and r.step >= stop_at:
            r.stop = True
        if r.stop and r.step < r.total and r.step % r.k == 0:
            break
    if r.window:
        out.records.append(("train", r.step, r.window_nan))
    if r.eval_on and r.evaluated_at != r.step:
        r.evaluate()
    if r.step < r.total:
        r.save()
    out.final = r.step
    return out


def hits_rollback_telemetry_crash(case: Case) -> bool:
    """A rollback whose poisoned loop began at the checkpoint it returns to and ended at
    a logging boundary: the replayed loop ends where the discarded one did, and the
    telemetry service's window then holds no loop (IndexError). Fixed on the
    user-code-errors branch; the properties here leave that combination to it."""
    if case.overrides["train.on_nonfinite"] != "rollback" or config_error_fields(case):
        return False
    # Without early stopping (its stop depends on the run's values): at least as many loops.
    whole = dataclasses.replace(case, overrides={**case.overrides,
                                                 "train.early_stopping.metric": ""})
    loop = simulate(whole, ()).rollback_loop
    return loop is not None and loop[0] == loop[1] and loop[3]
