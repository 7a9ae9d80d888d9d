"""Model FLOPs per example, achieved TFLOPS, model and hardware FLOPs utilisation.

Two counts, both made once at the first logging window with TensorFlow's graph profiler
(``tf.compat.v1.profiler.profile`` with ``ProfileOptionBuilder.float_operation()``: the
float operations TensorFlow registers per op, ``MatMul`` 2·m·n·k, convolutions,
element-wise ops...; nested functions included, see :func:`graph_flops`). XLA's cost
analysis is not used: TensorFlow's Python API does not expose it (only the HLO text).

* **Model FLOPs** (``train/flops_per_example``, ``train/tflops``, ``train/mfu``): 3 × the
  FLOPs of the model's forward pass (forward + 2 × forward for the backward pass), the
  definition of MFU in PaLM (Chowdhery et al. 2022, appendix B), also used by Megatron-LM
  and nanoGPT. It does not depend on how the step is implemented: no credit for
  rematerialisation (``perf.recompute``), no discount for gradients the implementation
  skips, optimizer and metrics not counted, so MFU is comparable across implementations.
  The forward pass is ``run.model(features, training=True)`` traced once as a small
  separate ``tf.function`` on one replica's train batch spec (the train loop is not
  retraced; nothing runs); per example = count / per-replica batch. For the digits MLP
  this is 1.01 × the analytic ``3 × 2 × multiply-adds`` of its dense layers. Losses or
  extra model calls in an overridden ``train_step`` are not counted.
* **Hardware FLOPs** (``train/hardware_flops_per_example``, ``train/hfu``): what the
  compiled train loop's own graph computes (``run.train_graph()``: no
  retrace) — its body calls the train step (default or override, under
  ``strategy.run``) once per local replica: forward, the backward pass that is needed
  (TensorFlow does not compute the gradient of the input data, so the digits MLP
  executes 0.74 × the model FLOPs), recomputation, the optimizer update and the train
  metrics. Inside nested functions: an XLA-compiled forward/backward
  (``perf.jit_compile``), the larger branch of a ``tf.cond`` (the update of a step that
  is not skipped), a loop body once (through
  :func:`trainer.runtime.keras_compat.nested_function_graph`).

Ops whose shapes are unknown at trace time (e.g. a variable sequence length) count 0
(the profiler prints how many), as do custom ops without registered statistics.

Reported in every ``kind == "train"`` telemetry record (see :class:`FlopsMeter`):
``train/tflops`` = ``train/flops_per_example × perf/examples_per_s / 1e12`` (the job's
achieved model TFLOPS over all workers, from the window's loop-time throughput);
``train/mfu`` = ``train/tflops`` / (peak TFLOPS of one device × replicas) and
``train/hfu`` the same with hardware FLOPs, when the peak is known:
``telemetry.peak_tflops`` (per device) if set, else :data:`PEAK_TFLOPS` for the device's
name and the compute dtype. CPUs have no table entry: MFU/HFU are null there rather
than a guess.
"""

from __future__ import annotations

import os

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from trainer import data
from trainer.distribution import strategies
from trainer.run_context import RunContext
from trainer.runtime import keras_compat

#: Dense (no sparsity) peak TFLOPS of ONE device by compute dtype, from the vendors'
#: datasheets (which print tensor-core figures "with sparsity": half of those here).
#: Keys are matched as substrings of the GPU name TensorFlow reports (first match
#: wins) or of ``TPU_ACCELERATOR_TYPE``. ``"tf32"`` is the float32 peak on Ampere and
#: later, where TensorFlow runs float32 matmuls in TF32 by default. TPU entries are per
#: TensorFlow device (v2/v3: one core, half a chip; v4 and later: one chip). Sources:
#: H100 https://www.nvidia.com/en-us/data-center/h100/ (SXM; PCIe),
#: H200 https://www.nvidia.com/en-us/data-center/h200/ (SXM: the H100 SXM's compute;
#: NVL), A100 https://www.nvidia.com/en-us/data-center/a100/,
#: L4 https://www.nvidia.com/en-us/data-center/l4/,
#: T4 https://www.nvidia.com/en-us/data-center/tesla-t4/,
#: TPU https://cloud.google.com/tpu/docs/v4 and https://cloud.google.com/tpu/docs/v5e.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"float32": 51.2, "tf32": 378.0, "bfloat16": 756.0, "float16": 756.0},
    "H100": {"float32": 66.9, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4},
    "H200 NVL": {"float32": 60.0, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5},
    "H200": {"float32": 66.9, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4},
    "A100": {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0},
    "L40S": {"float32": 91.6, "tf32": 183.0, "bfloat16": 362.0, "float16": 362.0},
    "A10": {"float32": 31.2, "tf32": 62.5, "bfloat16": 125.0, "float16": 125.0},
    "L4": {"float32": 30.3, "tf32": 60.0, "bfloat16": 121.0, "float16": 121.0},
    "V100": {"float32": 15.7, "float16": 125.0},
    "T4": {"float32": 8.1, "float16": 65.0},
    "v2": {"bfloat16": 22.5},
    "v3": {"bfloat16": 61.5},
    "v4": {"bfloat16": 275.0},
    "v5litepod": {"bfloat16": 197.0},
    "v5e": {"bfloat16": 197.0},
    "v5p": {"bfloat16": 459.0},
    "v6e": {"bfloat16": 918.0},
}

