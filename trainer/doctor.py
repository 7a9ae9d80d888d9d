"""The performance doctor: why is this run as fast as it is, in one command.

    python -m trainer.doctor --config=models/configs/digits.py [--steps 100] [--json] \
        [--memory_budget_mb 4096] [--config.train.global_batch_size=256 ...]

Builds the configured Trainer (no workdir: nothing is written) and measures, each as
examples/s after one untimed warm-up loop call (tracing): the median over chunks of
``--steps`` steps, repeated for at least one second (the machine may be shared):

1. ``baseline``: the real run: real input pipeline, real train step, the configured
   ``steps_per_loop`` in-graph loop.
2. ``input``: the input pipeline alone (the distributed dataset pulled in an in-graph
   loop, no model; :class:`trainer.probes.InputProbe`).
3. ``compute``: the same train step on one cached batch (``take(1).cache().repeat()``
   of the same pipeline), so no input cost.
4. ``batch``: the largest global batch that fits, doubling from the configured one up
   to ``--max_batch_doublings`` times; each candidate is a fresh Trainer timed like (3).
   On GPU a candidate that raises ``ResourceExhaustedError`` stops the search; on CPU
   the process's peak RSS must stay under ``--memory_budget_mb`` (default: half the RAM).
5. ``jit``: (3) with ``perf.jit_compile`` flipped (not applied with several replicas).
6. ``communication``: with N > 1 replicas, (3) on ONE replica with the same
   per-replica batch, in a subprocess (a process hosts one Mirrored group size); the
   extra step time of N replicas is the communication share. On virtual CPU devices
   the replicas also share the same cores, so the share includes that contention.
7. ``layers``: the top layers by forward + backward time, each timed alone on random
   inputs of its real input shape (per-replica batch) in an in-graph loop, with
   parameter and activation (output) memory. Needs layers with a known input
   (Sequential / functional models); others are listed as not timed.
8. ``verdict``: ``input-bound``, ``compute-bound`` or ``communication-bound`` with the
   numbers and what to do.

Output: a table, or with ``--json`` one JSON object with the keys above.
"""

from __future__ import annotations

import copy
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import ml_collections
import psutil

Report = dict[str, Any]
MIN_SECONDS = 1.0  # each measurement repeats its chunk of steps at least this long
SECTIONS = ("baseline", "input", "compute", "batch", "jit", "communication", "layers")


# --------------------------------------------------------------------------- helpers
def _with(config: ml_collections.ConfigDict, **overrides: Any) -> ml_collections.ConfigDict:
    """A copy of ``config`` with ``section__field=value`` overrides."""
    config = copy.deepcopy(config)
    with config.unlocked():
        for key, value in overrides.items():
            section, field = key.split("__")
            config[section][field] = value
    return config


def _build(config: ml_collections.ConfigDict):
    from trainer import config as config_lib

    cls = config_lib.resolve_trainer_class(config.trainer)
    return cls(config, None)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _median_seconds(chunk: Callable[[], float], min_seconds: float) -> float:
    """Median of repeated ``chunk()`` timings (at least 3, until ``min_seconds`` total).

    The machine may be shared: the median of several chunks resists other processes'
    bursts better than one long timing.
    """
    times: list[float] = []
    while len(times) < 3 or sum(times) < min_seconds:
        times.append(chunk())
        if len(times) >= 50:
            break
    return statistics.median(times)


def _loop_rate(trainer, dataset_fn: Callable, steps: int,
               min_seconds: float = MIN_SECONDS) -> dict[str, float]:
    """examples/s of the train loop on ``dataset_fn``'s data: median over chunks of
    ``steps`` steps (run as ``steps_per_loop`` calls) after one warm-up call."""
    import tensorflow as tf

    from trainer import data, loop

    cfg = trainer.config
    dist = data.distribute(trainer.strategy, dataset_fn, cfg.train.global_batch_size,
                           deterministic=cfg.train.deterministic)
    loop._ensure_built(trainer, dist)
    loops = loop._loops(trainer)
    iterator = iter(dist)
    per_call = max(1, min(cfg.train.steps_per_loop, steps))
    float(loops.train(iterator, tf.constant(per_call, tf.int64))["loss"])  # trace + warm up

    def chunk() -> float:
        done, start = 0, time.perf_counter()
        while done < steps:
            n = min(per_call, steps - done)
            outputs = loops.train(iterator, tf.constant(n, tf.int64))
            done += n
        float(outputs["loss"])  # wait for the device
        return time.perf_counter() - start

    seconds = _median_seconds(chunk, min_seconds)
    return {"examples_per_s": steps * cfg.train.global_batch_size / seconds,
            "step_ms": 1e3 * seconds / steps, "steps": steps}


