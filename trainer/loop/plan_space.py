"""The execution plan's space (:mod:`trainer.loop.plan`): what a plan is, which plans
are worth timing on a run, and what a plan's measurement depends on. Host only."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import tensorflow as tf

_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Plan:
    """One way to run the train loop: XLA on the replica step, steps per loop call, bytes
    per all-reduce pack of the gradients (0: one batched all-reduce)."""

    xla: str  # "off" | "grads" | "step"
    steps_per_loop: int
    pack_bytes: int = 0

    @property
    def trace_key(self) -> tuple[str, int]:
        """What the traced train loop depends on (plans of one key share its loops)."""
        return self.xla, self.pack_bytes

    def describe(self) -> str:
        packs = (f", all-reduce packs of {self.pack_bytes / _MIB:.3g} MiB"
                 if self.pack_bytes else "")
        return f"xla {self.xla}, steps_per_loop {self.steps_per_loop}{packs}"

    def to_dict(self) -> dict[str, Any]:
        return {"xla": self.xla, "steps_per_loop": self.steps_per_loop,
                "pack_bytes": self.pack_bytes}

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> "Plan":
        """Reads :meth:`to_dict`'s output (a record without ``pack_bytes``: 0)."""
        return cls(str(value["xla"]), int(value["steps_per_loop"]),
                   int(value.get("pack_bytes", 0)))


@dataclasses.dataclass
class Trial:
    """One plan's turn in one round of the planner's trials. Only calls that ran the
    plan's full ``steps_per_loop`` are timed (a call cut short by the run's end or the
    previous trial's says nothing about the plan's length); a trial that sees too few
    full calls times all."""

    plan: int  # index into the candidates
    round: int
    steps: int = 0  # timed
    seconds: float = 0.0
    all_steps: int = 0
    all_seconds: float = 0.0

    def add(self, steps: int, seconds: float, full: bool) -> None:
        self.all_steps += steps
        self.all_seconds += seconds
        if full:
            self.steps += steps
            self.seconds += seconds

    def finished(self, trial_steps: int, steps_per_loop: int) -> bool:
        if self.steps >= trial_steps:
            return True
        if self.all_steps < 4 * max(trial_steps, steps_per_loop):
            return False
        self.steps, self.seconds = self.all_steps, self.all_seconds
        return True


def pack_alternatives(configured: int, variables: list, workers: int) -> tuple[int, ...]:
    """The pack sizes worth timing besides the ``configured`` one: none on one worker
    (the replicas' gradients do not cross hosts) or for gradients under 4 MiB. Else,
    when ``configured`` is 0, packs of half the largest gradient of ``variables`` but
    at least an eighth of all (TensorFlow starts a pack once the last one holds more
    than this: each of the largest layers crosses in a pack of its own, as soon as the
    backward pass has computed it, and there are at most 8 packs or so); one batched
    all-reduce (0) otherwise."""
    sizes = [math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in variables]
    total = sum(sizes)
    if workers <= 1 or total < 4 * _MIB:
        return ()
    if configured:
        return (0,)
    return (max(max(sizes) // 2, -(-total // 8)),)


def candidates(baseline: Plan, log_every_steps: int, xla_allowed: bool,
               pack_sizes: tuple[int, ...] = ()) -> list[Plan]:
    """The plans worth timing, the configured ``baseline`` first (see the module doc);
    ``xla_allowed``: the strategy lets XLA compile the replica step; ``pack_sizes``: the
    pack sizes to time besides the baseline's (:func:`pack_alternatives`)."""
    cap = max(1, log_every_steps)
    loops = [baseline.steps_per_loop]
    if min(2 * baseline.steps_per_loop, cap) > min(baseline.steps_per_loop, cap):
        loops.append(min(2 * baseline.steps_per_loop, cap))
    xlas = [baseline.xla] + [x for x in ("step", "off") if x != baseline.xla and (
        xla_allowed or x == "off")]
    packs = [baseline.pack_bytes] + [p for p in pack_sizes if p != baseline.pack_bytes]
    plans = [Plan(xla, n, p) for xla in xlas for n in loops for p in packs]
    return [baseline] + [p for p in plans if p != baseline]


def signature(strategy: tf.distribute.Strategy, workers: int) -> dict[str, Any]:
    """What a plan's measurement depends on: the devices, the strategy and its size, the
    CPU count and TensorFlow's version. A checkpoint's plan is adopted only when equal."""
    gpus = [tf.config.experimental.get_device_details(gpu).get("device_name", "GPU")
            for gpu in tf.config.list_physical_devices("GPU")]
    kinds = sorted({d.device_type for d in tf.config.list_logical_devices()})
    return {"strategy": type(strategy).__name__,
            "replicas": int(strategy.num_replicas_in_sync), "workers": int(workers),
            "devices": kinds, "gpus": gpus, "cpus": os.cpu_count(),
            "tensorflow": tf.__version__}
