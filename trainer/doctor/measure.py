"""The performance doctor's measurements (the command line is :mod:`trainer.doctor`).

    python -m trainer.doctor --config=models/configs/digits.py [--steps 100] [--json] \
        [--memory_budget_mb 4096] [--config.train.global_batch_size=256 ...]

Builds the configured Trainer (no workdir: nothing is written) and measures, each as
examples/s after one untimed warm-up loop call (tracing): the median over chunks of
``--steps`` steps, repeated for at least one second (the machine may be shared):

1. ``baseline``: the real run: real input pipeline, real train step, the configured
   ``steps_per_loop`` in-graph loop.
2. ``input``: the input pipeline alone (the distributed dataset pulled in an in-graph
   loop, no model; :class:`trainer.telemetry.probes.InputProbe`). When the Trainer defines
   ``build_read_dataset`` (the examples as read from storage), reading alone is timed
   too (``read_examples_per_s``) and ``read_share`` is the share of the input time per
   example that reading takes; the rest is preprocessing. ``reads_files`` says whether
   the training pipeline reads files through TensorFlow's readers (TFRecord, fixed-length
   record, text line, CSV and LMDB datasets, ``tf.io.read_file``), None when its graph
   could not be traced; the verdict offers file sharding only to a pipeline that may.
3. ``compute``: the same train step on one cached batch (``take(1).cache().repeat()``
   of the same pipeline), so no input cost.
4. ``batch``: the largest global batch that fits, doubling from the configured one up
   to ``--max_batch_doublings`` times; each candidate is a fresh Trainer timed like (3).
   On GPU a candidate that raises ``ResourceExhaustedError`` stops the search; on CPU
   the process's peak RSS must stay under ``--memory_budget_mb`` (default: half the RAM).
5. ``jit``: XLA on vs off, ONE figure: the execution plan's (section 8) measurement on
   the real run, of the plans with the configured ``steps_per_loop``: the best XLA
   setting's score over the no-XLA plan's (not applied with several replicas; the
   advice follows this figure and what the plan chose).
6. ``communication``: with N > 1 replicas, (3) on ONE replica with the same
   per-replica batch, in a subprocess (a process hosts one Mirrored group size); the
   extra step time of N replicas is the communication share. On virtual CPU devices
   the replicas also share the same cores, so the share includes that contention.
7. ``layers``: the top layers by forward + backward time, each timed alone on random
   inputs of its real input shape (per-replica batch) in an in-graph loop, with
   parameter and activation (output) memory. Needs layers with a known input
   (Sequential / functional models); others are listed as not timed.
8. ``plan``: the execution planner run on the real run, whatever its length
   (:mod:`trainer.doctor.plan_trials`): the plans it timed, the one it keeps, the seconds
   measuring took (``perf.plan=fixed`` skips it; (5) is then measured the same way).
9. ``threads``: (1) in one fresh process per size of TensorFlow's thread pools
   (``distribute.inter_op_threads`` / ``intra_op_threads``; they cannot change inside a
   process, so no plan measures them): :mod:`trainer.doctor.thread_pools`.
10. ``verdict``: ``input-bound``, ``compute-bound`` or ``communication-bound`` with the
   numbers and what to do.

Time: ``time_budget_s`` (default 60 s), stated at the start and kept as
:mod:`trainer.doctor.phases` says; each phase's progress goes to ``say``.

Output: a table, or with ``--json`` one JSON object with the keys above.
"""

from __future__ import annotations

import copy
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import ml_collections
import psutil
import tensorflow as tf

from trainer import config as config_lib
from trainer import data
from trainer.distribution import strategies
from trainer.doctor.layer_profile import profile_layers
from trainer.doctor.phases import DEFAULT_BUDGET_S, Phases
from trainer.doctor.plan_trials import measure_plan
from trainer.doctor.report import SECTIONS, Report, verdict, xla_figure
from trainer.doctor.thread_pools import measure_threads
from trainer.telemetry import probes
from trainer.trainer import resolve_trainer_class

MIN_SECONDS = 1.0  # each measurement repeats its chunk of steps at least this long


# --------------------------------------------------------------------------- helpers
def _with(config: ml_collections.ConfigDict, **overrides: Any) -> ml_collections.ConfigDict:
    """A copy of ``config`` with ``section__field=value`` overrides."""
    config = copy.deepcopy(config)
    with config.unlocked():
        for key, value in overrides.items():
            section, field = key.split("__")
            config[section][field] = value
    return config