def _cached(trainer) -> Callable:
    """``build_train_dataset`` reduced to one cached batch, repeated."""
    return lambda ctx: trainer.build_train_dataset(ctx).take(1).cache().repeat()


# --------------------------------------------------------------------------- sections
def measure_baseline(trainer, steps: int) -> Report:
    """(1) The real pipeline and the real step."""
    return _loop_rate(trainer, trainer.build_train_dataset, steps)


def measure_input(trainer, steps: int) -> Report:
    """(2) The distributed input pipeline alone."""
    from trainer import probes

    probe = probes.InputProbe(trainer)
    seconds = _median_seconds(lambda: steps * probe.seconds_per_batch(steps), MIN_SECONDS) / steps
    return {"examples_per_s": trainer.config.train.global_batch_size / seconds,
            "batch_ms": 1e3 * seconds, "batches": steps}


def measure_compute(trainer, steps: int) -> Report:
    """(3) The same train step on one cached batch."""
    return _loop_rate(trainer, _cached(trainer), steps)


def search_batch(config: ml_collections.ConfigDict, steps: int, doublings: int,
                 memory_budget_mb: float) -> Report:
    """(4) Doubles the global batch while it fits; times each candidate like (3)."""
    import tensorflow as tf

    from trainer import distribute

    tried: list[dict[str, Any]] = []
    stop_reason = f"reached the search bound ({doublings} doublings)"
    batch = config.train.global_batch_size
    for _ in range(doublings + 1):
        candidate = _with(config, train__global_batch_size=batch)
        row: dict[str, Any] = {"global_batch_size": batch}
        try:
            trainer = _build(candidate)
            devices = distribute.accelerator_devices(trainer.strategy)
            for device in devices:
                tf.config.experimental.reset_memory_stats(device)
            row.update(_loop_rate(trainer, _cached(trainer),
                                  max(3, steps * config.train.global_batch_size // batch),
                                  min_seconds=MIN_SECONDS / 2))
            if devices:
                row["device_peak_mb"] = max(
                    tf.config.experimental.get_memory_info(d)["peak"] for d in devices) / 2**20
            row["peak_rss_mb"] = _peak_rss_mb()
        except tf.errors.ResourceExhaustedError:
            row["fits"] = False
            tried.append(row)
            stop_reason = f"global batch {batch} ran out of device memory"
            break
        over_budget = not devices and row["peak_rss_mb"] > memory_budget_mb
        row["fits"] = not over_budget
        tried.append(row)
        if over_budget:
            stop_reason = (f"global batch {batch} took the process to {row['peak_rss_mb']:,.0f} MB "
                           f"RSS, over the {memory_budget_mb:,.0f} MB budget")
            break
        batch *= 2
    fits = [r for r in tried if r["fits"]]
    best = max(fits, key=lambda r: r["examples_per_s"]) if fits else None
    return {"tried": tried, "largest_fitting": fits[-1]["global_batch_size"] if fits else None,
            "fastest": best, "stopped": stop_reason, "memory_budget_mb": memory_budget_mb}


def measure_jit(config: ml_collections.ConfigDict, compute: Report, steps: int) -> Report:
    """(5) Compute alone with ``perf.jit_compile`` flipped."""
    import tensorflow as tf

    flipped = not config.perf.jit_compile
    trainer = _build(_with(config, perf__jit_compile=flipped))
    if flipped and trainer.strategy.num_replicas_in_sync > 1:
        return {"applicable": False,
                "note": "XLA is not applied with several replicas in one process"}
    try:
        other = _loop_rate(trainer, _cached(trainer), steps)
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as error:
        return {"applicable": False, "note": f"XLA could not compile the step: "
                                             f"{str(error).splitlines()[0]}"}
    on, off = (other, compute) if flipped else (compute, other)
    return {"applicable": True, "on_examples_per_s": on["examples_per_s"],
            "off_examples_per_s": off["examples_per_s"],
            "speedup": on["examples_per_s"] / off["examples_per_s"]}


def measure_communication(trainer, compute: Report, steps: int, config_path: str | None,
                          overrides: Sequence[str]) -> Report:
    """(6) One replica vs N with the per-replica batch fixed (one-replica run in a subprocess)."""
    replicas = trainer.strategy.num_replicas_in_sync
    if replicas == 1:
        return {"applicable": False, "replicas": 1,
                "note": "one replica: no gradient all-reduce to measure (rerun with "
                        "--config.distribute.strategy=mirrored to compare)"}
    if not config_path:
        return {"applicable": False, "replicas": replicas,
                "note": "needs the config file path to run the 1-replica comparison"}
    per_replica = trainer.config.train.global_batch_size // replicas
    cmd = [sys.executable, "-m", "trainer.doctor", f"--config={config_path}", *overrides,
           "--config.distribute.strategy=one_device", "--config.distribute.virtual_devices=0",
           "--config.distribute.devices=()",
           f"--config.train.global_batch_size={per_replica}", f"--steps={steps}",
           "--sections=compute", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        return {"applicable": False, "replicas": replicas,
                "note": f"the 1-replica run failed: {proc.stderr.strip().splitlines()[-1:]}"}
    single = json.loads(proc.stdout.strip().splitlines()[-1])["compute"]
    share = max(0.0, 1 - single["step_ms"] / compute["step_ms"])
    return {"applicable": True, "replicas": replicas, "per_replica_batch": per_replica,
            "one_replica_step_ms": single["step_ms"], "n_replica_step_ms": compute["step_ms"],
            "communication_share": share,
            "scaling_efficiency": single["step_ms"] / compute["step_ms"]}


def _timed_loop(fn: Callable, x, budget_s: float = 0.2) -> float:
    """Seconds per iteration of ``fn(x, n)`` (an in-graph loop), growing n to the budget."""
    import tensorflow as tf

    float(fn(x, tf.constant(1)))  # trace
    n = 1
    while True:
        start = time.perf_counter()
        float(fn(x, tf.constant(n)))
        seconds = time.perf_counter() - start
        if seconds >= budget_s or n >= 1024:
            return seconds / n
        n *= 4


def _nbytes(shape, dtype) -> int:
    import tensorflow as tf

    return int(math.prod(shape)) * tf.as_dtype(dtype).size


def profile_layers(trainer, top: int) -> Report:
    """(7) Forward/backward time and memory of each top-level layer, timed alone."""
    import keras
    import tensorflow as tf

    per_replica = trainer.config.train.global_batch_size // trainer.strategy.num_replicas_in_sync
    rows, untimed = [], []
    for layer in trainer.model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        try:
            spec = layer.input
        except (AttributeError, ValueError):
            untimed.append(layer.name)
            continue

        def make(t):
            shape = [per_replica if i == 0 else (d or 32) for i, d in enumerate(t.shape)]
            if tf.as_dtype(t.dtype).is_floating:
                return tf.random.normal(shape, dtype=t.dtype)
            return tf.zeros(shape, t.dtype)

        x = tf.nest.map_structure(make, spec)

        def total(y):
            return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in tf.nest.flatten(y)])

        @tf.function
        def forward(inputs, n, layer=layer):
            acc = tf.constant(0.0)
            for _ in tf.range(n):
                acc += total(layer(inputs, training=True))
            return acc

        @tf.function
        def forward_backward(inputs, n, layer=layer):
            acc = tf.constant(0.0)
            for _ in tf.range(n):
                with tf.GradientTape() as tape:
                    tape.watch([t for t in tf.nest.flatten(inputs) if t.dtype.is_floating])
                    y = total(layer(inputs, training=True))
                sources = list(layer.trainable_variables) + [
                    t for t in tf.nest.flatten(inputs) if t.dtype.is_floating]
                grads = [g for g in tape.gradient(y, sources) if g is not None]
                acc += y + (total(grads) if grads else 0.0)
            return acc

        try:
            fwd = _timed_loop(forward, x)
            fwd_bwd = _timed_loop(forward_backward, x)
            out = layer(x, training=False)
        except Exception as error:  # noqa: BLE001 - report the layer and go on
            untimed.append(f"{layer.name} ({type(error).__name__})")
            continue
        rows.append({
            "layer": layer.name, "type": type(layer).__name__,
            "forward_ms": 1e3 * fwd, "backward_ms": 1e3 * max(0.0, fwd_bwd - fwd),
            "params": int(sum(math.prod(v.shape) for v in layer.weights)),
            "param_mb": sum(_nbytes(v.shape, v.dtype) for v in layer.weights) / 2**20,
            "activation_mb": sum(_nbytes(t.shape, t.dtype)
                                 for t in tf.nest.flatten(out)) / 2**20,
        })
    rows.sort(key=lambda r: r["forward_ms"] + r["backward_ms"], reverse=True)
    return {"per_replica_batch": per_replica, "top": rows[:top], "untimed": untimed}


