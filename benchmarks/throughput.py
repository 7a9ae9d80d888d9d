"""Training throughput: the framework vs the loops a user would write instead.

    python -m benchmarks.throughput --workload mlp --strategy default [--rounds 3]
                                    [--impls a,c] [--seconds 2]
    python -m benchmarks.throughput --all [--json benchmarks/results/throughput.json]

Implementations (same model, Adam, same synthetic in-memory data, same global batch):

  a      this framework's ``Trainer.fit`` with ``steps_per_loop=K`` (``a+xla``: with
         ``perf.jit_compile=True``)
  b      a hand-written ``tf.function`` called once per step
  c      a hand-written ``tf.function`` running K steps in-graph (the reference)
  d      ``keras.Model.fit`` at its defaults
  e      ``keras.Model.fit(steps_per_execution=K)``

They run interleaved in rotating order over rounds in ONE process (warm-up excluded);
the table shows median examples/s, min/max, and the median of the per-round ratio to
(c). A failing implementation is reported in the table, not fatal. Cold start
(process start to first step done) and peak RSS come from separate processes, one per
implementation and repetition (median of ``--cold_runs``). ``--all`` runs each
workload x strategy in its own process (a process hosts one device layout) and prints
one table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

STRATEGIES = ("default", "mirrored2")
IMPLEMENTATIONS = ("a", "a+xla", "b", "c", "d", "e")
COLD_START = ("a", "b", "d")
K = 100  # steps per loop / per execution


def _setup_devices(strategy_name: str):
    import tensorflow as tf

    if strategy_name == "mirrored2":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        return tf.distribute.MirroredStrategy(
            [d.name for d in tf.config.list_logical_devices("CPU")])
    return tf.distribute.get_strategy()


class _Impl:
    """One implementation: ``run(steps)`` trains that many steps (after ``warm_up``)."""

    xla = False

    def warm_up(self, steps: int) -> None:
        self.run(steps)


class Framework(_Impl):
    def __init__(self, workload, strategy, jit: bool):
        from benchmarks.workloads import framework_trainer

        self.trainer = framework_trainer(workload, K, strategy=strategy, **{
            "perf.jit_compile": jit})
        self.xla = self.trainer.steps.jit_compiled  # off with 2+ replicas (logged)

    def run(self, steps: int) -> None:
        self.trainer.config.train.steps = self.trainer.step + steps
        self.trainer.fit()


def _hand_written_step(workload, strategy):
    import keras
    import tensorflow as tf

    with strategy.scope():
        model = workload.build_model()
        optimizer = keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)
    batch = workload.batch_size

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    x, y = workload.data(4096)

    def dataset_fn(ctx):
        per_replica = ctx.get_per_replica_batch_size(batch)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
            per_replica, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    return replica_step, iterator


class HandPerStep(_Impl):
    def __init__(self, workload, strategy):
        import tensorflow as tf

        replica_step, self.iterator = _hand_written_step(workload, strategy)

        @tf.function
        def step(iterator):
            strategy.run(replica_step, args=next(iterator))

        self.step = step

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step(self.iterator)


class HandInGraph(_Impl):
    def __init__(self, workload, strategy):
        import tensorflow as tf

        replica_step, self.iterator = _hand_written_step(workload, strategy)

        @tf.function
        def loop(iterator, n):
            for _ in tf.range(n):
                strategy.run(replica_step, args=next(iterator))

        self.loop = loop

    def run(self, steps: int) -> None:
        import tensorflow as tf

        for _ in range(steps // K):
            self.loop(self.iterator, tf.constant(K))


class KerasFit(_Impl):
    def __init__(self, workload, strategy, steps_per_execution: int):
        import keras
        import tensorflow as tf

        x, y = workload.data(4096)
        with strategy.scope():
            self.model = workload.build_model()
            self.model.compile(
                optimizer=keras.optimizers.Adam(),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=steps_per_execution)
        self.dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
            workload.batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    def run(self, steps: int) -> None:
        self.model.fit(self.dataset, steps_per_epoch=steps, epochs=1, verbose=0)
        self.xla = bool(self.model.jit_compile)


def build(name: str, workload, strategy) -> _Impl:
    return {
        "a": lambda: Framework(workload, strategy, jit=False),
        "a+xla": lambda: Framework(workload, strategy, jit=True),
        "b": lambda: HandPerStep(workload, strategy),
        "c": lambda: HandInGraph(workload, strategy),
        "d": lambda: KerasFit(workload, strategy, 1),
        "e": lambda: KerasFit(workload, strategy, K),
    }[name]()


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text[:120]


def measure(workload_name: str, strategy_name: str, rounds: int, seconds: float,
            only: tuple[str, ...] = IMPLEMENTATIONS) -> dict:
    """Interleaved rounds in this process; returns per-implementation results.

    ``only``: the implementations to run (``c``, the reference of the ratio column,
    is always included).
    """
    from benchmarks.workloads import WORKLOADS

    strategy = _setup_devices(strategy_name)
    workload = WORKLOADS[workload_name]
    selected = [n for n in IMPLEMENTATIONS if n in only or n == "c"]
    impls, errors = {}, {}
    for name in selected:
        try:
            impl = build(name, workload, strategy)
            impl.warm_up(2 * K)
            impls[name] = impl
        except Exception as error:  # reported in the table, not fatal
            errors[name] = _short(error)
    # Steps per timed run: about `seconds` of the reference (c), a multiple of K.
    steps = K
    if "c" in impls:
        start = time.perf_counter()
        impls["c"].run(K)
        per_step = (time.perf_counter() - start) / K
        steps = max(K, int(seconds / per_step) // K * K)
    rates: dict[str, list[float]] = {name: [] for name in impls}
    names = list(impls)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            try:
                start = time.perf_counter()
                impls[name].run(steps)
                rates[name].append(steps * workload.batch_size / (time.perf_counter() - start))
            except Exception as error:
                errors[name] = _short(error)
                impls.pop(name)
                names.remove(name)
                rates.pop(name)
    results = {}
    for name in selected:
        if name in errors:
            results[name] = {"error": errors[name]}
            continue
        values = rates[name]
        ratios = [v / c for v, c in zip(values, rates.get("c", []))]
        results[name] = {
            "examples_per_s": statistics.median(values),
            "min": min(values), "max": max(values),
            "ratio_to_c": statistics.median(ratios) if ratios else None,
            "xla": impls[name].xla, "per_round": values, "ratios_to_c": ratios,
        }
    return {"workload": workload_name, "strategy": strategy_name, "steps_per_round": steps,
            "rounds": rounds, "implementations": results}


def _peak_rss_mb() -> float:
    """This process's own peak resident memory (MB).

    Linux's ``ru_maxrss`` keeps the high-water mark of the process image before
    ``exec`` (here: the benchmark parent that forked it), so ``VmHWM`` is read instead.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cold_start_child(impl: str, workload_name: str, strategy_name: str) -> None:
    """Runs in a fresh process: first step, then K more; prints one JSON line."""
    from benchmarks.workloads import WORKLOADS

    strategy = _setup_devices(strategy_name)
    implementation = build(impl, WORKLOADS[workload_name], strategy)
    implementation.run(1)
    first_step_done = time.time()
    implementation.run(K)
    print(json.dumps({"first_step_done": first_step_done,
                      "peak_rss_mb": _peak_rss_mb()}))


