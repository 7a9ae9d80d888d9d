"""The checks of ``python -m benchmarks.device.device_check``, each run in a process of
its own.

Every check is a function ``check(size) -> list[row]`` (a row: ``check``, ``status``
``ok`` / ``FAIL`` / ``skipped``, ``figure``, ``unit``, ``detail``; the list:
:data:`CHECKS`). It configures devices itself (before TensorFlow starts its runtime),
so it must be the only one in its process: the command line runs each in a child
(``--child NAME``). ``size`` (:class:`Size`) is the full size on a GPU and
:data:`DRY` on a CPU, where the checks that need a GPU say so in a ``skipped`` row
with what they would prove.

The framework is reached by its public API: ``trainer.Trainer`` (:class:`WorkloadTrainer`
over :mod:`benchmarks.common.workloads`), the ``distribute`` config (memory growth, virtual
devices, the all-reduce), ``trainer.telemetry.flops`` (MFU), ``trainer.doctor.measure``
(the verdict), the checkpoint service and inventory; the hand-written loops are
:mod:`benchmarks.common.throughput_impls`' (through :func:`benchmarks.speed.throughput.measure`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Callable

import keras
import ml_collections
import numpy as np
import tensorflow as tf

from benchmarks.common.arrays_trainer import ArraysTrainer
from benchmarks.common.workloads import WORKLOADS
from benchmarks.speed import throughput
from trainer import config as config_lib
from trainer.checkpoint import inventory
from trainer.checkpoint.service import Checkpointer
from trainer.doctor import measure
from trainer.telemetry import flops

Row = dict  # {"check", "status", "figure", "unit", "detail"}
EQUAL_RTOL = 1e-5  # 1 vs 2 replicas, float32 (docs/numerics.md)
#: Final-loss bounds of each policy against float32's, relative (docs/numerics.md).
LOSS_BOUNDS = {"mixed_float16": 0.02, "mixed_bfloat16": 0.05}
VS_HAND_MIN = 0.9  # framework / best hand-written loop, on a GPU


@dataclasses.dataclass(frozen=True)
class Size:
    """How big each check runs. ``gpu``: the checks run on a GPU (full sizes); else on
    the CPU at tiny sizes, where speed figures are reported, not judged.
    ``gpu_expected``: the command found a GPU on the host that TensorFlow may not see."""

    gpu: bool
    transformer: str
    cnn: str
    checkpoint_workload: str
    steps: int  # per fit in the equivalence, precision and MFU checks
    rounds: int  # paired rounds of the speed comparisons
    seconds: float  # about this long per timed run of a speed comparison
    mfu_batch: int
    doctor_steps: int
    gpu_expected: bool = False


FULL = Size(gpu=True, transformer="transformer", cnn="cnn", checkpoint_workload="wide_mlp",
            steps=200, rounds=3, seconds=2.0, mfu_batch=256, doctor_steps=100,
            gpu_expected=True)
DRY = Size(gpu=False, transformer="transformer_tiny", cnn="cnn_tiny",
           checkpoint_workload="mlp", steps=20, rounds=2, seconds=0.2, mfu_batch=16,
           doctor_steps=10)


def size_for(dry: bool) -> Size:
    """:data:`FULL` when this process sees a GPU, else :data:`DRY` (``gpu_expected``
    unless ``dry``: the command found a GPU that TensorFlow here does not see)."""
    if dry:
        return DRY
    return FULL if tf.config.list_physical_devices("GPU") else dataclasses.replace(
        DRY, gpu_expected=True)


def row(check: str, status: str, figure: float | None, unit: str, detail: str) -> Row:
    return {"check": check, "status": status, "figure": figure, "unit": unit, "detail": detail}


def no_gpu(check: str, proves: str, detail: str = "") -> Row:
    return row(check, "skipped", None, "", f"no GPU: would prove {proves}" + (
        f"; {detail}" if detail else ""))


class WorkloadTrainer(ArraysTrainer):
    """The workload ``config.model.workload`` of :mod:`benchmarks.common.workloads` on its
    synthetic data (4,096 examples, repeated), Adam; importable by path for the doctor
    (``benchmarks.common.device_checks:WorkloadTrainer``)."""

    def build_model(self):
        return WORKLOADS[self.config.model.workload].build_model()

    def arrays(self):
        return WORKLOADS[self.config.model.workload].data(4096)


def workload_config(workload: str, steps: int, **overrides) -> ml_collections.ConfigDict:
    """The config of a :class:`WorkloadTrainer` run of ``steps`` steps (one loop call) on
    one device (the first GPU, else the CPU: never a TPU that ``auto`` would pick; the
    ``tpu`` check asks for it), no logging noise; ``overrides``: ``"section.field"`` ->
    value."""
    config = config_lib.get_config()
    config.trainer = "benchmarks.common.device_checks:WorkloadTrainer"
    config.model.workload = workload
    config.train.global_batch_size = WORKLOADS[workload].batch_size
    config.train.steps = config.train.steps_per_loop = steps
    config.train.log_every_steps = 10**9
    config.optimizer.name = "adam"
    config.perf.plan = "fixed"
    config.distribute.strategy = "one_device"
    config.telemetry.progress = "off"
    config.telemetry.probe_every_windows = 0
    config.update_from_flattened_dict(overrides)
    return config


def _weights(t) -> list[np.ndarray]:
    return [np.asarray(w) for w in t.model.get_weights()]


def _relative_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """max |a - b| over every weight, relative to the largest |b|."""
    scale = max(float(np.max(np.abs(w))) for w in b) or 1.0
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b)) / scale


def _timed_fit(t, steps: int) -> tuple[dict, float]:
    """``fit()`` over ``steps`` more steps: its results and examples/s."""
    t.config.train.steps = t.step + steps
    start = time.perf_counter()
    results = t.fit()
    return results, steps * t.config.train.global_batch_size / (time.perf_counter() - start)


# --------------------------------------------------------------------------- checks
def _gpu_memory() -> str:
    """Each GPU's name and total memory as ``nvidia-smi`` reports them ("" without it:
    TensorFlow reports the memory in use, not the total)."""
    if not shutil.which("nvidia-smi"):
        return ""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=20)
    except subprocess.TimeoutExpired:
        return "nvidia-smi did not answer in 20 s"
    return "; ".join(line.strip() for line in proc.stdout.splitlines() if line.strip())


def check_devices(size: Size) -> list[Row]:
    """Devices found; ``distribute.memory_growth`` reaching TensorFlow; the allocator."""
    config = workload_config("mlp", 1, **{"distribute.memory_growth": True})
    t = WorkloadTrainer(config)  # builds the strategy: configure_devices applies growth
    gpus = tf.config.list_physical_devices("GPU")
    growth_proves = ("distribute.memory_growth=True reaches "
                     "tf.config.experimental.set_memory_growth before the runtime starts")
    allocator = os.environ.get("TF_GPU_ALLOCATOR") or "BFC (TensorFlow's default)"
    if not gpus:
        logical = ", ".join(d.name for d in tf.config.list_logical_devices())
        if size.gpu_expected:  # an NVIDIA device on the host, none in TensorFlow
            devices = row("devices", "FAIL", 0, "GPUs",
                          f"a GPU is on this host ({_gpu_memory() or '/dev/nvidia*'}) but "
                          f"TensorFlow sees only {logical}: install the GPU build "
                          f"(pip install 'tf-trainer[gpu]') and check CUDA_VISIBLE_DEVICES")
        else:
            devices = row("devices", "ok", len(tf.config.list_logical_devices()), "devices",
                          f"no GPU: dry mode on {logical}")
        t.close()
        return [devices, no_gpu("devices/memory_growth", growth_proves),
                no_gpu("devices/allocator", f"which GPU allocator runs ({allocator})")]
    described = []
    for gpu in gpus:
        details = tf.config.experimental.get_device_details(gpu)
        capability = ".".join(map(str, details.get("compute_capability", ("?",))))
        described.append(f"{gpu.name.split('device:')[-1]}: {details.get('device_name', '?')}"
                         f", compute capability {capability}")
    memory = _gpu_memory()
    growth = [tf.config.experimental.get_memory_growth(g) for g in gpus]
    t.close()
    return [
        row("devices", "ok", len(gpus), "GPUs",
            "; ".join(described) + (f"; memory (nvidia-smi): {memory}" if memory else "")),
        row("devices/memory_growth", "ok" if all(growth) else "FAIL", sum(growth), "GPUs",
            f"distribute.memory_growth=True -> set_memory_growth on {sum(growth)} of "
            f"{len(gpus)} GPUs"),
        row("devices/allocator", "ok", None, "",
            f"{allocator} (TF_GPU_ALLOCATOR); strategy {type(t.strategy).__name__}")]


def _all_reduce(strategy: tf.distribute.Strategy, megabytes: float) -> Row:
    """Each replica contributes a vector of (its replica id + 1); the all-reduced sum
    must be 1 + 2 + ... on every device. Figure: the all-reduce's algorithm bandwidth."""
    n = int(megabytes * 2**20 / 4)

    @tf.function
    def reduce():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            value = tf.fill([n], tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0)
            return ctx.all_reduce("sum", value)
        return strategy.run(replica_fn)

    results = strategy.experimental_local_results(reduce())  # traced, warm
    replicas = strategy.num_replicas_in_sync
    expected = replicas * (replicas + 1) / 2
    # Each replica's result holds the others' contributions: the values crossed devices.
    crossed = replicas > 1 and all(
        float(tf.reduce_min(r)) == expected == float(tf.reduce_max(r)) for r in results)
    calls = 10
    start = time.perf_counter()
    for _ in range(calls):
        out = reduce()
    float(tf.reduce_sum(strategy.experimental_local_results(out)[0][:1]))  # wait
    seconds = (time.perf_counter() - start) / calls
    devices = ", ".join(d.split("device:")[-1] for d in strategy.extended.worker_devices)
    return row("virtual/all_reduce", "ok" if crossed else "FAIL", n * 4 / seconds / 1e9,
               "GB/s", f"each of {replicas} replicas ({devices}) gives (its id + 1); every "
               f"replica's all-reduced sum is {float(tf.reduce_max(results[-1])):g} "
               f"(expected {expected:g}); {megabytes:g} MB, algorithm bandwidth")


