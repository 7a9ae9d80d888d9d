"""FLOPs of the training step, achieved TFLOPS and model FLOPs utilisation (MFU).

How the step is counted. Once, at the first logging window, the graph of the compiled
train loop that ``fit()`` runs (``trainer.driver.train_graph()``: no retrace, nothing
runs) is read: its loop body calls the train step — the Trainer's ``train_step``,
default or override, under ``strategy.run`` — once. TensorFlow's graph profiler
(``tf.compat.v1.profiler.profile`` with ``ProfileOptionBuilder.float_operation()``)
then adds up the float operations TensorFlow registers for the graph's ops (``MatMul``
2·m·n·k, convolutions, element-wise ops...), and the same is done inside nested
functions: an XLA-compiled forward/backward (``perf.jit_compile``), the larger branch of
a ``tf.cond`` (the update of a step that is not skipped), a loop body once (reached
through :func:`trainer.keras_compat.nested_function_graph`). XLA's cost analysis is not
used: TensorFlow's Python API does not expose it (only the HLO text).

What the count is: what the graph computes. Forward, backward (only the gradients that
are needed: TensorFlow does not compute the gradient of the input data, so an MLP whose
first layer dominates counts below the ``3 × 2 × multiply-adds`` rule of thumb; the
digits MLP counts 0.74 of it), the optimizer update and the train metrics. Ops whose
shapes are unknown at trace time (e.g. a variable sequence length) are not counted (the
profiler prints how many), nor are custom ops without registered statistics.

Reported (values of every ``kind == "train"`` telemetry record, see
:class:`FlopsMeter`): ``train/flops_per_example``; ``train/tflops``, the whole job's
achieved rate, ``flops_per_example × perf/examples_per_s / 1e12`` (the window's
loop-time throughput over all workers); ``train/mfu`` = ``train/tflops`` / (peak TFLOPS
of one device × replicas), when the peak is known: ``telemetry.peak_tflops`` (per
device) if set, else :data:`PEAK_TFLOPS` for the device's name and the compute dtype.
CPUs have no table entry: ``train/mfu`` is null there rather than a guess.
"""

from __future__ import annotations

import os
from typing import Any

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from trainer import distribute, keras_compat
from trainer.callbacks import Callback

#: Dense (no sparsity) peak TFLOPS of ONE device by compute dtype, from the vendors'
#: datasheets. Keys are matched as substrings of the GPU name TensorFlow reports (first
#: match wins) or of ``TPU_ACCELERATOR_TYPE``. ``"tf32"`` is the float32 peak on
#: Ampere and later, where TensorFlow runs float32 matmuls in TF32 by default. TPU
#: entries are per TensorFlow device (v2/v3: one core, half a chip).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"float32": 51.2, "tf32": 378.0, "bfloat16": 756.0, "float16": 756.0},
    "H100": {"float32": 66.9, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4},
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


def step_flops_per_example(trainer: Any) -> float:
    """Float operations of one train step per example (see the module docstring).

    Host, cross-replica context, after the first train loop of a ``fit()``; reads the
    loop's graph (``trainer.driver.train_graph()``), traces nothing. Raises ValueError
    before any loop or when the graph holds no counted operation.
    """
    graph = trainer.driver.train_graph()
    if graph is None:
        raise ValueError("no train loop has been traced yet (call it after a fit() loop)")
    flops = graph_flops(graph)
    if flops <= 0:
        raise ValueError("the train step's graph holds no op with known FLOPs")
    strategy = trainer.strategy
    per_replica = trainer.config.train.global_batch_size // strategy.num_replicas_in_sync
    # The step's graph holds one copy of the replica step per local replica, except on
    # TPU, where one copy is compiled and replicated (not verified on a TPU here).
    copies = (1 if isinstance(strategy, tf.distribute.TPUStrategy)
              else strategy.num_replicas_in_sync // distribute.num_workers(strategy))
    return flops / (per_replica * copies)


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


class FlopsMeter(Callback):
    """Adds ``train/flops_per_example``, ``train/tflops`` and ``train/mfu`` to telemetry.

    A service callback and a record source of :class:`trainer.telemetry.Telemetry`
    (``Telemetry(config, sources=[meter])``): telemetry calls :meth:`values` for every
    train record, so the keys reach metrics.jsonl, TensorBoard and every logger. The
    estimate is made at the first call (the first logging window) and kept for the
    Trainer's life; it is the same on every worker (same graph).

    Args:
      config: the run's config (``telemetry.peak_tflops``).
    """

    def __init__(self, config: ml_collections.ConfigDict):
        self.config = config
        self.flops_per_example: float | None = None
        self.peak_tflops: float | None = None  # per device; None: unknown
        self._estimated = False

    def _estimate(self, trainer: Any) -> None:
        self._estimated = True
        try:
            self.flops_per_example = step_flops_per_example(trainer)
        except Exception as error:  # noqa: BLE001 - a missing estimate must not stop a run
            logging.warning("FLOPs estimate unavailable (train/flops_per_example, "
                            "train/tflops and train/mfu are null): %s", error)
            return
        dtype = compute_dtype()
        name, peak = device_peak_tflops(dtype)
        self.peak_tflops = self.config.telemetry.peak_tflops or peak
        logging.info("train step: %.4g FLOPs per example (TF graph profiler); %s",
                     self.flops_per_example,
                     f"peak {self.peak_tflops:g} TFLOPS per device ({name}, {dtype})"
                     if self.peak_tflops else
                     f"no train/mfu: peak of {name} ({dtype}) unknown; set "
                     f"telemetry.peak_tflops")

    def values(self, trainer: Any, logs: dict[str, float]) -> dict[str, float | None]:
        """The record values for a logging window (``logs``: its ``on_log`` values)."""
        if not self._estimated:
            self._estimate(trainer)
        if self.flops_per_example is None:
            return {"train/flops_per_example": None, "train/tflops": None, "train/mfu": None}
        tflops = self.flops_per_example * logs["perf/examples_per_s"] / 1e12
        devices = trainer.strategy.num_replicas_in_sync
        return {"train/flops_per_example": self.flops_per_example, "train/tflops": tflops,
                "train/mfu": tflops / (self.peak_tflops * devices) if self.peak_tflops else None}