def cold_start(workload_name: str, strategy_name: str, names=COLD_START,
               runs: int = 3) -> dict:
    """Process start -> first step done, and peak RSS, per implementation.

    Each measurement is its own process; the implementations alternate over ``runs``
    repetitions and the medians are reported (one process start varies by 10-20%).
    """
    samples: dict[str, list[tuple[float, float]]] = {impl: [] for impl in names}
    errors: dict[str, str] = {}
    for _ in range(runs):
        for impl in names:
            started = time.time()
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.throughput", "--cold_start_child", impl,
                 "--workload", workload_name, "--strategy", strategy_name],
                capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
            try:
                line = json.loads(proc.stdout.strip().splitlines()[-1])
                samples[impl].append((line["first_step_done"] - started, line["peak_rss_mb"]))
            except (IndexError, json.JSONDecodeError, KeyError):
                errors[impl] = (proc.stderr.strip().splitlines() or ["no output"])[-1][:120]
    out = {}
    for impl in names:
        if not samples[impl]:
            out[impl] = {"error": errors[impl]}
            continue
        seconds = [s for s, _ in samples[impl]]
        out[impl] = {"seconds": statistics.median(seconds), "runs_s": seconds,
                     "peak_rss_mb": statistics.median(r for _, r in samples[impl])}
    return out


