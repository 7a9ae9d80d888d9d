"""The runtime settings the execution plan does NOT choose: do they pay on this machine?

    python -m benchmarks.speed.runtime_settings threads [--workloads mlp,cnn,transformer]
                                                        [--strategy default|mirrored2]
                                                        [--settings 0/0,1/2,2/1,1/1,2/2,4/4]
                                                        [--rounds 5] [--seconds 3]
    python -m benchmarks.speed.runtime_settings input [--rounds 5] [--seconds 3]

``threads``: TensorFlow's inter-op and intra-op thread pools can be sized only before its
runtime starts, so every setting is its own long-lived process (a child) that trains the
workload with the framework (``perf.plan="fixed"``, ``steps_per_loop`` 100, no XLA,
``--strategy``). Children warm up one after the other; then the parent asks them one
at a time, in rotating order per round, over a pipe, to train for about ``--seconds``
and report examples/s (the idle children wait on their pipe). Settings are
``inter/intra`` thread counts; ``0/0`` is TensorFlow's default (it sizes both pools
itself). Printed: median examples/s and the median per-round ratio to ``0/0``.

``input``: the options of the user's ``tf.data`` pipeline on an input-heavy workload
(:mod:`benchmarks.common.synthetic_jpegs`: JPEG decode + augment per example, batch 128,
through ``trainer.data`` as every run does), trained end to end by the framework in ONE
process, the variants interleaved: ``default`` (what the framework does: AUTOTUNE
everywhere, TF's shared thread pool), ``private_pool_2`` / ``private_pool_4``
(``threading.private_threadpool_size``), ``intra_op_1``
(``threading.max_intra_op_parallelism=1``) and ``prefetch_8`` (an explicit
``prefetch(8)`` before the framework's AUTOTUNE prefetch: a deeper buffer). Two models:
``pool`` (average pooling + dense: input-bound) and ``cnn`` (the throughput benchmark's
conv stack on 64x64: compute and input compete for the 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import table
from benchmarks.common.table import Row, from_rounds

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = Path(__file__).resolve().parents[2]
K = 100  # steps per loop (and per timed chunk) of the thread children's trainers
INPUT_K = 20  # the same for the input part's (a JPEG batch costs far more)
THREAD_SETTINGS = ("0/0", "1/2", "2/1", "1/1", "2/2", "4/4")
INPUT_VARIANTS = ("default", "private_pool_2", "private_pool_4", "intra_op_1", "prefetch_8")


def _train_for(trainer, seconds: float, batch: int) -> float:
    """Trains ``trainer`` in chunks of ``train.steps_per_loop`` steps for about
    ``seconds``: examples/s."""
    chunk = trainer.config.train.steps_per_loop
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        trainer.config.train.steps = trainer.step + chunk
        trainer.fit()
        steps += chunk
    return steps * batch / (time.perf_counter() - start)


def thread_child(workload_name: str, setting: str, strategy_name: str) -> None:
    """(In a child) sizes the pools, warms up, prints ``ready``; then answers every
    ``run SECONDS`` line on stdin with one JSON line ``{"examples_per_s": ...}``."""
    import tensorflow as tf

    from benchmarks.common.throughput_impls import setup_devices
    from benchmarks.common.workloads import WORKLOADS, framework_trainer

    inter, intra = (int(n) for n in setting.split("/"))
    tf.config.threading.set_inter_op_parallelism_threads(inter)
    tf.config.threading.set_intra_op_parallelism_threads(intra)
    workload = WORKLOADS[workload_name]
    trainer = framework_trainer(workload, K, strategy=setup_devices(strategy_name),
                                **{"perf.plan": "fixed"})
    _train_for(trainer, 0.0, workload.batch_size)  # traces; one loop
    _train_for(trainer, 1.0, workload.batch_size)
    print("ready", flush=True)
    for line in sys.stdin:
        seconds = float(line.split()[1])
        print(json.dumps({"examples_per_s": _train_for(trainer, seconds, workload.batch_size)}),
              flush=True)


def _summary(rates: dict[str, list[float]], reference: str) -> dict:
    return {name: {"examples_per_s": row.value, "min": row.spread[0], "max": row.spread[1],
                   f"vs_{reference}": row.ratio, "ratio_range": row.ratio_spread}
            for name, row in ((name, from_rounds(name, values, "ex/s", rates[reference]))
                              for name, values in rates.items())}


def measure_threads(workload_name: str, strategy_name: str, settings: list[str],
                    rounds: int, seconds: float) -> dict:
    children = {}
    try:
        for setting in settings:  # one at a time: warm-ups do not compete
            child = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.speed.runtime_settings", "--thread_child",
                 setting, "--workloads", workload_name, "--strategy", strategy_name],
                cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            children[setting] = child
            while (line := child.stdout.readline()) and line.strip() != "ready":
                pass
            if not line:
                raise RuntimeError(f"thread setting {setting}: the child exited "
                                   f"({child.wait()}) before it was ready")
        rates: dict[str, list[float]] = {s: [] for s in settings}
        names = list(settings)
        for r in range(rounds):
            for setting in names[r % len(names):] + names[:r % len(names)]:
                child = children[setting]
                child.stdin.write(f"run {seconds}\n")
                child.stdin.flush()
                rates[setting].append(json.loads(child.stdout.readline())["examples_per_s"])
            print(f"  {workload_name}: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
        return _summary(rates, settings[0])
    finally:
        for child in children.values():
            child.stdin.close()
            child.wait(timeout=60)


def _jpeg_trainer(builder, model_name: str, variant: str):
    """A framework Trainer on the JPEG pipeline with ``variant``'s options."""
    import keras
    import tensorflow as tf

    import trainer
    from benchmarks.speed.input_scale import BATCH, framework_fn
    from trainer import config as config_lib

    user_fn = framework_fn(builder)

    def with_variant(ctx):
        ds = user_fn(ctx)
        options = tf.data.Options()
        if variant.startswith("private_pool_"):
            options.threading.private_threadpool_size = int(variant.rsplit("_", 1)[1])
        elif variant == "intra_op_1":
            options.threading.max_intra_op_parallelism = 1
        elif variant == "prefetch_8":
            ds = ds.prefetch(8)
        return ds.with_options(options)

    def build():
        layers = [keras.Input((64, 64, 3))]
        if model_name == "cnn":
            for filters in (32, 64):
                layers += [keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
                           keras.layers.MaxPooling2D()]
            layers.append(keras.layers.Conv2D(128, 3, padding="same", activation="relu"))
        layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10),
                   keras.layers.Activation("linear", dtype="float32")]
        return keras.Sequential(layers)

    class JpegTrainer(trainer.Trainer):
        def build_model(self):
            return build()

        def build_train_dataset(self, ctx):
            return with_variant(ctx)

        def compute_loss(self, batch, outputs):
            return keras.losses.sparse_categorical_crossentropy(
                batch[1], outputs, from_logits=True)

    config = config_lib.get_config()
    config.train.global_batch_size = BATCH
    config.train.steps_per_loop = INPUT_K
    config.train.steps = INPUT_K
    config.train.log_every_steps = 10**9
    config.optimizer.name = "adam"
    config.telemetry.progress = "off"
    config.perf.plan = "fixed"
    return JpegTrainer(config, None)


