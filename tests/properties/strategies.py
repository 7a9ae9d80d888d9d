"""Hypothesis strategies for the property tests: one drawn run of the loop.

A :class:`Case` is a config of the loop's cadences and controls on the tiny Trainer of
``tests/support/toy.py``: ``train.steps``, ``train.steps_per_loop``, ``train.log_every_steps``,
``eval.every_steps``, ``checkpoint.every_steps`` (sync or async save),
``perf.grad_accum_steps``, ``optimizer.ema_decay``, ``train.early_stopping``,
``train.on_nonfinite`` with at most one poisoned batch, and a requested stop (the
kill-and-resume property). Values are tiny (every step costs little; tracing a Trainer
dominates) and some draws hold one config mistake on purpose: the property then expects
a ConfigError before any step.

:func:`run_cases` draws any run, mistakes included; :func:`resume_cases` draws
valid runs whose resume the framework promises to be bit-exact (no rollback: a resume
after one repeats batches, as documented; no early stopping: its count of evaluations
without improvement is not part of the checkpoint).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import example
from hypothesis import strategies as st

MAX_STEPS = 12


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn run.

    Attributes:
      overrides: config field (``"train.steps"``, ``"train.early_stopping.metric"``...)
        to value, on top of ``tests.support.toy.toy_config()``.
      replicas: Mirrored replicas over virtual CPU devices (1: one device).
      eval_dataset: whether the Trainer has an eval dataset (and an accuracy metric).
      poison_step: 0-based global step whose batch (first replica's share) holds an
        inf feature; None: every batch is finite.
      stop_at: a callback requests a stop at the first loop end at or after this step
        (then a new Trainer resumes); None: no stop is requested.
    """

    overrides: dict[str, Any]
    replicas: int = 1
    eval_dataset: bool = True
    poison_step: int | None = None
    stop_at: int | None = None

    def get(self, field: str) -> Any:
        return self.overrides[field]


#: Every field a Case sets, at the toy config's values: the base of hand-written cases.
DEFAULTS = {
    "perf.grad_accum_steps": 1, "train.steps": 12, "train.steps_per_loop": 2,
    "train.log_every_steps": 4, "eval.every_steps": 0, "checkpoint.every_steps": 0,
    "checkpoint.async_save": True, "optimizer.ema_decay": 0.0,
    "train.early_stopping.metric": "", "train.early_stopping.mode": "min",
    "train.early_stopping.patience": 0, "train.early_stopping.min_delta": 0.0,
    "train.on_nonfinite": "auto",
}


def written_case(overrides: dict[str, Any], **fields: Any) -> Case:
    """A hand-written Case: :data:`DEFAULTS` with ``overrides``; ``fields`` as in Case."""
    return Case({**DEFAULTS, **overrides}, **fields)


#: Hand-written runs the run property tries first (hypothesis's explicit phase), in
#: every profile: each control at work.
WRITTEN_RUNS = {
    "rollback into an accumulation window": written_case(
        {"perf.grad_accum_steps": 2, "train.steps": 10, "train.steps_per_loop": 3,
         "eval.every_steps": 4, "checkpoint.every_steps": 4, "optimizer.ema_decay": 0.5,
         "train.on_nonfinite": "rollback"}, poison_step=6),
    "unchecked NaN weights are never saved": written_case(
        {"train.steps": 6, "checkpoint.every_steps": 2}, poison_step=2),
    "stop at the poisoned step": written_case(
        {"train.steps": 6, "train.on_nonfinite": "stop"}, poison_step=3),
    "rollback without a checkpoint": written_case(
        {"train.steps": 6, "train.on_nonfinite": "rollback"}, poison_step=1),
    "early stop with EMA and a skipped step": written_case(
        {"train.steps_per_loop": 4, "eval.every_steps": 2, "optimizer.ema_decay": 0.5,
         "train.early_stopping.metric": "eval/loss", "train.early_stopping.patience": 1,
         "train.on_nonfinite": "skip", "checkpoint.every_steps": 3,
         "checkpoint.async_save": False}, poison_step=1),
}


def written_runs_first(replicas: int):
    """Decorator of a ``@given(case=...)`` test: :data:`WRITTEN_RUNS` on ``replicas``
    are its explicit examples."""
    def decorate(test):
        for case in WRITTEN_RUNS.values():
            test = example(case=dataclasses.replace(case, replicas=replicas))(test)
        return test
    return decorate


