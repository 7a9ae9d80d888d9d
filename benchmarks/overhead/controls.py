"""Step-time overhead of the training controls: grad-norm logging and the EMA of the
weights, side by side with a plain run in one process; prints examples/s and ratios.

    python -m benchmarks.overhead.controls [--workloads mlp,transformer] [--rounds 5]
                                           [--steps 400]

Modes (each its own Trainer on the same workload, Adam, ``steps_per_loop=50``, no
workdir): ``plain`` (``telemetry.grad_norm=False``, no EMA), ``grad_norm`` (the default:
the global norm of the reduced gradients is added up in the graph every update) and
``ema`` (``optimizer.ema_decay=0.999`` on top: the framework's EMA, one XLA-compiled
update per step on one replica). ``--ema_variants`` adds the other implementations of
the same EMA on top of ``grad_norm`` (benchmarks/common/ema_variants.py): ``ema_ops`` (three
TensorFlow ops per variable, ``fused=False``: the unfused implementation),
``ema_gd`` (two ops: a difference and ``ResourceApplyGradientDescent``) and
``ema_every4`` / ``ema_every10`` (the fused update every N updates with decay d**N).

Every round runs ``--steps`` more steps of each mode in a rotating order; the table shows
the median examples/s, the median of the per-round ratios to ``plain`` and their range
(min-max), in wall time and in this process's CPU time (less sensitive to other
processes on a shared machine), and the ratio of the best rounds (max examples/s of the
mode over that of ``plain``: the least disturbed round of each). Targets (issue "training controls"): grad_norm < 2%,
EMA < 5% on the MLP.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.common.table import Row, format_table

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

DECAY = 0.999
MODES = {
    "plain": {"telemetry.grad_norm": False},
    "grad_norm": {},
    "ema": {"optimizer.ema_decay": DECAY},
}
EMA_VARIANTS = ("ema_ops", "ema_gd", "ema_every4", "ema_every10")


def variant_ema(mode: str, trainer):
    """The EMA object of an ``--ema_variants`` mode (replaces the trainer's own)."""
    from benchmarks.common import ema_variants
    from trainer.step.ema import ExponentialMovingAverage

    if mode == "ema_ops":
        return ExponentialMovingAverage(DECAY, fused=False)
    if mode == "ema_gd":
        return ema_variants.ApplyGradientDescentEMA(DECAY)
    n = int(mode[len("ema_every"):])
    return ema_variants.EveryNEMA(DECAY, n, lambda: trainer.optimizer.iterations)


def measure(workload_name: str, rounds: int, steps: int, modes: list[str]) -> dict:
    from absl import logging

    from benchmarks.common.workloads import WORKLOADS, framework_trainer

    logging.set_verbosity(logging.WARNING)
    workload = WORKLOADS[workload_name]
    trainers = {mode: framework_trainer(workload, 50, **{
        "distribute.strategy": "one_device", "train.log_every_steps": 10**6, "perf.plan": "fixed",
        **MODES.get(mode, MODES["ema"])}) for mode in modes}
    for mode, trainer in trainers.items():
        if mode not in MODES:  # before the first fit builds and traces the EMA
            trainer.ema = trainer.gradients.ema = variant_ema(mode, trainer)
        trainer.config.train.steps = trainer.step + 100  # trace and warm up
        trainer.fit()
    rates = {mode: {"wall": [], "cpu": []} for mode in modes}
    for r in range(rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            trainer = trainers[mode]
            trainer.config.train.steps = trainer.step + steps
            start, cpu_start = time.perf_counter(), time.process_time()
            trainer.fit()
            examples = steps * workload.batch_size
            rates[mode]["wall"].append(examples / (time.perf_counter() - start))
            rates[mode]["cpu"].append(examples / (time.process_time() - cpu_start))
    results = {}
    for mode, clocks in rates.items():
        row = {"examples_per_s": statistics.median(clocks["wall"]),
               "spread": (min(clocks["wall"]), max(clocks["wall"])),
               "best_vs_plain": max(clocks["wall"]) / max(rates["plain"]["wall"])}
        for clock, values in clocks.items():
            ratios = [v / p for v, p in zip(values, rates["plain"][clock])]
            row[f"vs_plain_{clock}"] = statistics.median(ratios)
            row[f"range_{clock}"] = (min(ratios), max(ratios))
        results[mode] = row
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="mlp,transformer")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--ema_variants", action="store_true",
                        help=f"also measure {', '.join(EMA_VARIANTS)}")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    modes = list(MODES) + (list(EMA_VARIANTS) if args.ema_variants else [])
    results = {}
    for name in args.workloads.split(","):
        results[name] = measure(name, args.rounds, args.steps, modes)
        rows = [Row(mode, row["examples_per_s"], "ex/s", row["vs_plain_wall"],
                    row["range_wall"], row["spread"],
                    note=f"cpu time: {row['vs_plain_cpu']:.3f} [{row['range_cpu'][0]:.2f}.."
                         f"{row['range_cpu'][1]:.2f}]; best rounds {row['best_vs_plain']:.3f}")
                for mode, row in results[name].items()]
        print(format_table(f"controls: {name}, {args.rounds} rounds x {args.steps} steps",
                           rows, "plain"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
