"""Subprocess entry of tests/step/test_grad_compression.py: one replica count per process.

    python -m tests.step.run_grad_compression --replicas N --out runs.npz

On N virtual CPU devices (Mirrored; 1: one device) trains, each in a fresh Trainer:

  none, bf16              the toy Trainer (SGD, 20 steps), float32, by
                          distribute.grad_compression
  mixed_none, mixed_fp16  the same under mixed_float16
  overflow_none,          a one-weight model whose scaled gradient is 2**15 per replica
  overflow_fp16           (fits float16) and 2**16 summed over 2 replicas (does not),
                          mixed_float16 with initial_loss_scale=2**16, 2 steps

and saves every final weight as ``"<run>/<i>"`` plus ``facts`` (JSON): per run the
loss scale and skipped steps at the end and whether every weight is finite. All in one
process: Trainers that differ only in grad_compression share one strategy (two Mirrored
strategies over the same devices would clash on their collective keys).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

OVERFLOW_SCALE = 2.0 ** 16  # the loss scale at which the 2-replica sum overflows float16


def _overflow_trainer():
    """A Trainer whose scaled gradient is known: a float32 ``Dense(1)`` without bias on
    inputs of ones, the per-example loss its output, so every kernel element's gradient
    is scale * (local examples) / (global batch): scale / replicas on each replica."""
    import keras
    import tensorflow as tf

    import trainer

    class OverflowTrainer(trainer.Trainer):
        def build_model(self):
            return keras.Sequential([keras.Input((4,)), keras.layers.Dense(
                1, use_bias=False, kernel_initializer="zeros", dtype="float32")])

        def build_train_dataset(self, ctx):
            batch = ctx.get_per_replica_batch_size(self.config.train.global_batch_size)
            return tf.data.Dataset.from_tensors(
                (tf.ones((batch, 4)), tf.zeros((batch,)))).repeat()

        def compute_loss(self, batch, outputs):
            return outputs[:, 0]

    return OverflowTrainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import tensorflow as tf
    from absl import logging

    from tests.support import toy

    logging.set_verbosity(logging.INFO)  # the trace-time line that names the compression
    mixed = {"precision.policy": "mixed_float16"}
    overflow = {**mixed, "precision.initial_loss_scale": OVERFLOW_SCALE, "train.steps": 2,
                "train.steps_per_loop": 1, "train.log_every_steps": 1,
                "train.global_batch_size": 8}
    runs = {
        "none": (toy.ToyTrainer, {}),
        "bf16": (toy.ToyTrainer, {"distribute.grad_compression": "bf16"}),
        "mixed_none": (toy.ToyTrainer, mixed),
        "mixed_fp16": (toy.ToyTrainer, {**mixed, "distribute.grad_compression": "fp16"}),
        "overflow_none": (_overflow_trainer(), overflow),
        "overflow_fp16": (_overflow_trainer(),
                          {**overflow, "distribute.grad_compression": "fp16"}),
    }
    default_strategy = set()
    if args.replicas == 1:  # a Trainer given TensorFlow's default strategy (no devices list)
        runs["bf16_default_strategy"] = runs["bf16"]
        default_strategy.add("bf16_default_strategy")
    out, facts = {}, {}
    for name, (cls, overrides) in runs.items():
        config = toy.on_replicas(toy.toy_config(**{"perf.plan": "fixed", **overrides}),
                                 args.replicas)
        t = (cls(config, strategy=tf.distribute.get_strategy()) if name in default_strategy
             else cls(config))
        assert t.strategy.num_replicas_in_sync == args.replicas
        t.fit()
        weights = t.model.get_weights()
        for i, w in enumerate(weights):
            out[f"{name}/{i}"] = w
        skipped, scale = t.precision.counters()
        facts[name] = {"skipped_steps": skipped, "loss_scale": scale, "step": t.step,
                       "finite": all(bool(np.isfinite(w).all()) for w in weights)}
        t.close()
    out["facts"] = np.array(json.dumps(facts))
    np.savez(args.out, **out)


if __name__ == "__main__":
    from trainer.runtime.fast_exit import exit_now

    main()
    exit_now(0)  # no teardown of distributed iterators (up to 60 s each)