@st.composite
def _cadences(draw) -> dict[str, Any]:
    """Valid cadences, accumulation window and EMA (multiples of the window where
    validation asks for them)."""
    k = draw(st.sampled_from([1, 2, 3]))
    return {
        "perf.grad_accum_steps": k,
        "train.steps": k * draw(st.integers(1, MAX_STEPS // k)),
        "train.steps_per_loop": draw(st.integers(1, 6)),
        "train.log_every_steps": draw(st.integers(1, 8)),
        "eval.every_steps": draw(st.integers(0, 8)),
        "checkpoint.every_steps": k * draw(st.integers(0, 8 // k)),
        "checkpoint.async_save": draw(st.booleans()),
        "optimizer.ema_decay": draw(st.sampled_from([0.0, 0.5])),
    }


@st.composite
def _early_stopping(draw) -> dict[str, Any]:
    return {
        "train.early_stopping.metric": draw(st.sampled_from(["", "", "eval/loss",
                                                              "eval/accuracy"])),
        "train.early_stopping.mode": draw(st.sampled_from(["min", "max"])),
        "train.early_stopping.patience": draw(st.integers(0, 2)),
        "train.early_stopping.min_delta": draw(st.sampled_from([0.0, 0.01, 1.0])),
    }


#: One mistake a user makes in the config: field -> the wrong value, from the valid ones.
MISTAKES = {
    "train.steps_per_loop": lambda o: 0,
    "train.log_every_steps": lambda o: 0,
    "optimizer.ema_decay": lambda o: 1.0,
    "train.early_stopping.patience": lambda o: -1,
    "train.early_stopping.metric": lambda o: "eval/acuracy",
    "train.steps": lambda o: o["train.steps"] + 1,  # misaligned with perf.grad_accum_steps=2
    "checkpoint.every_steps": lambda o: o["checkpoint.every_steps"] + 1,  # ... likewise
}


@st.composite
def run_cases(draw, replicas: int = 1) -> Case:
    """Any run: cadences, accumulation, EMA, early stopping, on_nonfinite with or
    without a poisoned batch; one in five has one config mistake (:data:`MISTAKES`, or
    early stopping on a Trainer without an eval dataset)."""
    overrides = {**draw(_cadences()), **draw(_early_stopping())}
    eval_dataset = draw(st.integers(0, 3)) > 0
    if draw(st.integers(0, 4)) == 0:
        field = draw(st.sampled_from(sorted(MISTAKES)))
        if field in ("train.steps", "checkpoint.every_steps"):  # aligned to 2, then not
            overrides["perf.grad_accum_steps"] = 2
            overrides["train.steps"] = 2 * max(1, overrides["train.steps"] // 2)
            overrides["checkpoint.every_steps"] = 2 * (overrides["checkpoint.every_steps"] // 2)
        overrides[field] = MISTAKES[field](overrides)
    mode = draw(st.sampled_from(["auto", "skip", "stop", "rollback"]))
    overrides["train.on_nonfinite"] = mode
    poisoned = draw(st.integers(0, 2)) > 0  # mostly: the controls then have work
    poison = draw(st.integers(0, overrides["train.steps"] - 1)) if poisoned else None
    return Case(overrides, replicas, eval_dataset=eval_dataset, poison_step=poison)


@st.composite
def resume_cases(draw, replicas: int = 1) -> Case:
    """A valid run stopped at a drawn step and resumed; skip mode may meet a poisoned
    batch on either side of the stop."""
    overrides = {**DEFAULTS, **draw(_cadences())}  # early stopping off
    k = overrides["perf.grad_accum_steps"]
    overrides["train.steps"] = max(overrides["train.steps"], 2 * k)  # room to stop inside
    mode = draw(st.sampled_from(["auto", "skip"]))
    overrides["train.on_nonfinite"] = mode
    steps = overrides["train.steps"]
    poison = draw(st.integers(0, steps - 1)) if mode == "skip" and draw(st.booleans()) else None
    return Case(overrides, replicas, eval_dataset=draw(st.booleans()), poison_step=poison,
                stop_at=draw(st.integers(1, steps - 1)))
