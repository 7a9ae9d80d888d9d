"""The pinned private way into Keras' random ops (trainer.runtime.keras_compat.seed_key):
every Keras random op of the TensorFlow backend draws its seed through the
``draw_seed`` its private modules import by name. A Keras upgrade that moves it fails
here, not silently in a run whose replicas all draw the same numbers (or whose draws
change algorithm when the step is compiled with XLA). Also the warning
for a stateful tf.random op in the step (trainer/step/random_streams.py)."""

from __future__ import annotations

import logging

import keras
import numpy as np
import tensorflow as tf

from tests.support import toy
from trainer.runtime import keras_compat
from trainer.step import random_streams


def _draws(*key) -> list[np.ndarray]:
    """keras.random with a SeedGenerator, an int seed; a Dropout; an image op: traced."""
    generator = keras.random.SeedGenerator(5)
    dropout = keras.layers.Dropout(0.5, seed=5)

    @tf.function
    def draw():
        with keras_compat.seed_key(*key):
            return [keras.random.uniform([64], seed=generator),
                    keras.random.normal([64], seed=3),
                    dropout(tf.ones([64]), training=True),
                    keras.ops.image.elastic_transform(tf.ones([1, 8, 8, 1]), seed=4)]

    return [t.numpy() for t in draw()]


def test_keras_draws_its_seeds_through_the_pinned_draw_seed():
    keras_compat.keyed_seed_drawing()
    for module in keras_compat.SEED_DRAWING_MODULES:
        assert hasattr(module.draw_seed, "keras_draw_seed"), module.__name__
    plain, again = _draws(), _draws()
    for a, b in zip(plain, again):  # no key: Keras' own numbers, the same every time
        np.testing.assert_array_equal(a, b)
    keyed0, keyed1, keyed0b = _draws(0, 7), _draws(1, 7), _draws(0, 7)
    for i, (a, b, c, d) in enumerate(zip(plain, keyed0, keyed1, keyed0b)):
        if i == 3:  # a constant image: every displacement gives it back; ran keyed
            continue
        assert not np.array_equal(a, b) and not np.array_equal(b, c), f"draw {i}"
        np.testing.assert_array_equal(b, d)  # the same key: the same numbers


def test_a_stateful_tf_random_op_in_the_step_is_named_once(caplog):
    class StatefulNoiseTrainer(toy.ToyTrainer):
        def compute_loss(self, batch, outputs):
            noise = tf.random.uniform(tf.shape(outputs), seed=1)
            return super().compute_loss(batch, outputs + 0.01 * noise)

    caplog.set_level(logging.WARNING, logger="absl")
    StatefulNoiseTrainer(toy.toy_config(**{"train.steps": 2,
                                           "telemetry.progress": "off"})).fit()
    warned = [r.getMessage() for r in caplog.records if "stateful TensorFlow op" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "RandomUniform" in warned[0] and "keras.random.SeedGenerator" in warned[0]


def test_keras_draws_with_philox_with_and_without_xla():
    # TensorFlow's default algorithm draws ThreeFry under XLA and philox without on a
    # CPU; Keras' random modules see keras_compat.PINNED_TF (philox): with seeds fixed
    # at trace time, the same numbers (seeds known only at run time draw other numbers
    # under XLA: TensorFlow's XLA philox kernel is not its CPU kernel).
    keras_compat.keyed_seed_drawing()
    generator = keras.random.SeedGenerator(2)

    def draw():
        with keras_compat.seed_key(3, 1):
            return [keras.random.uniform([256], seed=5), keras.random.normal([256], seed=6),
                    keras.random.truncated_normal([256], seed=7),
                    keras.random.dropout(tf.ones([256]), 0.5, seed=8)]

    state = generator.state.numpy()
    plain = [t.numpy() for t in tf.function(draw)()]
    generator.state.assign(state)
    compiled = [t.numpy() for t in tf.function(draw, jit_compile=True)()]
    for i, (a, b) in enumerate(zip(plain, compiled)):
        np.testing.assert_array_equal(a, b, err_msg=f"draw {i}")


def test_unseeded_keras_random_ops_draw_from_the_installed_global_generator():
    # A Trainer's step draws its unseeded keras.random ops from the Trainer's own
    # generator (trainer/step/random_streams.py), installed through Keras' private
    # GLOBAL_SEED_GENERATOR: a Keras that moves it fails here, not in a resumed run.
    generator = keras.random.SeedGenerator(9)
    start = generator.state.numpy()

    @tf.function
    def draw():
        with keras_compat.global_seed_generator(generator):
            return keras.random.dropout(tf.ones([64]), 0.5)

    draw()
    drawn = generator.state.numpy()
    assert not np.array_equal(drawn, start)
    keras.random.uniform([4])  # outside: Keras' own global generator again
    np.testing.assert_array_equal(generator.state.numpy(), drawn)