def build_trainer(config: ml_collections.ConfigDict):
    cls = resolve_trainer_class(config.trainer)
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
    cfg = trainer.config
    dist = data.distribute(trainer.strategy, dataset_fn, trainer.batch,
                           deterministic=cfg.train.deterministic)
    trainer.context.ensure_built(dist)
    loops = trainer.driver.loops  # the doctor times the driver's own compiled loop
    iterator = iter(dist)
    per_call = max(1, min(cfg.train.steps_per_loop, steps))
    loops.prepare(iterator)
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
    return {"examples_per_s": steps * trainer.batch.global_size / seconds,
            "step_ms": 1e3 * seconds / steps, "steps": steps}


def _device_type(strategy: tf.distribute.Strategy) -> str:
    """``CPU``, or the type of the first accelerator the strategy computes on."""
    accelerators = strategies.accelerator_devices(strategy)
    return accelerators[0].split(":")[0] if accelerators else "CPU"


def _cached(trainer) -> Callable:
    """``build_train_dataset`` reduced to one cached batch, repeated."""
    return lambda ctx: trainer.build_train_dataset(ctx).take(1).cache().repeat()


# --------------------------------------------------------------------------- sections
def measure_baseline(trainer, steps: int) -> Report:
    """(1) The real pipeline and the real step."""
    return _loop_rate(trainer, trainer.build_train_dataset, steps)


def measure_input(trainer, steps: int) -> Report:
    """(2) The distributed input pipeline alone; with ``build_read_dataset``, also
    reading alone and the share of the input time it takes (the rest is preprocessing:
    decoding, augmentation, batching)."""
    probe = probes.InputProbe(trainer.context)
    seconds = _median_seconds(lambda: steps * probe.seconds_per_batch(steps), MIN_SECONDS) / steps
    batch = trainer.batch.global_size
    report = {"examples_per_s": batch / seconds, "batch_ms": 1e3 * seconds, "batches": steps}
    report["reads_files"] = reads_files(trainer.build_train_dataset)
    read = trainer.build_read_dataset(tf.distribute.InputContext())
    if read is not None:
        # Steady state: one iterator over the whole measurement, batched like the run so
        # per-element loop overhead does not count as reading.
        iterator = iter(read.repeat().batch(batch).prefetch(tf.data.AUTOTUNE))

        @tf.function
        def pull(num_batches):
            for _ in tf.range(num_batches):
                tf.nest.map_structure(tf.identity, next(iterator))

        pull(tf.constant(1))  # trace and warm up
        read_seconds = _median_seconds(lambda: _timed(lambda: pull(tf.constant(steps))),
                                       MIN_SECONDS)
        report["read_examples_per_s"] = steps * batch / read_seconds
        # Per example: reading costs 1/read_rate of the pipeline's 1/rate.
        report["read_share"] = min(1.0, report["examples_per_s"] / report["read_examples_per_s"])
    return report


# Ops that read files (version suffixes such as ``V2`` stripped before comparing).
FILE_READING_OPS = frozenset({
    "TFRecordDataset", "FixedLengthRecordDataset", "TextLineDataset", "CSVDataset",
    "ExperimentalCSVDataset", "LMDBDataset", "ExperimentalLMDBDataset", "ReadFile"})


def reads_files(build_dataset: Callable[[tf.distribute.InputContext], tf.data.Dataset]
                ) -> bool | None:
    """Whether the dataset ``build_dataset`` makes reads files, from the ops of its graph
    (nested map/interleave functions included), traced once in a ``tf.function``.

    None when it cannot be traced (the hook runs eager-only code): the input may or may
    not read files. Files read by Python code (``py_function``, ``from_generator``) are
    not seen, and file sharding could not split them either.
    """
    def build() -> tf.Tensor:
        build_dataset(tf.distribute.InputContext())
        return tf.constant(0)

    try:
        graph = tf.function(build).get_concrete_function().graph.as_graph_def()
    except Exception:  # noqa: BLE001 (user code; the fact is then unknown)
        return None
    ops = {n.op for n in graph.node} | {
        n.op for f in graph.library.function for n in f.node_def}
    return any(re.sub(r"V\d+$", "", op) in FILE_READING_OPS for op in ops)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_compute(trainer, steps: int) -> Report:
    """(3) The same train step on one cached batch."""
    return _loop_rate(trainer, _cached(trainer), steps)