def _mirrored_fit(size: Size, layout: dict, all_reduce: str):
    """A Trainer on the 2 logical devices, fitted ``size.steps`` steps."""
    kind = "gpu" if size.gpu else "cpu"  # the two halves of the first device, whatever else
    two = WorkloadTrainer(workload_config(size.transformer, size.steps, seed=1, **layout, **{
        "distribute.strategy": "mirrored", "distribute.all_reduce": all_reduce,
        "distribute.devices": (f"/{kind}:0", f"/{kind}:1")}))
    two.fit()
    return two


def check_virtual(size: Size) -> list[Row]:
    """One device split in 2 (``distribute.virtual_devices=2``) under MirroredStrategy:
    1 vs 2 replicas train to the same float32 weights; an all-reduce crossed devices.
    On a GPU, TF32 is turned off (float32 proper); should ``all_reduce="auto"`` (NCCL)
    refuse two logical GPUs of one physical GPU, that is a FAIL row and the check goes
    on with ``hierarchical_copy``."""
    if size.gpu:
        tf.config.experimental.enable_tensor_float_32_execution(False)
    layout = {"distribute.virtual_devices": 2,
              "distribute.memory_limit_mb": 8192 if size.gpu else 0}
    one = WorkloadTrainer(workload_config(size.transformer, size.steps, seed=1, **layout, **{
        "distribute.strategy": "one_device"}))
    one.fit()
    rows = []
    try:
        two = _mirrored_fit(size, layout, "auto")
    except (tf.errors.OpError, RuntimeError, ValueError) as error:
        rows.append(row("virtual/all_reduce_auto", "FAIL", None, "",
                        f"distribute.all_reduce=auto on 2 logical devices of one: "
                        f"{type(error).__name__}: {str(error).splitlines()[0][:160]}; "
                        f"retried with hierarchical_copy"))
        two = _mirrored_fit(size, layout, "hierarchical_copy")
    diff = _relative_difference(_weights(two), _weights(one))
    devices = ", ".join(d.split("device:")[-1] for d in two.strategy.extended.worker_devices)
    rows.append(row("virtual/1_vs_2_replicas", "ok" if diff <= EQUAL_RTOL else "FAIL", diff,
                    "max rel", f"{size.transformer}, {size.steps} steps float32, 1 replica vs "
                    f"2 (MirroredStrategy on {devices}, distribute.all_reduce="
                    f"{two.config.distribute.all_reduce}); bound {EQUAL_RTOL:g}"))
    rows.append(_all_reduce(two.strategy, 16 if size.gpu else 1))
    one.close()
    two.close()
    return rows


