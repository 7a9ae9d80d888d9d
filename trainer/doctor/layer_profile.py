"""Per-layer cost of a model, each top-level layer timed alone (the doctor's section 7).

Host, eager: every layer with a known input (Sequential / functional models) runs on
random inputs of its real input shape (per-replica batch) in an in-graph loop, forward
and forward + backward; parameter and activation (output) memory come from the shapes.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import keras
import tensorflow as tf


def _timed_loop(fn: Callable, x, budget_s: float = 0.2) -> float:
    """Seconds per iteration of ``fn(x, n)`` (an in-graph loop), growing n to the budget."""
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
    return int(math.prod(shape)) * tf.as_dtype(dtype).size


def profile_layers(trainer: Any, top: int) -> dict[str, Any]:
    """(7) Forward/backward time and memory of each top-level layer, timed alone."""
    per_replica = trainer.batch.per_replica
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