def verdict(report: Report) -> Report:
    """(8) The diagnosis, from the measured numbers."""
    run = report["baseline"]["examples_per_s"]
    # The real run proves the pipeline delivers at least its rate (the probe may be
    # slowed down by other work on a shared machine).
    feed = max(report["input"]["examples_per_s"], run)
    step = report["compute"]["examples_per_s"]
    advice: list[str] = []
    comm = report.get("communication") or {}
    jit = report.get("jit") or {}
    batch = report.get("batch") or {}
    if feed < step or (run < 0.8 * step and feed < 1.5 * step):
        kind = "input-bound"
        narrowly = " (narrowly)" if feed >= 0.85 * step else ""
        text = (f"input-bound{narrowly}: the pipeline delivers {feed:,.0f} ex/s, the step consumes "
                f"{step:,.0f} ex/s (the run gets {run:,.0f}) — add .cache() after decoding, "
                f"raise num_parallel_calls (tf.data.AUTOTUNE) in map/interleave, move heavy "
                f"Python (py_function) out of the pipeline, batch before cheap per-batch maps, "
                f"prefetch, or preprocess offline")
    elif comm.get("applicable") and comm["communication_share"] > 0.3:
        kind = "communication-bound"
        text = (f"communication-bound: {comm['replicas']} replicas take "
                f"{comm['n_replica_step_ms']:.2f} ms per step vs {comm['one_replica_step_ms']:.2f} "
                f"ms for one ({comm['communication_share']:.0%} of the step) — raise the "
                f"per-replica batch, accumulate gradients (perf.grad_accum_steps), or pick "
                f"another distribute.all_reduce")
    else:
        kind = "compute-bound"
        text = (f"compute-bound: the step consumes {step:,.0f} ex/s and the pipeline could "
                f"deliver {feed:,.0f} ex/s ({feed / step:.1f}x headroom; the run gets "
                f"{run:,.0f})")
    if run < 0.8 * min(feed, step):
        advice.append(f"the run ({run:,.0f} ex/s) is well below both the pipeline and the step: "
                      f"host overhead — raise train.steps_per_loop")
    if jit.get("applicable") and jit["speedup"] >= 1.15:
        advice.append(f"XLA speeds the step up {jit['speedup']:.2f}x: set perf.jit_compile=True")
    fastest = batch.get("fastest")
    # Compared with the configured batch timed in the same search (same conditions).
    configured = next((r for r in batch.get("tried", []) if r.get("examples_per_s")), None)
    if fastest and configured and fastest is not configured and (
            fastest["examples_per_s"] >= 1.3 * configured["examples_per_s"]):
        gain = fastest["examples_per_s"] / configured["examples_per_s"]
        advice.append(f"global batch {fastest['global_batch_size']} runs at "
                      f"{fastest['examples_per_s']:,.0f} ex/s ({gain:.1f}x): "
                      f"raise train.global_batch_size (and scale the learning rate: "
                      f"optimizer.lr_scaling='linear')")
    layers = (report.get("layers") or {}).get("top") or []
    if kind == "compute-bound" and layers:
        names = ", ".join(f"{r['layer']} ({r['forward_ms'] + r['backward_ms']:.2f} ms)"
                          for r in layers[:3])
        advice.append(f"the costliest layers: {names}")
    return {"kind": kind, "text": text, "advice": advice}


