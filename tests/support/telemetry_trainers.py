"""Trainers with a known bottleneck, shared by the telemetry and doctor tests.

No tests here. ``SlowInputTrainer`` sleeps in a ``py_function`` for every batch (an
input-bound run); ``HeavyCnnTrainer`` reads one small cached array set through a CNN
(a compute-bound run); ``TurnsSlowTrainer`` starts fast and, with the ``TurnSlow``
component, becomes input-bound at ``SLOW_FROM_STEP`` (a throughput regression).
"""

from __future__ import annotations

import threading
import time

import keras
import numpy as np
import tensorflow as tf

from tests.support import toy
from trainer import Callback

SLEEP_S = 0.03
SLOW_FROM_STEP = 100


class SlowInputTrainer(toy.ToyTrainer):
    """Every batch waits SLEEP_S seconds in a py_function while ``self.slow`` is True
    (from the start here): the pipeline is the bottleneck. ``made``: the slow batches
    its pipelines (every copy: the input probe's too) made so far."""

    starts_slow = True

    def __init__(self, config, workdir=None, strategy=None, callbacks=()):
        super().__init__(config, workdir, strategy, callbacks)
        self.slow = tf.Variable(self.starts_slow, trainable=False)  # read by every pipeline
        self.made = 0
        self._made = threading.Condition()

    def wait_for_stock(self, batches: int, quiet_s: float) -> int:
        """Waits until the pipelines made ``batches`` slow batches from now, or made none
        for ``quiet_s`` seconds (the prefetch buffers are full: nothing pulls); returns
        how many they made (with nothing pulling: the stock now buffered)."""
        with self._made:
            start = self.made
            while self.made - start < batches:
                seen = self.made
                self._made.wait(quiet_s)
                if self.made == seen:
                    break
            return self.made - start

    def build_train_dataset(self, ctx):
        def sleepy(x):
            time.sleep(SLEEP_S)
            with self._made:
                self.made += 1
                self._made.notify_all()
            return x

        def maybe_sleep(x, y):
            slow = lambda: tf.ensure_shape(tf.py_function(sleepy, [x], tf.float32), x.shape)
            return tf.cond(self.slow, slow, lambda: x), y

        return super().build_train_dataset(ctx).map(maybe_sleep)


class SlowPreprocessingTrainer(SlowInputTrainer):
    """SlowInputTrainer whose reading (the in-memory toy examples) is fast: its input
    time is preprocessing (the sleep)."""

    def build_read_dataset(self, ctx):
        return tf.data.Dataset.from_tensor_slices(toy.toy_data())


class TurnsSlowTrainer(SlowInputTrainer):
    """Fast (no py_function runs) until :class:`TurnSlow` flips ``slow`` at SLOW_FROM_STEP.

    Compute-bound while fast: its 512-wide hidden layers take a few ms per step, far
    more than the in-memory pipeline, so an input probe that a loaded host slows several
    times over still finds the fast phase compute-bound (on the toy model's 0.6 ms step,
    a CI host's probe once took the pipeline for 10x the compute, and the fast windows
    for prefetched stock the detector must ignore).
    """

    starts_slow = False

    def build_model(self) -> keras.Model:
        return keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(512, activation="tanh"),
            keras.layers.Dense(512, activation="tanh"),
            keras.layers.Dense(3),
        ])


class TurnSlow(Callback):
    """Makes a TurnsSlowTrainer's input slow once the run reaches ``slow_from``, and for
    the one train loop that starts at each step in ``blips`` (a transient slowdown)."""

    def __init__(self, slow_from: int = SLOW_FROM_STEP, blips: tuple[int, ...] = ()):
        self.slow_from, self.blips = slow_from, set(blips)

    def on_loop_end(self, trainer):
        trainer.slow.assign(trainer.step >= self.slow_from or trainer.step in self.blips)


def cnn_config(**overrides):
    config = toy.toy_config(**overrides)
    config.trainer = "tests.support.telemetry_trainers:HeavyCnnTrainer"
    return config


class HeavyCnnTrainer(toy.ToyTrainer):
    """Three 3x3 convolutions on 16x16x3 images from a tiny cached dataset."""

    def build_model(self) -> keras.Model:
        return keras.Sequential([
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3),
        ])

    def build_train_dataset(self, ctx):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 16, 16, 3)).astype(np.float32)
        y = rng.integers(0, 3, size=(64,)).astype(np.int32)
        batch = ctx.get_per_replica_batch_size(self.config.train.global_batch_size)
        return (tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
                .cache().repeat())



class BatchNormDropoutTrainer(toy.ToyTrainer):
    """State the forward pass changes (BatchNorm statistics, dropout seed state)."""

    def build_model(self) -> keras.Model:
        return keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(3),
        ])