def format_table(runs: list[dict]) -> str:
    lines = [f"{'workload':<12}{'strategy':<11}{'impl':<7}{'xla':<6}{'ex/s':>10}"
             f"{'min':>10}{'max':>10}{'vs c':>7}{'cold s':>8}{'rss MB':>8}"]
    for run in runs:
        for name, res in run["implementations"].items():
            cold = run.get("cold_start", {}).get(name, {})
            prefix = f"{run['workload']:<12}{run['strategy']:<11}{name:<7}"
            if "error" in res:
                lines.append(f"{prefix}failed: {res['error']}")
                continue
            ratio = f"{res['ratio_to_c']:.2f}" if res["ratio_to_c"] is not None else "-"
            cold_s = f"{cold['seconds']:.1f}" if "seconds" in cold else ""
            rss = f"{cold['peak_rss_mb']:.0f}" if "peak_rss_mb" in cold else ""
            lines.append(f"{prefix}{str(res['xla']):<6}{res['examples_per_s']:>10.0f}"
                         f"{res['min']:>10.0f}{res['max']:>10.0f}{ratio:>7}{cold_s:>8}{rss:>8}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="mlp", choices=("mlp", "cnn", "transformer"))
    parser.add_argument("--strategy", default="default", choices=STRATEGIES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="target duration of one timed run of the reference")
    parser.add_argument("--all", action="store_true", help="every workload x strategy")
    parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS),
                        help="comma-separated subset of " + ",".join(IMPLEMENTATIONS)
                        + " (c is always run: it is the reference)")
    parser.add_argument("--no_cold_start", action="store_true")
    parser.add_argument("--cold_runs", type=int, default=3,
                        help="processes per implementation for the cold start (median)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--cold_start_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = tuple(args.impls.split(","))
    unknown = sorted(set(names) - set(IMPLEMENTATIONS))
    if unknown:
        parser.error(f"--impls: unknown {unknown}; choose from {','.join(IMPLEMENTATIONS)}")

    if args.cold_start_child:
        cold_start_child(args.cold_start_child, args.workload, args.strategy)
        return
    if args.all:
        runs = []
        for workload in ("mlp", "cnn", "transformer"):
            for strategy in STRATEGIES:
                cmd = [sys.executable, "-m", "benchmarks.throughput", "--workload", workload,
                       "--strategy", strategy, "--rounds", str(args.rounds),
                       "--seconds", str(args.seconds), "--impls", args.impls,
                       "--json", "/dev/stdout"]
                cmd += ["--no_cold_start"] if args.no_cold_start else [
                    "--cold_runs", str(args.cold_runs)]
                print(f"running {workload} / {strategy} ...", file=sys.stderr, flush=True)
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      cwd=Path(__file__).resolve().parent.parent)
                try:
                    runs.append(json.loads(proc.stdout.split("\n%%JSON%%\n")[-1]))
                except json.JSONDecodeError:
                    print(proc.stderr[-2000:], file=sys.stderr)
                    raise
    else:
        run = measure(args.workload, args.strategy, args.rounds, args.seconds, names)
        if not args.no_cold_start:
            run["cold_start"] = cold_start(args.workload, args.strategy,
                                           [n for n in COLD_START if n in names],
                                           args.cold_runs)
        runs = [run]
    machine = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    import tensorflow as tf

    machine["tensorflow"] = tf.__version__
    report = {"machine": machine, "runs": runs}
    if args.json == "/dev/stdout":
        print("\n%%JSON%%\n" + json.dumps(runs[0]))
        return
    print(format_table(runs))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