def diagnose(config: ml_collections.ConfigDict, steps: int = 100,
             sections: Sequence[str] = SECTIONS, memory_budget_mb: float = 0,
             max_batch_doublings: int = 3, top_layers: int = 8,
             config_path: str | None = None, overrides: Sequence[str] = ()) -> Report:
    """Runs the requested sections (see the module docstring) and returns the report.

    ``baseline``, ``input`` and ``compute`` are always measured when a verdict is
    wanted (all of SECTIONS); ``memory_budget_mb`` 0 means half the machine's RAM.
    """
    from trainer import config as config_lib

    config_lib.validate(config, resolve_trainer=True)
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"Unknown doctor sections {sorted(unknown)}; choose from {SECTIONS}.")
    if config.distribute.strategy == "multi_worker" or os.environ.get("TF_CONFIG"):
        raise ValueError("Run the doctor in one process (not as a multi-worker task): unset "
                         "TF_CONFIG and use a mirrored/one_device strategy.")
    budget = memory_budget_mb or psutil.virtual_memory().total / 2**20 / 2
    trainer = _build(config)
    report: Report = {"config": {
        "trainer": config.trainer, "global_batch_size": config.train.global_batch_size,
        "replicas": trainer.strategy.num_replicas_in_sync,
        "strategy": type(trainer.strategy).__name__,
        "steps_per_loop": config.train.steps_per_loop, "jit_compile": config.perf.jit_compile,
        "precision": config.precision.policy, "steps": steps}}
    if "baseline" in sections:
        report["baseline"] = measure_baseline(trainer, steps)
    if "input" in sections:
        report["input"] = measure_input(trainer, steps)
    if "compute" in sections:
        report["compute"] = measure_compute(trainer, steps)
    if "layers" in sections:
        report["layers"] = profile_layers(trainer, top_layers)
    if "communication" in sections:
        report["communication"] = measure_communication(
            trainer, report["compute"], steps, config_path, overrides)
    if "jit" in sections:
        report["jit"] = measure_jit(config, report["compute"], steps)
    if "batch" in sections:
        report["batch"] = search_batch(config, steps, max_batch_doublings, budget)
    if {"baseline", "input", "compute"} <= set(sections):
        report["verdict"] = verdict(report)
    return report


