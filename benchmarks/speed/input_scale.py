"""Input at scale: the framework's TFDS input path, file vs batch sharding, the service.

    python -m benchmarks.speed.input_scale [--examples 6000] [--files 8] [--rounds 3]
                                           [--seconds 2] [--service_workers 2]

The workload is input-heavy: a TFDS dataset of JPEG-encoded 64x64x3 images
(``synthetic_jpegs``, ``--files`` TFRecord files, built once into ``--data_dir``) whose
pipeline decodes each image and augments it (random crop of a padded image, flip,
brightness), batches of 128. Three comparisons, each printed with ratios:

1. One process, interleaved rounds (rotating order, warm-up excluded), examples/s of
   ``framework``: :func:`models.tfds_data.read_split` (TFDS decodes) + the same
   augment map, through :func:`trainer.data.distribute` (``train.deterministic=True``,
   the default; ``framework_nondet`` with False) vs ``hand_tuned``: the same files read
   with raw tf.data (parallel non-deterministic interleave, one parallel map that
   parses, decodes and augments, prefetch). Target: framework >= 0.95x hand-tuned.
2. Two input pipelines as two concurrent processes (2 workers on this machine), each
   delivering the same number of examples: ``file`` sharding (each reads its own files)
   vs ``data`` sharding (each reads and decodes everything and keeps 1 batch in 2, what
   trainer.data does without file sharding): examples/s per worker and bytes read per
   worker (``/proc/self/io`` ``rchar`` during the measurement).
3. The tf.data service on this machine: ``python -m launch.data_service`` with
   ``--service_workers`` workers, consumed by this process (``config.data.service``
   path, ``distributed_epoch``) vs the local ``framework_nondet`` pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common.table import Row, format_table

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = Path(__file__).resolve().parents[2]
BATCH = 128
SIZE = 64


def _builder(data_dir: str, examples: int, files: int):
    from benchmarks.common.synthetic_jpegs import prepare

    return prepare(data_dir, examples, files)


def _augment(image, label):
    import tensorflow as tf

    image = tf.image.convert_image_dtype(image, tf.float32)
    image = tf.image.resize_with_crop_or_pad(image, SIZE + 8, SIZE + 8)
    image = tf.image.random_crop(image, (SIZE, SIZE, 3))
    image = tf.image.random_flip_left_right(image)
    image = tf.image.random_brightness(image, 0.2)
    return image, tf.cast(label, tf.int32)


def framework_fn(builder, sharding: str = "auto"):
    """The framework's path: read_split (file-sharded when it can) + augment + batch."""
    import tensorflow as tf

    from models import tfds_data

    def fn(ctx):
        ds = tfds_data.read_split(builder, "train", ctx, sharding=sharding)
        ds = ds.map(lambda ex: _augment(ex["image"], ex["label"]),
                    num_parallel_calls=tf.data.AUTOTUNE)
        return ds.shuffle(1024, seed=0).repeat().batch(
            ctx.get_per_replica_batch_size(BATCH), drop_remainder=True)

    return fn


