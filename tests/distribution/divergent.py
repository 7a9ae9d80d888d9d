"""Trainers whose replicas drift apart through user code the framework cannot average,
for the replica-consistency check (``config.trainer = "tests.distribution.divergent:X"``).

    python -m trainer.main --config=tests/distribution/divergent.py ...   # get_config()
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tests.support import toy


class PositiveCount(keras.layers.Layer):
    """Counts the examples whose first feature is positive: integer state whose update
    depends on each replica's own batch (the framework averages float state only)."""

    def build(self, shape):
        self.seen = self.add_weight(shape=(), initializer="zeros", dtype="int64",
                                    trainable=False, name="seen")

    def call(self, x, training=False):
        if training:
            self.seen.assign_add(tf.reduce_sum(tf.cast(x[:, 0] > 0, tf.int64)))
        return x


class CountsExamples(toy.ToyTrainer):
    def build_model(self):
        return keras.Sequential([keras.Input((8,)), PositiveCount(), keras.layers.Dense(3)])


class NudgesABias(toy.ToyTrainer):
    """Assigns to a trainable weight in the step, by a replica-dependent amount."""

    def train_step(self, batch):
        out = self.steps.train(batch)
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        self.model.layers[-1].bias.assign_add(0.001 * tf.cast(replica, tf.float32) * tf.ones(3))
        return out


def get_config():
    config = toy.toy_config(**{"train.steps": 10, "train.steps_per_loop": 5,
                               "checkpoint.every_steps": 5})
    config.trainer = "tests.distribution.divergent:CountsExamples"
    return config