def measure_input(model_name: str, rounds: int, seconds: float, data_dir: str) -> dict:
    from benchmarks.common.synthetic_jpegs import prepare
    from benchmarks.speed.input_scale import BATCH

    builder = prepare(data_dir)
    trainers = {v: _jpeg_trainer(builder, model_name, v) for v in INPUT_VARIANTS}
    for t in trainers.values():
        _train_for(t, 1.0, BATCH)
    rates: dict[str, list[float]] = {v: [] for v in INPUT_VARIANTS}
    names = list(INPUT_VARIANTS)
    for r in range(rounds):
        for variant in names[r % len(names):] + names[:r % len(names)]:
            rates[variant].append(_train_for(trainers[variant], seconds, BATCH))
        print(f"  input/{model_name}: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    return _summary(rates, "default")


def format_table(title: str, results: dict, reference: str) -> str:
    """One row per workload and setting, ratios to ``reference`` (the same workload's)."""
    return table.format_table(title, [
        Row(f"{row} {name}", r["examples_per_s"], "ex/s", r["vs_" + reference],
            r["ratio_range"], (r["min"], r["max"]))
        for row, settings in results.items() for name, r in settings.items()], reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", nargs="?", choices=("threads", "input"), default="threads")
    parser.add_argument("--workloads", default="mlp,cnn,transformer")
    parser.add_argument("--strategy", default="default", choices=("default", "mirrored2"))
    parser.add_argument("--settings", default=",".join(THREAD_SETTINGS),
                        help="threads: inter/intra counts; the first is the reference")
    parser.add_argument("--models", default="pool,cnn", help="input: pool, cnn")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--data_dir", default=os.path.join(tempfile.gettempdir(),
                                                           "tf_trainer_bench_jpegs"))
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--thread_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.thread_child:
        thread_child(args.workloads, args.thread_child, args.strategy)
        return
    if args.part == "threads":
        settings = args.settings.split(",")
        results = {f"{w}/{args.strategy}": measure_threads(
            w, args.strategy, settings, args.rounds, args.seconds)
            for w in args.workloads.split(",")}
        print(format_table(f"runtime_settings threads (inter/intra; 0/0 = TF's default), "
                           f"framework, perf.plan='fixed', {args.rounds} rounds x "
                           f"{args.seconds:g} s", results, settings[0]))
    else:
        results = {f"jpeg/{m}": measure_input(m, args.rounds, args.seconds, args.data_dir)
                   for m in args.models.split(",")}
        print(format_table(f"runtime_settings input: pipeline options, framework end to "
                           f"end, JPEG decode + augment, {args.rounds} rounds x "
                           f"{args.seconds:g} s", results, "default"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