def hand_tuned(builder):
    """Raw tf.data on the same files: what an expert writes for throughput."""
    import tensorflow as tf

    files = [os.path.join(builder.data_dir, f) for f in builder.info.splits["train"].filenames]
    spec = {"image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        ex = tf.io.parse_single_example(record, spec)
        return _augment(tf.io.decode_jpeg(ex["image"], channels=3), ex["label"])

    return (tf.data.Dataset.from_tensor_slices(files).repeat()
            .interleave(tf.data.TFRecordDataset, cycle_length=len(files),
                        num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
            .map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
            .shuffle(1024, seed=0).batch(BATCH, drop_remainder=True)
            .prefetch(tf.data.AUTOTUNE))


def _rate(iterator, seconds: float) -> float:
    """examples/s pulling batches for about ``seconds`` (one batch warm-up excluded)."""
    import tensorflow as tf

    next(iterator)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = next(iterator)
        n += int(tf.nest.flatten(batch)[0].shape[0])
    return n / (time.perf_counter() - start)


def _fresh_rate(make, seconds: float) -> float:
    """examples/s of a fresh iterator of ``make()`` after 1 s of warm-up; the iterator is
    dropped afterwards so it does not prefetch in the background during other timings."""
    iterator = iter(make())
    start = time.perf_counter()
    while time.perf_counter() - start < 1.0:
        next(iterator)
    rate = _rate(iterator, seconds)
    del iterator
    return rate


def _rounds(makers: dict, rounds: int, seconds: float, reference: str) -> dict:
    names = list(makers)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rates[name].append(_fresh_rate(makers[name], seconds))
    out = {}
    for name, values in rates.items():
        ratios = [v / h for v, h in zip(values, rates[reference])]
        out[name] = {"examples_per_s": statistics.median(values), "min": min(values),
                     "max": max(values), f"vs_{reference}": statistics.median(ratios),
                     "ratio_range": (min(ratios), max(ratios))}
    return out


def compare_paths(builder, rounds: int, seconds: float) -> dict:
    import tensorflow as tf

    from trainer import data

    strategy = tf.distribute.get_strategy()
    batch = data.BatchSizes(BATCH, strategy.num_replicas_in_sync)
    makers = {
        "framework": lambda: data.distribute(strategy, framework_fn(builder), batch),
        "framework_nondet": lambda: data.distribute(strategy, framework_fn(builder), batch,
                                                    deterministic=False),
        "hand_tuned": lambda: hand_tuned(builder),
    }
    return _rounds(makers, rounds, seconds, "hand_tuned")


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def one_pipeline(data_dir: str, examples: int, files: int, sharding: str, index: int,
                 num_examples_out: int) -> dict:
    """(In a child process) pipeline ``index`` of 2, as trainer.data builds it."""
    import tensorflow as tf

    builder = _builder(data_dir, examples, files)
    ctx = tf.distribute.InputContext(2, index, 2)
    # What trainer.data.distribute does: the user's fn with ctx; batch-shard if the fn
    # did not shard itself (no file sharding).
    ds = framework_fn(builder, sharding)(ctx)
    if sharding == "data":
        ds = ds.shard(2, index)
    options = tf.data.Options()
    options.deterministic = True
    it = iter(ds.with_options(options).prefetch(tf.data.AUTOTUNE))
    next(it)
    before, start, n = _rchar(), time.perf_counter(), 0
    while n < num_examples_out:
        n += int(next(it)[0].shape[0])
    seconds = time.perf_counter() - start
    return {"examples_per_s": n / seconds, "bytes_read": _rchar() - before, "examples": n}


def compare_sharding(data_dir: str, examples: int, files: int) -> dict:
    out = {}
    per_worker = examples  # each worker delivers 2 half-epochs' worth = one epoch
    for sharding in ("data", "file"):
        procs = [subprocess.Popen(
            [sys.executable, "-m", "benchmarks.speed.input_scale", "--child", sharding, str(i),
             "--data_dir", data_dir, "--examples", str(examples), "--files", str(files)],
            cwd=REPO, stdout=subprocess.PIPE, text=True) for i in range(2)]
        results = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1])
                   for p in procs]
        out[sharding] = {
            "examples_per_s_per_worker": statistics.mean(r["examples_per_s"] for r in results),
            "mb_read_per_worker": statistics.mean(r["bytes_read"] for r in results) / 2**20,
            "examples_per_worker": per_worker}
    out["file_vs_data"] = {
        "examples_per_s": out["file"]["examples_per_s_per_worker"]
        / out["data"]["examples_per_s_per_worker"],
        "bytes_read": out["file"]["mb_read_per_worker"] / out["data"]["mb_read_per_worker"]}
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare_service(builder, workers: int, rounds: int, seconds: float) -> dict:
    import tensorflow as tf

    from trainer import data

    port = _free_port()
    service = subprocess.Popen(
        [sys.executable, "-m", "launch.data_service", "--port", str(port),
         "--workers", str(workers), "--grace_s", "2"], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        strategy = tf.distribute.get_strategy()
        batch = data.BatchSizes(BATCH, strategy.num_replicas_in_sync)
        makers = {
            "local": lambda: data.distribute(strategy, framework_fn(builder), batch,
                                             deterministic=False),
            "service": lambda: data.distribute(strategy, framework_fn(builder), batch,
                                               deterministic=False,
                                               service=f"127.0.0.1:{port}"),
        }
        out = _rounds(makers, rounds, seconds, "local")
    finally:
        service.send_signal(signal.SIGTERM)
        service.wait(60)
    return {"local_examples_per_s": out["local"]["examples_per_s"],
            "service_examples_per_s": out["service"]["examples_per_s"],
            "service_workers": workers, "service_vs_local": out["service"]["vs_local"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=6000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--service_workers", type=int, default=2)
    parser.add_argument("--data_dir", default="/tmp/tf_trainer_input_scale")
    parser.add_argument("--sections", default="paths,sharding,service")
    parser.add_argument("--child", nargs=2, metavar=("SHARDING", "INDEX"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = one_pipeline(args.data_dir, args.examples, args.files, args.child[0],
                              int(args.child[1]), args.examples)
        print(json.dumps(result), flush=True)
        return 0
    builder = _builder(args.data_dir, args.examples, args.files)
    sections = args.sections.split(",")
    report = {"examples": args.examples, "files": args.files, "batch": BATCH}
    if "paths" in sections:
        report["paths"] = compare_paths(builder, args.rounds, args.seconds)
        print(format_table(
            f"input_scale (1): one pipeline, decode + augment from {args.files} TFRecord "
            f"files, batch {BATCH}, {args.rounds} rounds x {args.seconds:g} s",
            [Row(name, r["examples_per_s"], "ex/s", r["vs_hand_tuned"], r["ratio_range"],
                 (r["min"], r["max"])) for name, r in report["paths"].items()],
            "hand_tuned") + "\n")
    if "sharding" in sections:
        report["sharding"] = s = compare_sharding(args.data_dir, args.examples, args.files)
        ratios = {"data": (1.0, 1.0), "file": (s["file_vs_data"]["examples_per_s"],
                                                s["file_vs_data"]["bytes_read"])}
        print(format_table(
            f"input_scale (2): 2 workers (2 processes), each delivering "
            f"{s['data']['examples_per_worker']} examples",
            [Row(f"{name} sharding", s[name]["examples_per_s_per_worker"], "ex/s per worker",
                 ratios[name][0], note=f"{s[name]['mb_read_per_worker']:.1f} MB read per "
                                       f"worker ({ratios[name][1]:.2f}x data sharding's)")
             for name in ("data", "file")], "data sharding") + "\n")
    if "service" in sections:
        report["service"] = v = compare_service(builder, args.service_workers, args.rounds,
                                                args.seconds)
        print(format_table(
            f"input_scale (3): the tf.data service, {v['service_workers']} service workers on "
            "this machine",
            [Row("local", v["local_examples_per_s"], "ex/s", 1.0),
             Row("service", v["service_examples_per_s"], "ex/s", v["service_vs_local"])],
            "local") + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