_PROFILE_OPTIONS = {**tf.compat.v1.profiler.ProfileOptionBuilder.float_operation(),
                    "output": "none"}
# Attributes that name the functions an op calls (a call, a cond's branches, a loop body).
_FUNCTION_ATTRS = ("f", "then_branch", "else_branch", "body")


def graph_flops(graph: tf.Graph) -> int:
    """Float operations of ``graph`` and of the functions it calls: a call and a loop
    body once; of a ``tf.cond``'s branches, the larger. Host-side; only reads ``graph``.

    Ops whose shapes are unknown at trace time count 0 (the profiler logs how many).
    """
    tf_logger = tf.get_logger()
    level = tf_logger.level
    tf_logger.setLevel("ERROR")  # the profiler's deprecation notices
    try:
        total = tf.compat.v1.profiler.profile(graph=graph, options=_PROFILE_OPTIONS
                                              ).total_float_ops
    finally:
        tf_logger.setLevel(level)
    for op in graph.get_operations():
        nested = []
        for attr in _FUNCTION_ATTRS:
            try:
                name = op.get_attr(attr).name
            except ValueError:  # the op has no such attribute
                continue
            body = keras_compat.nested_function_graph(graph, name)
            if body is not None:
                nested.append(graph_flops(body))
        total += max(nested, default=0)
    return total


def _local_step_copies(strategy: tf.distribute.Strategy) -> int:
    """Copies of the replica step in one worker's train loop graph: one per local
    replica, except on TPU, where one is compiled and replicated (not verified on a TPU
    here)."""
    if isinstance(strategy, tf.distribute.TPUStrategy):
        return 1
    return strategy.num_replicas_in_sync // strategies.num_workers(strategy)


def hardware_flops_per_example(run: RunContext) -> float:
    """Float operations the compiled train step executes per example (module docstring).

    Host, cross-replica context, after the first train loop of a ``fit()``; reads the
    loop's graph (``run.train_graph()``), traces nothing. Raises ValueError
    before any loop or when the graph holds no counted operation.
    """
    graph = run.train_graph()
    if graph is None:
        raise ValueError("no train loop has been traced yet (call it after a fit() loop)")
    flops = graph_flops(graph)
    if flops <= 0:
        raise ValueError("the train step's graph holds no op with known FLOPs")
    return flops / (run.batch.per_replica * _local_step_copies(run.strategy))


def forward_flops_per_example(run: RunContext) -> float:
    """Float operations of ``run.model(features, training=True)`` per example.

    Host, cross-replica context, after the first train loop of a ``fit()``: traces the
    forward pass once as its own ``tf.function`` on one replica's train batch spec
    (``run.train_batch_spec()``, features by
    :func:`trainer.data.split_batch`; an unknown batch dimension is set to the
    per-replica batch) and counts its graph; runs nothing, does not retrace the train
    loop. Raises ValueError before any loop, for batches ``split_batch`` cannot split,
    or when the graph holds no counted operation.
    """
    spec = run.train_batch_spec()
    if spec is None:
        raise ValueError("no train loop has been traced yet (call it after a fit() loop)")
    batch = run.batch.per_replica
    features, _ = data.split_batch(spec)
    features = tf.nest.map_structure(
        lambda s: tf.TensorSpec([batch, *s.shape[1:]], s.dtype)
        if isinstance(s, tf.TensorSpec) and s.shape.rank and s.shape[0] is None else s,
        features)
    model = run.model
    forward = tf.function(lambda inputs: model(inputs, training=True), autograph=False)
    flops = graph_flops(forward.get_concrete_function(features).graph)
    if flops <= 0:
        raise ValueError("the model's forward pass holds no op with known FLOPs")
    return flops / batch