# --------------------------------------------------------------------------- output
def format_table(report: Report) -> str:
    """The report as a readable table."""
    c = report["config"]
    lines = [f"Doctor: {c['trainer']}  global batch {c['global_batch_size']} on {c['replicas']} "
             f"replica(s) ({c['strategy']}), {c['precision']}, steps_per_loop "
             f"{c['steps_per_loop']}, {c['steps']} timed steps", ""]
    row = "  {:<34}{:>14}  {}".format
    lines.append(row("measurement", "examples/s", "notes"))
    if "baseline" in report:
        b = report["baseline"]
        lines.append(row("(1) real run", f"{b['examples_per_s']:,.0f}", f"{b['step_ms']:.3f} ms/step"))
    if "input" in report:
        i = report["input"]
        lines.append(row("(2) input pipeline alone", f"{i['examples_per_s']:,.0f}",
                         f"{i['batch_ms']:.3f} ms/batch"))
    if "compute" in report:
        k = report["compute"]
        lines.append(row("(3) compute alone (cached batch)", f"{k['examples_per_s']:,.0f}",
                         f"{k['step_ms']:.3f} ms/step"))
    if "batch" in report:
        s = report["batch"]
        for r in s["tried"]:
            rate = f"{r['examples_per_s']:,.0f}" if "examples_per_s" in r else "-"
            mem = (f"device peak {r['device_peak_mb']:,.0f} MB" if "device_peak_mb" in r
                   else f"peak RSS {r.get('peak_rss_mb', float('nan')):,.0f} MB")
            lines.append(row(f"(4) global batch {r['global_batch_size']}", rate,
                             f"{'fits' if r['fits'] else 'does NOT fit'}, {mem}"))
        lines.append(row("    largest that fits", str(s["largest_fitting"]), s["stopped"]))
    if "jit" in report:
        j = report["jit"]
        if j["applicable"]:
            lines.append(row("(5) jit_compile on", f"{j['on_examples_per_s']:,.0f}",
                             f"{j['speedup']:.2f}x vs off"))
            lines.append(row("    jit_compile off", f"{j['off_examples_per_s']:,.0f}", ""))
        else:
            lines.append(row("(5) jit_compile", "n/a", j["note"]))
    if "communication" in report:
        m = report["communication"]
        if m["applicable"]:
            lines.append(row(f"(6) 1 vs {m['replicas']} replicas", "",
                             f"{m['one_replica_step_ms']:.3f} vs {m['n_replica_step_ms']:.3f} ms/step "
                             f"at per-replica batch {m['per_replica_batch']}: communication "
                             f"(+contention) {m['communication_share']:.0%} of the step"))
        else:
            lines.append(row("(6) communication", "n/a", m["note"]))
    if "layers" in report:
        lay = report["layers"]
        lines += ["", f"  (7) top layers (per-replica batch {lay['per_replica_batch']}, each timed alone)",
                  "  {:<24}{:<22}{:>10}{:>10}{:>12}{:>10}{:>12}".format(
                      "layer", "type", "fwd ms", "bwd ms", "params", "param MB", "act MB")]
        for r in lay["top"]:
            lines.append("  {:<24}{:<22}{:>10.3f}{:>10.3f}{:>12,}{:>10.2f}{:>12.2f}".format(
                r["layer"][:23], r["type"][:21], r["forward_ms"], r["backward_ms"], r["params"],
                r["param_mb"], r["activation_mb"]))
        if lay["untimed"]:
            lines.append(f"  not timed: {', '.join(lay['untimed'])}")
    if "verdict" in report:
        v = report["verdict"]
        lines += ["", f"(8) verdict: {v['text']}"] + [f"    - {a}" for a in v["advice"]]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    from absl import flags, logging
    from ml_collections import config_flags

    from trainer import config as config_lib

    flag_values = flags.FLAGS
    if len(argv) > 1:
        raise SystemExit(f"Unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    config = flag_values.config
    overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
    try:
        report = diagnose(
            config, steps=flag_values.steps, sections=flag_values.sections,
            memory_budget_mb=flag_values.memory_budget_mb,
            max_batch_doublings=flag_values.max_batch_doublings,
            top_layers=flag_values.top_layers,
            config_path=config_flags.get_config_filename(flag_values["config"]), overrides=overrides)
    except config_lib.ConfigError as error:
        raise SystemExit(f"Configuration error: {error}") from None
    print(json.dumps(report) if flag_values.json else format_table(report), flush=True)


def run() -> None:
    """Console-script entry point (``tf-trainer-doctor``)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
    flags.DEFINE_integer("steps", 100, "Timed steps per measurement.")
    flags.DEFINE_bool("json", False, "Print one JSON object instead of the table.")
    flags.DEFINE_float("memory_budget_mb", 0, "CPU batch search: peak RSS bound (0: half the RAM).")
    flags.DEFINE_integer("max_batch_doublings", 3, "Batch search: doublings of the global batch.")
    flags.DEFINE_integer("top_layers", 8, "Layers listed in the per-layer table.")
    flags.DEFINE_list("sections", list(SECTIONS), f"Which measurements: {', '.join(SECTIONS)}.")
    flags.mark_flag_as_required("config")
    from trainer import fast_exit

    app.run(fast_exit.then_exit(main))


if __name__ == "__main__":
    run()
