"""Subprocess entry for the BatchNormalization tests: one replica count per process.

    python -m tests.distribution.run_batch_norm --replicas N --out bn.npz

Trains keras.applications' MobileNetV3Small (built from constructor arguments, no
weights, 34 BatchNormalization layers, no dropout: random masks differ per replica by
design) for 3 SGD steps on random 32x32 images (each its own scale and offset, so
every layer's batch statistics are well conditioned), with and without
``distribute.sync_batch_norm``, and saves every weight (``plain/i``, ``sync/i``) and the
warnings each Trainer logged (``plain_warnings``, ``sync_warnings``).
"""

from __future__ import annotations

import argparse
import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


class Warnings(logging.Handler):
    """Collects the text of the warnings logged through absl."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import keras
    import tensorflow as tf

    import trainer
    from tests.support import toy

    class MobileNetTrainer(trainer.Trainer):
        def build_model(self):
            return keras.applications.MobileNetV3Small(
                input_shape=(32, 32, 3), weights=None, classes=10, dropout_rate=0.0,
                include_preprocessing=False, minimalistic=True)

        def build_train_dataset(self, ctx):
            rng = np.random.default_rng(0)
            # Each image its own scale and offset: of pure noise images the deep layers
            # see nearly one value per channel across the batch (the noise averages
            # out), so their batch variance is a cancellation and rounding (another
            # CPU's summation order, oneDNN on or off) grew to 1e-2 in 3 steps.
            x = (rng.normal(size=(256, 32, 32, 3)) * rng.uniform(0.5, 2.0, (256, 1, 1, 3))
                 + rng.normal(size=(256, 1, 1, 3))).astype("float32")
            y = rng.integers(0, 10, 256)
            batch = ctx.get_per_replica_batch_size(self.config.train.global_batch_size)
            return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
                batch, drop_remainder=True)

        def compute_loss(self, batch, outputs):
            return keras.losses.sparse_categorical_crossentropy(batch[1], outputs)

    out = {}
    for name, sync in (("plain", False), ("sync", True)):
        config = toy.on_replicas(toy.toy_config(**{
            "train.global_batch_size": 16, "train.steps": 3, "train.steps_per_loop": 3,
            "optimizer.learning_rate": 0.002, "telemetry.progress": "off"}), args.replicas)
        config.distribute.sync_batch_norm = sync
        warnings = Warnings()
        logging.getLogger("absl").addHandler(warnings)
        t = MobileNetTrainer(config)
        logging.getLogger("absl").removeHandler(warnings)
        t.fit()
        for i, w in enumerate(t.model.get_weights()):
            out[f"{name}/{i}"] = w
        out[f"{name}_warnings"] = np.array(warnings.lines, dtype=object)
    np.savez(args.out, **out)


if __name__ == "__main__":
    from trainer.runtime.fast_exit import exit_now

    main()
    exit_now(0)