def check_precision(size: Size) -> list[Row]:
    """The transformer in float32, mixed_float16 and mixed_bfloat16: examples/s of a
    timed fit after a warm-up fit, and each final loss against float32's
    (:data:`LOSS_BOUNDS`)."""
    rows, losses = [], {}
    for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
        t = WorkloadTrainer(workload_config(size.transformer, size.steps, seed=1, **{
            "precision.policy": policy}))
        t.fit()  # warm-up: tracing; the loss is taken after the timed fit
        results, rate = _timed_fit(t, size.steps)
        losses[policy] = loss = results["train/loss"]
        if policy == "float32":
            rows.append(row("precision/float32", "ok" if np.isfinite(loss) else "FAIL", rate,
                            "ex/s", f"{size.transformer}, final loss {loss:.5f} after "
                                    f"{2 * size.steps} steps"))
            keras.mixed_precision.set_global_policy("float32")
            t.close()
            continue
        gap = abs(loss - losses["float32"]) / abs(losses["float32"])
        bound = LOSS_BOUNDS[policy]
        skipped = int(t.precision.skipped_steps.numpy()) if policy == "mixed_float16" else 0
        rows.append(row(f"precision/{policy}", "ok" if gap <= bound else "FAIL", rate, "ex/s",
                        f"final loss {loss:.5f} vs float32 {losses['float32']:.5f}: "
                        f"{gap:.2%} (bound {bound:.0%})"
                        + (f"; {skipped} loss-scale skips" if policy == "mixed_float16" else "")
                        + ("" if size.gpu else "; float16/bfloat16 emulated on CPU")))
        keras.mixed_precision.set_global_policy("float32")
        t.close()
    return rows