def search_batch(config: ml_collections.ConfigDict, steps: int, doublings: int,
                 memory_budget_mb: float, deadline: float | None = None,
                 say: Callable[[str], None] = lambda line: None) -> Report:
    """(4) Doubles the global batch while it fits; times each candidate like (3). No
    candidate starts past ``deadline`` (``time.monotonic``); ``say`` gets a line per
    candidate."""
    tried: list[dict[str, Any]] = []
    stop_reason = f"reached the search bound ({doublings} doublings)"
    batch = config.train.global_batch_size
    for _ in range(doublings + 1):
        if tried and deadline is not None and time.monotonic() > deadline:
            stop_reason = f"the time budget ran out before global batch {batch}"
            break
        candidate = _with(config, train__global_batch_size=batch)
        row: dict[str, Any] = {"global_batch_size": batch}
        try:
            trainer = build_trainer(candidate)
            devices = strategies.accelerator_devices(trainer.strategy)
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
        say(f"doctor:     global batch {batch}: {row['examples_per_s']:,.0f} ex/s, "
            f"peak RSS {row['peak_rss_mb']:,.0f} MB")
        if over_budget:
            stop_reason = (f"global batch {batch} took the process to {row['peak_rss_mb']:,.0f} MB "
                           f"RSS, over the {memory_budget_mb:,.0f} MB budget")
            break
        batch *= 2
    fits = [r for r in tried if r["fits"]]
    best = max(fits, key=lambda r: r["examples_per_s"]) if fits else None
    return {"tried": tried, "largest_fitting": fits[-1]["global_batch_size"] if fits else None,
            "fastest": best, "stopped": stop_reason, "memory_budget_mb": memory_budget_mb}


def measure_jit(config: ml_collections.ConfigDict, xla_problem: str | None,
                plan: Report | None = None, deadline: float | None = None,
                say: Callable[[str], None] = lambda line: None) -> Report:
    """(5) XLA on vs off: the execution plan's figure, from ``plan`` (the section (8)
    report of the same config), measured here (:func:`measure_plan`, forced to
    ``perf.plan="auto"``) when there is none or the config fixes the plan. Not measured
    when XLA cannot compile the step here (``xla_problem``: ``steps.xla_problem``)."""
    if xla_problem is not None:
        return {"applicable": False, "note": f"XLA {xla_problem}"}
    if plan is None or (not plan.get("applicable") and config.perf.plan == "fixed"):
        plan = measure_plan(config, deadline, force=True, say=say)
    return xla_figure(plan, config.train.global_batch_size)


def measure_communication(trainer, compute: Report, steps: int, config_path: str | None,
                          overrides: Sequence[str], timeout_s: float = 1800) -> Report:
    """(6) One replica vs N with the per-replica batch fixed (one-replica run in a
    subprocess, stopped after ``timeout_s``)."""
    replicas = trainer.strategy.num_replicas_in_sync
    if replicas == 1:
        return {"applicable": False, "replicas": 1,
                "note": "one replica: no gradient all-reduce to measure (rerun with "
                        "--config.distribute.strategy=mirrored to compare)"}
    if not config_path:
        return {"applicable": False, "replicas": replicas,
                "note": "needs the config file path to run the 1-replica comparison"}
    per_replica = trainer.batch.per_replica
    cmd = [sys.executable, "-m", "trainer.doctor", f"--config={config_path}", *overrides,
           "--config.distribute.strategy=one_device", "--config.distribute.virtual_devices=0",
           "--config.distribute.devices=()",
           f"--config.train.global_batch_size={per_replica}", f"--steps={steps}",
           "--sections=compute", "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        return {"applicable": False, "replicas": replicas,
                "note": f"the 1-replica run did not finish in the {timeout_s:.0f} s left of "
                        f"the time budget"}
    if proc.returncode:
        return {"applicable": False, "replicas": replicas,
                "note": f"the 1-replica run failed: {proc.stderr.strip().splitlines()[-1:]}"}
    single = json.loads(proc.stdout.strip().splitlines()[-1])["compute"]
    share = max(0.0, 1 - single["step_ms"] / compute["step_ms"])
    return {"applicable": True, "replicas": replicas, "per_replica_batch": per_replica,
            "one_replica_step_ms": single["step_ms"], "n_replica_step_ms": compute["step_ms"],
            "communication_share": share,
            "scaling_efficiency": single["step_ms"] / compute["step_ms"]}


