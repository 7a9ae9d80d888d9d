"""Step-time overhead of the training controls: grad-norm logging and the EMA of the
weights, side by side with a plain run in one process; prints examples/s and ratios.

    python -m benchmarks.controls [--workloads mlp,transformer] [--rounds 5] [--steps 400]

Modes (each its own Trainer on the same workload, Adam, ``steps_per_loop=50``, no
workdir): ``plain`` (``telemetry.grad_norm=False``, no EMA), ``grad_norm`` (the default:
the global norm of the reduced gradients is added up in the graph every update) and
``ema`` (``optimizer.ema_decay=0.999`` on top). Every round runs ``--steps`` more steps of
each mode in a rotating order; the table shows the median examples/s and the median of
the per-round ratios to ``plain``. Targets (issue "training controls"): grad_norm < 2%,
EMA < 5% on the MLP.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODES = {
    "plain": {"telemetry.grad_norm": False},
    "grad_norm": {},
    "ema": {"optimizer.ema_decay": 0.999},
}


def measure(workload_name: str, rounds: int, steps: int) -> dict:
    from absl import logging

    from benchmarks.workloads import WORKLOADS, framework_trainer

    logging.set_verbosity(logging.WARNING)
    workload = WORKLOADS[workload_name]
    trainers = {mode: framework_trainer(workload, 50, **{
        "distribute.strategy": "one_device", "train.log_every_steps": 10**6, **overrides})
        for mode, overrides in MODES.items()}
    for trainer in trainers.values():  # trace and warm up
        trainer.config.train.steps = trainer.step + 100
        trainer.fit()
    rates = {mode: [] for mode in MODES}
    order = list(MODES)
    for r in range(rounds):
        for mode in order[r % len(order):] + order[:r % len(order)]:
            trainer = trainers[mode]
            trainer.config.train.steps = trainer.step + steps
            start = time.perf_counter()
            trainer.fit()
            rates[mode].append(steps * workload.batch_size / (time.perf_counter() - start))
    return {mode: {"examples_per_s": statistics.median(values),
                   "vs_plain": statistics.median(v / p for v, p in zip(values, rates["plain"]))}
            for mode, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="mlp,transformer")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = {}
    print(f"{'workload':<12}{'mode':<12}{'ex/s':>12}{'vs plain':>10}")
    for name in args.workloads.split(","):
        results[name] = measure(name, args.rounds, args.steps)
        for mode, row in results[name].items():
            print(f"{name:<12}{mode:<12}{row['examples_per_s']:>12,.0f}{row['vs_plain']:>10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
