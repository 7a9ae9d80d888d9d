"""The cost of the replica-consistency check (``distribute.consistency_check``), side by
side with runs without it in one process; prints examples/s, ratios and the milliseconds
of one check.

    python -m benchmarks.overhead.consistency_check [--workloads mlp,transformer] [--rounds 5]
        [--steps 1000] [--replicas 2]

Modes (each its own Trainer on the same workload, Adam, ``steps_per_loop=50``, Mirrored
over ``--replicas`` virtual CPU devices, no workdir): ``off``; ``auto`` (the default: after
the first loop of each ``fit()`` and when training ends;
with a workdir also before each periodic checkpoint); ``every_loop`` (the dearest
cadence). Every round runs one ``fit()`` of ``--steps`` more steps per mode in a rotating
order; the table shows the median examples/s and the median of the per-round ratios to
``off`` (min-max). ``check ms``: one comparison of every variable's copies (the fingerprint
function and the host comparison), the median of 20. Goal: ``auto`` costs < 1 % of a run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.common.table import Row, format_table

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODES = ("off", "auto", "every_loop")


def measure(workload_name: str, rounds: int, steps: int, replicas: int) -> dict:
    from absl import logging

    from benchmarks.common.workloads import WORKLOADS, framework_trainer
    from trainer.distribution.replica_check import ReplicaCheck

    logging.set_verbosity(logging.WARNING)
    workload = WORKLOADS[workload_name]
    trainers = {mode: framework_trainer(workload, 50, **{
        "distribute.strategy": "mirrored", "distribute.virtual_devices": replicas,
        "perf.plan": "fixed", "distribute.consistency_check": mode}) for mode in MODES}
    for trainer in trainers.values():
        trainer.config.train.steps = trainer.step + 100  # trace and warm up
        trainer.fit()
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(rounds):
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
            trainer = trainers[mode]
            trainer.config.train.steps = trainer.step + steps
            start = time.perf_counter()
            trainer.fit()
            rates[mode].append(steps * workload.batch_size / (time.perf_counter() - start))
    trainer = trainers["auto"]
    check = ReplicaCheck(trainer.strategy, [*trainer.model.variables,
                                            *trainer.optimizer.variables])
    check.disagreements()  # traced
    times = []
    for _ in range(20):
        start = time.perf_counter()
        assert not check.disagreements()
        times.append(time.perf_counter() - start)
    results = {"check_ms": 1e3 * statistics.median(times), "variables": len(check.variables)}
    for mode in MODES:
        ratios = [v / o for v, o in zip(rates[mode], rates["off"])]
        results[mode] = {"examples_per_s": statistics.median(rates[mode]),
                         "spread": (min(rates[mode]), max(rates[mode])),
                         "vs_off": statistics.median(ratios),
                         "range": (min(ratios), max(ratios))}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="mlp,transformer")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    for name in args.workloads.split(","):
        result = measure(name, args.rounds, args.steps, args.replicas)
        rows = [Row(mode, result[mode]["examples_per_s"], "ex/s", result[mode]["vs_off"],
                    result[mode]["range"], result[mode]["spread"]) for mode in MODES]
        rows.append(Row("one check", result["check_ms"], "ms",
                        note=f"{result['variables']} variables, median of 20"))
        print(format_table(f"consistency_check: {name}, {args.replicas} Mirrored replicas, "
                           f"{args.rounds} rounds x {args.steps} steps", rows, "off"),
              flush=True)


if __name__ == "__main__":
    main()