def _speed(size: Size, workload: str, impls: tuple[str, ...]) -> dict:
    """:func:`benchmarks.speed.throughput.measure` on ``workload``: the framework's
    implementations ``impls`` and the hand-written loops c and c+xla, in paired rounds."""
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="device-check-plans-")
    return throughput.measure(workload, "default", size.rounds, size.seconds, impls)


def _speed_row(check: str, result: dict, detail: str, judge: Callable[[dict], bool] | None
               ) -> Row:
    if "error" in result:
        return row(check, "FAIL", None, "ex/s", result["error"])
    holds = judge(result) if judge else True
    return row(check, "ok" if holds else "FAIL", result["examples_per_s"], "ex/s", detail)


def check_xla_and_loops(size: Size, workload: str, with_xla: bool) -> list[Row]:
    """XLA off / on / the plan's choice (with ``with_xla``) and the framework's default
    config against the best hand-written loop, paired rounds on one device."""
    impls = ("a", "a-fixed", "a+xla") if with_xla else ("a",)
    run = _speed(size, workload, impls)
    res = run["implementations"]
    rows = []
    speed_note = "" if size.gpu else "; dry: speed reported, not judged"
    if with_xla:
        best_fixed = max((res[n].get("examples_per_s", 0) for n in ("a-fixed", "a+xla")))
        plan = run.get("plan") or {}
        chosen = plan.get("chosen", {})
        rows.append(_speed_row("xla/off", res["a-fixed"], f"{workload}, perf.plan=fixed, "
                               f"jit_compile=False{speed_note}", None))
        rows.append(_speed_row("xla/on", res["a+xla"], f"perf.jit_compile=True: "
                               f"{_ratio(res['a+xla'], res['a-fixed'])}x off{speed_note}", None))
        rows.append(_speed_row(
            "xla/plan", res["a"],
            f"perf.plan=auto chose xla={chosen.get('xla')} steps_per_loop="
            f"{chosen.get('steps_per_loop')} ({plan.get('source', 'no plan event')}); "
            f"{res['a'].get('examples_per_s', 0) / best_fixed if best_fixed else 0:.2f}x the "
            f"faster fixed setting{speed_note}",
            (lambda r: r["examples_per_s"] >= 0.9 * best_fixed) if size.gpu else None))
    ratio = res["a"].get("ratio_to_best")
    best = res.get("best", {})
    rows.append(row(
        f"vs_hand/{workload}", "FAIL" if "error" in res["a"] or ratio is None or (
            size.gpu and ratio < VS_HAND_MIN) else "ok",
        ratio, "x hand",
        f"framework (default config) {res['a'].get('examples_per_s', 0):,.0f} ex/s vs the best "
        f"hand-written in-graph loop (c / c+xla, c+xla faster in {best.get('xla_rounds', '?')} "
        f"of {size.rounds} rounds) {best.get('examples_per_s', 0):,.0f} ex/s; median of "
        f"{size.rounds} paired rounds, range "
        f"{min(res['a'].get('ratios_to_best') or [0]):.2f}..{max(res['a'].get('ratios_to_best') or [0]):.2f}"
        + (f"; bound >= {VS_HAND_MIN}" if size.gpu else speed_note)))
    return rows