def diagnose(config: ml_collections.ConfigDict, steps: int = 100,
             sections: Sequence[str] = SECTIONS, memory_budget_mb: float = 0,
             max_batch_doublings: int = 3, top_layers: int = 8,
             config_path: str | None = None, overrides: Sequence[str] = (),
             time_budget_s: float = DEFAULT_BUDGET_S,
             say: Callable[[str], None] = lambda line: None) -> Report:
    """Runs the requested sections (see the module docstring) and returns the report.

    ``baseline``, ``input`` and ``compute`` are always measured when a verdict is
    wanted (all of SECTIONS); ``memory_budget_mb`` 0 means half the machine's RAM.
    ``time_budget_s`` bounds the run (:class:`trainer.doctor.phases.Phases`); ``say``
    gets the progress lines of the phases.
    """
    config_lib.validate(config)
    resolve_trainer_class(config.trainer)
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"Unknown doctor sections {sorted(unknown)}; choose from {SECTIONS}.")
    if config.distribute.strategy == "multi_worker" or os.environ.get("TF_CONFIG"):
        raise config_lib.ConfigError("Run the doctor in one process (not as a multi-worker task): unset "
                         "TF_CONFIG and use a mirrored/one_device strategy.")
    budget = memory_budget_mb or psutil.virtual_memory().total / 2**20 / 2
    phases = Phases(time_budget_s, say)
    phases.start([s for s in SECTIONS if s in sections])
    trainer = build_trainer(config)
    report: Report = {"config": {
        "trainer": config.trainer, "global_batch_size": config.train.global_batch_size,
        "replicas": trainer.strategy.num_replicas_in_sync,
        "strategy": type(trainer.strategy).__name__,
        "device": _device_type(trainer.strategy), "host_cores": len(os.sched_getaffinity(0)),
        "steps_per_loop": config.train.steps_per_loop, "jit_compile": config.perf.jit_compile,
        "plan": config.perf.plan, "precision": config.precision.policy, "steps": steps,
        "time_budget_s": time_budget_s}}
    if "baseline" in sections:
        report["baseline"] = phases.run("baseline", "(1) real run",
                                        lambda: measure_baseline(trainer, steps))
    if "input" in sections:
        report["input"] = phases.run("input", "(2) input pipeline alone",
                                     lambda: measure_input(trainer, steps))
    if "compute" in sections:
        report["compute"] = phases.run("compute", "(3) compute alone (cached batch)",
                                       lambda: measure_compute(trainer, steps))
    if "layers" in sections:
        report["layers"] = phases.run("layers", "(7) layers, each timed alone",
                                      lambda: profile_layers(trainer, top_layers))
    if "communication" in sections:
        report["communication"] = phases.run(
            "communication", "(6) one replica vs all", lambda: measure_communication(
                trainer, report["compute"], steps, config_path, overrides,
                timeout_s=phases.remaining_s()))
    if "plan" in sections:
        report["plan"] = phases.run(
            "plan", "(8) execution plan, trials on the real run",
            lambda: measure_plan(config, phases.deadline, say=say))
    if "jit" in sections:
        report["jit"] = phases.run(
            "jit", "(5) XLA on vs off (the execution plan's figure)",
            lambda: measure_jit(config, trainer.steps.xla_problem, report.get("plan"),
                                phases.deadline, say))
    if "batch" in sections:
        report["batch"] = phases.run(
            "batch", "(4) batch size search",
            lambda: search_batch(config, steps, max_batch_doublings, budget, phases.deadline,
                                 say))
    if "threads" in sections:
        report["threads"] = phases.run(
            "threads", "(9) thread pools, one process per setting",
            lambda: measure_threads(steps, config_path, overrides, deadline=phases.deadline,
                                    say=say))
    if {"baseline", "input", "compute"} <= set(sections):
        report["verdict"] = verdict(report)
    say(f"doctor: done in {phases.elapsed_s:.1f} s (time budget {time_budget_s:g} s)")
    return report