def model_flops_per_example(run: RunContext) -> float:
    """Model FLOPs of one train step per example: 3 × :func:`forward_flops_per_example`
    (forward + 2 × forward for the backward pass; PaLM's definition, module docstring)."""
    return 3.0 * forward_flops_per_example(run)


def compute_dtype() -> str:
    """The dtype matmuls run in: the Keras policy's, with float32 as ``"tf32"`` when
    TensorFlow's TF32 execution is on (the default; it acts on Ampere and later)."""
    dtype = keras.mixed_precision.global_policy().compute_dtype
    if dtype == "float32" and tf.config.experimental.tensor_float_32_execution_enabled():
        return "tf32"
    return dtype


def device_peak_tflops(dtype: str) -> tuple[str, float | None]:
    """``(device name, peak TFLOPS of one device for dtype or None)`` of this process's
    first accelerator (TPU kind from ``TPU_ACCELERATOR_TYPE``). ``"tf32"`` falls back to
    the float32 peak on devices without TF32."""
    tpus = tf.config.list_logical_devices("TPU")
    gpus = tf.config.list_physical_devices("GPU")
    if tpus:
        name = os.environ.get("TPU_ACCELERATOR_TYPE", "TPU")
    elif gpus:
        name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "GPU")
    else:
        return "CPU", None
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return name, peaks.get(dtype, peaks.get("float32") if dtype == "tf32" else None)
    return name, None


class FlopsMeter:
    """Adds ``train/flops_per_example``, ``train/tflops``, ``train/mfu``,
    ``train/hardware_flops_per_example`` and ``train/hfu`` to telemetry (module docstring).

    A record source of :class:`trainer.telemetry.service.Telemetry`
    (``Telemetry(config, sources=[meter])``): telemetry calls :meth:`values` for every
    train record, so the keys reach metrics.jsonl, TensorBoard and every logger. Both
    counts are made at the first call (the first logging window) and kept for the
    Trainer's life; they are the same on every worker. A count that fails is logged once
    and its keys are null; the run goes on.

    Args:
      config: the run's config (``telemetry.peak_tflops``).
    """

    def __init__(self, config: ml_collections.ConfigDict):
        self.config = config
        self.flops_per_example: float | None = None  # model FLOPs
        self.hardware_flops_per_example: float | None = None
        self.peak_tflops: float | None = None  # per device; None: unknown
        self._estimated = False

    @staticmethod
    def _count(what: str, count, run: RunContext) -> float | None:
        try:
            return count(run)
        except Exception as error:  # noqa: BLE001 - a missing estimate must not stop a run
            logging.warning("%s FLOPs estimate unavailable (its train/ keys are null): %s",
                            what, error)
            return None

    def _estimate(self, run: RunContext) -> None:
        self._estimated = True
        self.flops_per_example = self._count("model", model_flops_per_example, run)
        self.hardware_flops_per_example = self._count(
            "hardware", hardware_flops_per_example, run)
        dtype = compute_dtype()
        name, peak = device_peak_tflops(dtype)
        self.peak_tflops = self.config.telemetry.peak_tflops or peak
        logging.info("train step per example (TF graph profiler): %s model FLOPs (3 x "
                     "forward), %s hardware FLOPs (the step's graph); %s",
                     _format(self.flops_per_example), _format(self.hardware_flops_per_example),
                     f"peak {self.peak_tflops:g} TFLOPS per device ({name}, {dtype})"
                     if self.peak_tflops else
                     f"no train/mfu: peak of {name} ({dtype}) unknown; set "
                     f"telemetry.peak_tflops")

    def values(self, run: RunContext, logs: dict[str, float]) -> dict[str, float | None]:
        """The record values for a logging window (``logs``: its ``on_log`` values)."""
        if not self._estimated:
            self._estimate(run)
        examples_per_s = logs["perf/examples_per_s"]
        peak = (self.peak_tflops * run.strategy.num_replicas_in_sync
                if self.peak_tflops else None)
        values: dict[str, float | None] = {}
        for flops, per_example, rate, utilisation in (
                (self.flops_per_example, "train/flops_per_example", "train/tflops",
                 "train/mfu"),
                (self.hardware_flops_per_example, "train/hardware_flops_per_example", None,
                 "train/hfu")):
            tflops = flops * examples_per_s / 1e12 if flops is not None else None
            values[per_example] = flops
            if rate:
                values[rate] = tflops
            values[utilisation] = tflops / peak if tflops is not None and peak else None
        return values


def _format(flops: float | None) -> str:
    return "unknown" if flops is None else f"{flops:.4g}"
