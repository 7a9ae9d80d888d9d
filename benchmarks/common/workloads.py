"""The benchmark workloads: model builders and synthetic in-memory data.

Every workload is small enough for 2 CPU cores and fixed by the issue that asked for it:

* ``mlp``: 784 -> 256 -> 10, batch 64 (overhead-bound: per-step cost is tiny);
* ``digits``: the digits model's shape (``models/digits.py``): 64 -> 128 -> 10, batch 64;
* ``cnn``: 32x32x3, conv 32/64/128 + dense, batch 128;
* ``transformer``: encoder classifier, seq 128, d 128, 2 layers, 4 heads, batch 32;
* ``wide_mlp``: 784 -> 4096 -> 2048 -> 10, batch 128: 11.6 M parameters (46 MB of
  float32 gradients per step), the communication-heavy model of the multi-host
  benchmark (``benchmarks/parallel/multihost_throughput.py``);
* ``deep_mlp``: 784 -> 1024 x 8 -> 10, batch 128: 8.2 M parameters (33 MB of
  gradients) over 9 layers of about the same size, the multi-host benchmark's model
  where gradient packs have a backward pass to overlap;
* ``transformer_tiny`` (seq 32, d 32, 1 layer, 2 heads, batch 16) and ``cnn_tiny`` (the
  cnn at batch 16): the device check's sizes on a CPU (``benchmarks/device/device_check.py``
  dry mode), where float16 is emulated.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import keras
import numpy as np


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    batch_size: int
    build_model: Callable[[], keras.Model]
    input_shape: tuple
    input_dtype: str
    num_classes: int = 10

    def data(self, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``n`` synthetic examples ``(x, y)`` (y: int32 class ids)."""
        rng = np.random.default_rng(seed)
        if self.input_dtype == "int32":
            x = rng.integers(0, 1000, size=(n, *self.input_shape)).astype(np.int32)
        else:
            x = rng.normal(size=(n, *self.input_shape)).astype(np.float32)
        y = rng.integers(0, self.num_classes, size=(n,)).astype(np.int32)
        return x, y


def _mlp() -> keras.Model:
    return keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10),
        keras.layers.Activation("linear", dtype="float32"),
    ])


def _wide_mlp() -> keras.Model:
    return keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(4096, activation="relu"),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(10),
        keras.layers.Activation("linear", dtype="float32"),
    ])


def _deep_mlp() -> keras.Model:
    return keras.Sequential([
        keras.Input((784,)),
        *[keras.layers.Dense(1024, activation="relu") for _ in range(8)],
        keras.layers.Dense(10),
        keras.layers.Activation("linear", dtype="float32"),
    ])


def _digits() -> keras.Model:
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
        keras.layers.Activation("linear", dtype="float32"),
    ])


def _cnn() -> keras.Model:
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(128, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
        keras.layers.Activation("linear", dtype="float32"),
    ])


def _transformer(seq: int = 128, d: int = 128, layers: int = 2, heads: int = 4) -> keras.Model:
    tokens = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(1000, d)(tokens)
    positions = keras.ops.arange(seq)
    x = x + keras.layers.Embedding(seq, d)(positions)
    for _ in range(layers):
        attended = keras.layers.MultiHeadAttention(heads, d // heads)(x, x)
        x = keras.layers.LayerNormalization()(x + attended)
        hidden = keras.layers.Dense(4 * d, activation="gelu")(x)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dense(d)(hidden))
    x = keras.layers.GlobalAveragePooling1D()(x)
    logits = keras.layers.Dense(10)(x)
    logits = keras.layers.Activation("linear", dtype="float32")(logits)
    return keras.Model(tokens, logits)


WORKLOADS = {
    "mlp": Workload("mlp", 64, _mlp, (784,), "float32"),
    "digits": Workload("digits", 64, _digits, (64,), "float32"),
    "cnn": Workload("cnn", 128, _cnn, (32, 32, 3), "float32"),
    "transformer": Workload("transformer", 32, _transformer, (128,), "int32"),
    "wide_mlp": Workload("wide_mlp", 128, _wide_mlp, (784,), "float32"),
    "deep_mlp": Workload("deep_mlp", 128, _deep_mlp, (784,), "float32"),
    "transformer_tiny": Workload(
        "transformer_tiny", 16, lambda: _transformer(seq=32, d=32, layers=1, heads=2), (32,),
        "int32"),
    "cnn_tiny": Workload("cnn_tiny", 16, _cnn, (32, 32, 3), "float32"),
}


def framework_trainer(workload: Workload, steps_per_loop: int | None, strategy=None,
                      workdir: str | None = None, callbacks=(), **overrides):
    """A ``trainer.Trainer`` on ``workload``'s synthetic data (Adam, no logging noise).

    ``steps_per_loop``: ``train.steps_per_loop`` (None: the config's default).
    ``overrides`` maps ``"section.field"`` to values set on the config before the
    Trainer is built; ``strategy``, ``workdir`` and ``callbacks`` are passed through.
    """
    from benchmarks.common.arrays_trainer import ArraysTrainer
    from trainer import config as config_lib

    x, y = workload.data(4096)

    class BenchTrainer(ArraysTrainer):
        def build_model(self):
            return workload.build_model()

        def arrays(self):
            return x, y

    config = config_lib.get_config()
    config.train.global_batch_size = workload.batch_size
    if steps_per_loop is not None:
        config.train.steps_per_loop = steps_per_loop
    config.train.steps = config.train.steps_per_loop
    config.train.log_every_steps = 10**9
    config.optimizer.name = "adam"
    config.telemetry.progress = "off"
    config.update_from_flattened_dict(overrides)
    return BenchTrainer(config, workdir, strategy=strategy, callbacks=callbacks)
