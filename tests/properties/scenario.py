"""Running one drawn :class:`~tests.properties.strategies.Case`: the Trainer, the
callbacks that watch and stop it, and what the run left behind (records, checkpoints,
weights)."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import traceback
from typing import Any

import numpy as np
import tensorflow as tf

import trainer
from tests.support import toy
from tests.properties.strategies import Case


class PoisonableTrainer(toy.ToyTrainer):
    """The toy Trainer; the batch of global step ``config.data.poison_step`` (first
    replica's share; -1: none) holds an inf feature, so that step's gradients are NaN."""

    def build_train_dataset(self, ctx):
        dataset = super().build_train_dataset(ctx)
        poison = self.config.data.get("poison_step", -1)
        if poison < 0:
            return dataset
        bad = poison * (ctx.num_replicas_in_sync // ctx.num_input_pipelines)

        def poison_fn(i, batch):
            x, y = batch
            return tf.where(tf.equal(i, bad), x * float("inf"), x), y

        return dataset.enumerate().map(poison_fn)


class PoisonableEvalTrainer(PoisonableTrainer, toy.ToyEvalTrainer):
    """:class:`PoisonableTrainer` with the toy eval dataset and an accuracy metric."""


class LoopWatch(trainer.Callback):
    """Records the step of every loop end; requests a stop at the first loop end at or
    after ``stop_at`` (None: never)."""

    def __init__(self, stop_at: int | None = None):
        self.stop_at = stop_at
        self.loop_ends: list[int] = []

    def on_loop_end(self, t) -> None:
        self.loop_ends.append(t.step)
        if self.stop_at is not None and t.step >= self.stop_at:
            t.request_stop(f"property test: stop at step {self.stop_at}")


def build_config(case: Case):
    """``tests.support.toy.toy_config()`` with the case's overrides, quiet, jsonl records only."""
    config = toy.on_replicas(toy.toy_config(), case.replicas)
    config.telemetry.progress = "off"
    config.telemetry.loggers = ("jsonl",)
    config.checkpoint.max_to_keep = 100  # every saved step stays visible to the checks
    config.data.poison_step = -1 if case.poison_step is None else case.poison_step
    config.update_from_flattened_dict(case.overrides)
    return config


@dataclasses.dataclass
class Outcome:
    """What one ``fit()`` did: the error it raised (None: returned), the step reached,
    the loop ends seen, the final weights (model, then EMA)."""

    error: BaseException | None
    step: int
    loop_ends: list[int]
    weights: list[np.ndarray]


def fit(case: Case, workdir: str, stop_at: int | None = None) -> Outcome:
    """Builds the case's Trainer on ``workdir`` (resuming what is there) and fits it.

    A ConfigError may come from the constructor or from ``fit()``: both are an outcome.
    """
    watch = LoopWatch(stop_at)
    cls = PoisonableEvalTrainer if case.eval_dataset else PoisonableTrainer
    t = None
    try:
        t = cls(build_config(case), workdir, callbacks=[watch])
        t.fit()
        error = None
    except Exception as e:  # noqa: BLE001 (the outcome is checked by the property)
        error = e
    if t is None:
        return Outcome(error, 0, watch.loop_ends, [])
    weights = [w.copy() for w in t.model.get_weights()]
    if t.ema is not None and t.ema.built:
        weights += [v.numpy() for v in t.ema.variables]
    outcome = Outcome(error, t.step, watch.loop_ends, weights)
    # Free the Trainer now, young (tests/conftest.py says why): a test runs many
    # examples, and their Trainers collected together at its end stall it for seconds.
    # The error keeps its type, message and traceback lines, not the frames' locals.
    if error is not None:
        traceback.clear_frames(error.__traceback__)
    del t
    gc.collect()
    return outcome


def records(workdir: str) -> list[dict[str, Any]]:
    """The records of ``workdir/metrics.jsonl`` in order ([] when there is none)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def checkpoint_steps(workdir: str) -> list[int]:
    """The committed steps in ``workdir/checkpoints``, ascending."""
    path = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(path):
        return []
    return sorted(int(name) for name in os.listdir(path) if name.isdigit())