def _ratio(a: dict, b: dict) -> str:
    if "examples_per_s" not in a or "examples_per_s" not in b:
        return "-"
    return f"{a['examples_per_s'] / b['examples_per_s']:.2f}"


def check_speed_transformer(size: Size) -> list[Row]:
    return check_xla_and_loops(size, size.transformer, with_xla=True)


def check_speed_cnn(size: Size) -> list[Row]:
    return check_xla_and_loops(size, size.cnn, with_xla=False)


def check_mfu(size: Size) -> list[Row]:
    """MFU of the transformer from the framework's telemetry (``train/mfu``: model FLOPs
    x examples/s over the device's datasheet peak, ``trainer.telemetry.flops``), and
    the doctor's verdict on the same config."""
    policy = "mixed_bfloat16" if size.gpu else "float32"
    steps = size.steps
    overrides = {"precision.policy": policy, "train.global_batch_size": size.mfu_batch,
                 "perf.jit_compile": size.gpu,
                 "telemetry.loggers": ("jsonl",)}
    workdir = tempfile.mkdtemp(prefix="device-check-mfu-")
    config = workload_config(size.transformer, steps, **overrides)
    config.train.log_every_steps = steps
    t = WorkloadTrainer(config, workdir)
    t.fit()
    _timed_fit(t, 2 * steps)
    dtype = flops.compute_dtype()
    name, peak = flops.device_peak_tflops(dtype)
    t.close()
    keras.mixed_precision.set_global_policy("float32")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    record = [r for r in records if r.get("kind") == "train"][-1]
    tflops, mfu = record.get("train/tflops"), record.get("train/mfu")
    shutil.rmtree(workdir, ignore_errors=True)
    measured = (f"{size.transformer} batch {size.mfu_batch} {policy}: "
                f"{record['perf/examples_per_s']:,.0f} ex/s x "
                f"{(record.get('train/flops_per_example') or 0) / 1e6:,.1f} MFLOP/example "
                f"(3 x forward) = {tflops or 0:.4f} TFLOP/s")
    rows = [row("mfu/tflops", "ok" if tflops and tflops > 0 else "FAIL", tflops, "TFLOP/s",
                measured)]
    if peak:
        rows.append(row("mfu", "ok" if mfu and 0 < mfu <= 1 else "FAIL", mfu, "of peak",
                        f"{name}: peak {peak:g} TFLOP/s ({dtype}, dense, datasheet)"))
    elif size.gpu:
        rows.append(row("mfu", "FAIL", None, "", f"no peak for {name} in "
                        f"trainer.telemetry.flops.PEAK_TFLOPS: add it"))
    else:
        rows.append(no_gpu("mfu", "train/mfu against the device's datasheet peak "
                           "(H100 SXM bf16 989.4 TFLOP/s)", f"{name} has no peak"))
    report = measure.diagnose(workload_config(size.transformer, size.doctor_steps, **overrides),
                              steps=size.doctor_steps,
                              sections=("baseline", "input", "compute"), time_budget_s=60)
    verdict = report["verdict"]
    rows.append(row("doctor", "ok" if verdict["kind"] else "FAIL",
                    report["baseline"]["examples_per_s"], "ex/s", verdict["text"]))
    return rows


