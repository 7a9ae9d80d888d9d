"""A tiny deterministic Trainer used across the tests (synthetic data, no shuffle)."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import trainer
from trainer import config as config_lib

N_EXAMPLES = 512


def toy_data(n: int = N_EXAMPLES, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    w = rng.normal(size=(8, 3)).astype(np.float32)
    y = np.argmax(x @ w + 0.5 * rng.normal(size=(n, 3)), axis=1).astype(np.int32)
    return x, y


def toy_config(**overrides):
    """Default config for ToyTrainer; ``overrides`` maps "section.field" to values."""
    config = config_lib.get_config()
    config.trainer = "tests.support.toy:ToyTrainer"
    config.train.global_batch_size = 32
    config.train.steps = 20
    config.train.steps_per_loop = 5
    config.train.log_every_steps = 10
    config.optimizer.name = "sgd"
    config.optimizer.learning_rate = 0.1
    config.distribute.strategy = "one_device"
    config.update_from_flattened_dict(overrides)
    return config


def on_replicas(config, replicas: int):
    """``config`` on ``replicas`` Mirrored replicas over virtual CPU devices (1: as is)."""
    if replicas > 1:
        config.distribute.strategy = "mirrored"
        config.distribute.virtual_devices = replicas
    return config


def pinned(chosen: dict) -> dict:
    """The config overrides that pin the plan ``chosen`` (a plan record's ``chosen``)
    with ``perf.plan="fixed"`` ("section.field" to values)."""
    return {"perf.plan": "fixed", "train.steps_per_loop": chosen["steps_per_loop"],
            "perf.jit_compile": chosen["xla"] == "grads",
            "perf.jit_compile_step": chosen["xla"] == "step",
            "distribute.grad_pack_bytes": chosen["pack_bytes"]}


class ToyTrainer(trainer.Trainer):
    """Overrides only the three required hooks (plus metrics/eval for coverage)."""

    def build_model(self) -> keras.Model:
        return keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh",
                               kernel_regularizer=keras.regularizers.L2(1e-3)),
            keras.layers.Dense(3),
        ])

    def build_train_dataset(self, ctx):
        x, y = toy_data()
        batch = ctx.get_per_replica_batch_size(self.config.train.global_batch_size)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
            batch, drop_remainder=True)

    def compute_loss(self, batch, outputs):
        return keras.losses.sparse_categorical_crossentropy(batch[1], outputs, from_logits=True)


class CountingToyTrainer(ToyTrainer):
    """ToyTrainer that counts the calls of its ``build_train_dataset``."""

    train_datasets_built = 0

    def build_train_dataset(self, ctx):
        self.train_datasets_built += 1
        return super().build_train_dataset(ctx)


class ToyEvalTrainer(ToyTrainer):
    """ToyTrainer with an accuracy metric and an eval split with a short last batch."""

    def build_metrics(self):
        return {"accuracy": keras.metrics.SparseCategoricalAccuracy()}

    def build_eval_dataset(self, ctx):
        x, y = toy_data(100, seed=1)
        batch = ctx.get_per_replica_batch_size(self.eval_global_batch_size)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


class TapeStepTrainer(ToyTrainer):
    """A custom step on the framework's path: the per-example loss inside the tape, then
    ``self.apply_gradients`` (what a direct optimizer call is refused in favour of)."""

    def train_step(self, batch):
        with tf.GradientTape() as tape:
            outputs = self.model(batch[0], training=True)
            per_example_loss = self.compute_loss(batch, outputs)
        return {"loss": self.apply_gradients(tape, per_example_loss)}


class RunningMean(keras.layers.Layer):
    """Centres its input on a running mean of the batch means, updated in ``call`` with
    ``assign`` on a weight of Keras' default aggregation (as a user writes it), and
    counts its training calls (integer state, the same on every replica). The centring
    reads the mean after this call's update, or before it with ``read_first``."""

    def __init__(self, read_first: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.read_first = read_first

    def build(self, shape):
        self.mean = self.add_weight(shape=(shape[-1],), initializer="zeros",
                                    trainable=False, name="mean")
        self.calls = self.add_weight(shape=(), initializer="zeros", dtype="int64",
                                     trainable=False, name="calls")

    def call(self, x, training=False):
        centred = x - tf.convert_to_tensor(self.mean) if self.read_first else None
        if training:
            self.mean.assign(0.9 * self.mean + 0.1 * tf.reduce_mean(x, axis=0))
            self.calls.assign_add(1)
        return centred if self.read_first else x - self.mean


class StatefulTrainer(ToyTrainer):
    """ToyTrainer whose forward pass reads and updates a running mean (the model's
    first layer), so the state changes the trained weights."""

    read_first = False

    def build_model(self) -> keras.Model:
        return keras.Sequential([
            keras.Input((8,)),
            RunningMean(read_first=self.read_first),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(3),
        ])


class ReadFirstStatefulTrainer(StatefulTrainer):
    """StatefulTrainer whose layer centres on the mean from before the step's update
    (manual data parallelism's device slices each update it; a read after the update
    would see the slice's own)."""

    read_first = True


class GlobalShareLossTrainer(ToyTrainer):
    """NEGATIVE CONTROL of the manual-optimization recipe of docs/training.md: the same
    step returning the loss it differentiates (divided by the GLOBAL batch), which the
    loop averages over replicas: logged as 1/N of the loss on N replicas."""

    manual_optimization = True

    def train_step(self, batch):
        with tf.GradientTape() as tape:
            per_example_loss = self.compute_loss(batch, self.model(batch[0], training=True))
            loss = tf.nn.compute_average_loss(
                per_example_loss, global_batch_size=self.config.train.global_batch_size)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply(grads, self.model.trainable_variables)
        return {"loss": loss}


class PerReplicaMeanTrainer(ToyTrainer):
    """NEGATIVE CONTROL: the common mistake of averaging the loss per replica.

    ``tf.reduce_mean`` over the local batch, then Keras sums gradients over replicas:
    the update is N times too large with N replicas. It declares ``manual_optimization``
    (else the framework refuses the direct ``optimizer.apply`` at trace time).
    """

    manual_optimization = True

    def train_step(self, batch):
        with tf.GradientTape() as tape:
            outputs = self.model(batch[0], training=True)
            loss = tf.reduce_mean(self.compute_loss(batch, outputs))
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply(grads, self.model.trainable_variables)
        return {"loss": loss}
