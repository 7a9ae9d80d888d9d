"""Precision and XLA throughput of the framework, side by side in one process.

    python -m benchmarks.speed.precision [--workloads mlp,cnn] [--rounds 5] [--steps 200]
                                         [--strategy default|one_device]

For each workload of :mod:`benchmarks.common.workloads` (``mlp``: 784->256->10, batch 64;
``digits``: 64->128->10, batch 64; ``cnn``: 32x32x3, conv 32/64/128 + dense, batch 128) it builds one ``Trainer`` per
variant under the default strategy (or ``--strategy one_device``; Adam, synthetic
in-memory data):

  float32, mixed_bfloat16, mixed_float16    precision.policy, perf.jit_compile off
  float32+xla                               precision.policy float32, jit_compile on

Each variant is warmed up (tracing, compilation; excluded), then every round runs each
variant for ``--steps`` steps, in an order rotated by one each round. The table shows
median examples/s over rounds, min/max, and the median of the per-round ratio to
float32. A variant that fails is reported in the table, not fatal.

On a CPU, float16/bfloat16 are emulated and usually SLOWER than float32; the point of
this table on CPU is the framework's overhead per policy (loss scaling, casts), and on
GPU/TPU the speed-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks.common import table
from benchmarks.common.table import Row

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

VARIANTS = {  # name: (precision.policy, perf.jit_compile)
    "float32": ("float32", False),
    "mixed_bfloat16": ("mixed_bfloat16", False),
    "mixed_float16": ("mixed_float16", False),
    "float32+xla": ("float32", True),
}
STEPS_PER_LOOP = 50


def build_trainer(workload, policy: str, jit: bool, strategy: str):
    """A Trainer for ``workload`` with the given policy, XLA setting and strategy name."""
    from benchmarks.common.workloads import framework_trainer

    return framework_trainer(workload, STEPS_PER_LOOP, **{
        "precision.policy": policy, "perf.jit_compile": jit, "distribute.strategy": strategy,
        "telemetry.probe_every_windows": 0, "perf.plan": "fixed"})


def run_steps(t, steps: int) -> float:
    """Trains ``steps`` more steps; returns the wall seconds."""
    t.config.train.steps = t.step + steps
    start = time.perf_counter()
    t.fit()
    return time.perf_counter() - start


def bench_workload(name: str, rounds: int, steps: int, strategy: str) -> list[dict]:
    """Rows ``{workload, variant, median, min, max, ratio}`` (examples/s) or ``error``."""
    from benchmarks.common.workloads import WORKLOADS

    workload = WORKLOADS[name]
    trainers, rows = {}, {}
    for variant, (policy, jit) in VARIANTS.items():
        rows[variant] = {"workload": name, "variant": variant, "rates": []}
        try:
            trainers[variant] = build_trainer(workload, policy, jit, strategy)
            run_steps(trainers[variant], STEPS_PER_LOOP)  # warm-up: tracing and compiling
        except Exception as error:  # noqa: BLE001 — reported in the table
            rows[variant]["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
            trainers.pop(variant, None)
    names = list(trainers)
    for r in range(rounds if names else 0):
        for variant in names[r % len(names):] + names[:r % len(names)]:
            seconds = run_steps(trainers[variant], steps)
            rows[variant]["rates"].append(steps * workload.batch_size / seconds)
    base = rows["float32"].get("rates", [])
    for row in rows.values():
        rates = row.pop("rates")
        if rates:
            row.update(median=statistics.median(rates), min=min(rates), max=max(rates))
            if base:
                ratios = [a / b for a, b in zip(rates, base)]
                row.update(ratio=statistics.median(ratios), ratio_range=(min(ratios), max(ratios)))
    return list(rows.values())


def format_table(title: str, rows: list[dict]) -> str:
    """The rows of :func:`bench_workload` in the benchmarks' table, ratios to float32."""
    return table.format_table(title, [
        Row(f"{row['workload']} {row['variant']}", None, "ex/s", note=f"failed: {row['error']}")
        if "error" in row else
        Row(f"{row['workload']} {row['variant']}", row["median"], "ex/s", row.get("ratio"),
            row.get("ratio_range"), (row["min"], row["max"]))
        for row in rows], "float32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="mlp,cnn")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200,
                        help="steps per variant per round (the cnn and transformer use a quarter)")
    parser.add_argument("--strategy", default="default", choices=("default", "one_device"))
    args = parser.parse_args()
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    rows = []
    for name in args.workloads.split(","):
        steps = args.steps if name in ("mlp", "digits") else max(STEPS_PER_LOOP, args.steps // 4)
        rows += bench_workload(name, args.rounds, steps, args.strategy)
        print(f"{name} done", file=sys.stderr, flush=True)
    print(format_table(f"precision: strategy {args.strategy}, median of {args.rounds} rounds, "
                       "warm-up excluded", rows))


if __name__ == "__main__":
    main()