def check_checkpoint(size: Size) -> list[Row]:
    """A checkpoint saved from device memory (synchronous, timed), its checksums
    verified, and a new Trainer restored to the same weights bit for bit."""
    workdir = tempfile.mkdtemp(prefix="device-check-ckpt-")
    config = workload_config(size.checkpoint_workload, size.steps,
                             **{"checkpoint.async_save": False})
    t = WorkloadTrainer(config, workdir)
    t.fit()  # its final save (untimed) fills the host buffers, as every later save finds them
    device = t.model.weights[0].value.device
    nbytes = sum(w.numpy().nbytes for w in t.model.weights + t.optimizer.variables)
    saver = Checkpointer(t.config, workdir, True)
    start = time.perf_counter()
    saver.save(t.context, kind="device_check", wait=True)
    saver.on_fit_end(t.context, {})  # waits for the commit
    save_s = time.perf_counter() - start
    timed = inventory.check(t.step, os.path.join(workdir, "device_check", str(t.step)))
    weights = _weights(t)
    t.close()
    restored = WorkloadTrainer(config, workdir)
    start = time.perf_counter()
    step = restored.restore()
    restore_s = time.perf_counter() - start
    equal = all(np.array_equal(a, b) for a, b in zip(_weights(restored), weights))
    latest = inventory.survey(workdir)[0]
    restored.close()
    shutil.rmtree(workdir, ignore_errors=True)
    holds = equal and step == config.train.steps and "checksums match" in timed.detail \
        and "checksums match" in latest.detail
    return [row("checkpoint", "ok" if holds else "FAIL", save_s, "s save",
                f"{size.checkpoint_workload}: {nbytes / 2**20:,.1f} MB from "
                f"{device.split('device:')[-1]}; saved ({timed.detail}); restore "
                f"{restore_s:.2f} s to step {step} ({latest.detail}), weights "
                f"{'equal bit for bit' if equal else 'DIFFER'}")]


def check_tpu(size: Size) -> list[Row]:
    """TPUStrategy (``distribute.strategy=tpu``), mixed_bfloat16, 100 steps per loop,
    the notebook path (a Trainer built and fitted twice in this one process); the
    full-size transformer at a global batch of 256 (divisible by 4 or 8 cores)."""
    steps = 100
    config = workload_config("transformer", steps, **{
        "distribute.strategy": "tpu", "precision.policy": "mixed_bfloat16",
        "train.global_batch_size": 256})
    t = WorkloadTrainer(config)
    t.fit()
    results, rate = _timed_fit(t, 2 * steps)
    cores = t.strategy.num_replicas_in_sync
    t.close()
    again = WorkloadTrainer(config)  # the notebook's cell run again
    again.fit()
    again.close()
    keras.mixed_precision.set_global_policy("float32")
    return [row("tpu", "ok" if np.isfinite(results["train/loss"]) else "FAIL", rate, "ex/s",
                f"TPUStrategy over {cores} cores, mixed_bfloat16, steps_per_loop {steps}, "
                f"two Trainers in one process (notebook path); loss {results['train/loss']:.4f}")]


#: name -> the check (what each would prove: ``benchmarks.device.device_check.WHY``).
CHECKS: dict[str, Callable[[Size], list[Row]]] = {
    "devices": check_devices, "virtual": check_virtual, "precision": check_precision,
    "speed_transformer": check_speed_transformer, "speed_cnn": check_speed_cnn,
    "mfu": check_mfu, "checkpoint": check_checkpoint, "tpu": check_tpu,
}


def run_check(name: str, dry: bool) -> list[Row]:
    """Runs the check ``name`` in this process (which must be fresh) at its size."""
    return CHECKS[name](size_for(dry))

