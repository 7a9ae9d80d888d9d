"""Manual data parallelism vs Mirrored on equal devices (2 virtual CPU devices).

    python -m benchmarks.parallel.manual [--workloads mlp,cnn] [--rounds 3] [--seconds 2]
                                         [--json F]

One process, 2 logical CPU devices, the same model, Adam, in-memory data and global
batch for every implementation; ``Trainer.fit`` with ``steps_per_loop=50``:

  one_device      the whole batch on /cpu:0 (no splitting)
  mirrored        MirroredStrategy over the 2 devices (all-reduce of the gradients)
  manual          distribute.strategy="manual", weights (1, 1)
  manual_1_3      manual, weights (1, 3): an uneven split on equal devices
  manual_single   manual over ONE device (the mechanism's own cost, no second device)

They run interleaved in rotating order over rounds (warm-up excluded); the table shows
median examples/s, min/max and the median per-round ratio to ``mirrored``.

Overlap: in-graph loops (``steps_per_loop`` iterations, like the real loop) run the
forward and backward of the manual (1, 1) slices without the update: device 0's slice
alone, device 1's alone, and both in one graph. ``both`` close to the SUM of the two is
sequential, close to the MAX fully concurrent. On virtual CPU devices both devices
share this machine's cores and one thread pool, so this shows what TF's executor does
with independent per-device work, not what two GPUs would gain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.common import table
from benchmarks.common.table import Row

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

K = 50  # steps per loop
IMPLEMENTATIONS = {
    "one_device": dict(strategy="one_device"),
    "mirrored": dict(strategy="mirrored"),
    "manual": dict(strategy="manual", device_weights=(1, 1)),
    "manual_1_3": dict(strategy="manual", device_weights=(1, 3)),
    "manual_single": dict(strategy="manual", devices=("/cpu:0",)),
}


def _trainer(workload, distribute: dict):
    from benchmarks.common.workloads import framework_trainer

    return framework_trainer(workload, K, **{
        "telemetry.probe_every_windows": 0, "distribute.virtual_devices": 2, "perf.plan": "fixed",
        **{f"distribute.{key}": value for key, value in distribute.items()}})


def _run(t, steps: int) -> float:
    """Trains ``steps`` more steps; returns the seconds it took."""
    t.config.train.steps = t.step + steps
    start = time.perf_counter()
    t.fit()
    return time.perf_counter() - start


def measure(workload_name: str, rounds: int, seconds: float) -> dict:
    from benchmarks.common.workloads import WORKLOADS

    workload = WORKLOADS[workload_name]
    trainers = {name: _trainer(workload, d) for name, d in IMPLEMENTATIONS.items()}
    for t in trainers.values():
        _run(t, 2 * K)  # trace and warm up
    per_step = _run(trainers["mirrored"], K) / K
    steps = max(K, int(seconds / per_step) // K * K)
    rates: dict[str, list[float]] = {name: [] for name in trainers}
    names = list(trainers)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rates[name].append(steps * workload.batch_size / _run(trainers[name], steps))
    results = {}
    for name, values in rates.items():
        ratios = [v / m for v, m in zip(values, rates["mirrored"])]
        results[name] = {"examples_per_s": statistics.median(values), "min": min(values),
                         "max": max(values), "ratio_to_mirrored": statistics.median(ratios),
                         "ratio_range": (min(ratios), max(ratios))}
    step_ms = 1e3 * workload.batch_size / results["manual"]["examples_per_s"]
    return {"workload": workload_name, "batch": workload.batch_size, "steps_per_round": steps,
            "rounds": rounds, "implementations": results,
            "overlap": dict(overlap(trainers["manual"], rounds), step_ms=step_ms)}


def overlap(t, rounds: int, steps: int = K) -> dict[str, float]:
    """ms per iteration of in-graph loops running the manual (1, 1) slices' forward and
    backward (no update): device 0's slice alone, device 1's alone, and both."""
    import tensorflow as tf

    from trainer import data
    from trainer.distribution.data_parallel import split_sizes

    manual = t.gradients.reducer
    dataset = data.distribute(t.strategy, t.build_train_dataset, t.batch)
    t.context.ensure_built(dataset)
    batch = next(iter(dataset))
    sizes = split_sizes(tf.nest.flatten(batch)[0].shape[0], manual.weights)
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    slices = [tf.nest.map_structure(lambda x, a=a, b=b: x[a:b], batch)
              for a, b in zip(bounds, bounds[1:])]

    def looped(which: tuple[int, ...]):
        @tf.function
        def run(parts):
            total = tf.constant(0.0)
            for _ in tf.range(steps):
                for i in which:
                    _, calls = manual.run_slice(t.train_step, parts[i], manual.devices[i])
                    total += tf.add_n([tf.reduce_sum(g) for c in calls for g in c.grads])
            return total

        return run

    variants = {"device0_ms": (0,), "device1_ms": (1,), "both_ms": (0, 1)}
    fns = {name: looped(which) for name, which in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn(slices).numpy()  # trace
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(slices).numpy()
            times[name].append((time.perf_counter() - start) * 1e3 / steps)
    return {name: statistics.median(values) for name, values in times.items()}


def format_table(run: dict) -> str:
    """One workload's table: the implementations against ``mirrored``, then the overlap
    probe's milliseconds per step."""
    rows = [Row(name, r["examples_per_s"], "ex/s", r["ratio_to_mirrored"], r["ratio_range"],
                (r["min"], r["max"])) for name, r in run["implementations"].items()]
    o = run["overlap"]
    rows += [Row("overlap: device 0 alone", o["device0_ms"], "ms", note="forward+backward"),
             Row("overlap: device 1 alone", o["device1_ms"], "ms", note="forward+backward"),
             Row("overlap: both", o["both_ms"], "ms",
                 note="close to the sum: sequential; to the max: concurrent"),
             Row("full manual step", o["step_ms"], "ms")]
    return table.format_table(f"manual: {run['workload']} (batch {run['batch']}), 2 virtual "
                              f"CPU devices, {run['rounds']} rounds x {run['steps_per_round']} "
                              "steps", rows, "mirrored")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="mlp,cnn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    runs = [measure(w, args.rounds, args.seconds) for w in args.workloads.split(",")]
    print("\n\n".join(format_table(run) for run in runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)


if __name__ == "__main__":
    main()
