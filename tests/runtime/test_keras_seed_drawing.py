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
from trainer.runtime import keras_compat, pinned_draws
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


def _row_draws(rows, shape) -> list[np.ndarray]:
    """Keras' uniform, normal, truncated normal, a Dropout (with and without a
    noise_shape) of ``shape`` and a draw of 5 rows, keyed, in a ``draw_rows(*rows)``
    block; traced (the batch size known, and not: the decision in the graph)."""
    out = []
    for spec in (tf.TensorSpec(shape), tf.TensorSpec([None, shape[1]])):
        generator = keras.random.SeedGenerator(5)
        dropout = keras.layers.Dropout(0.5, seed=5)
        columns = keras.layers.Dropout(0.5, noise_shape=(None, 1), seed=6)

        @tf.function(input_signature=[spec])
        def draw(x):
            with keras_compat.seed_key(7), pinned_draws.draw_rows(*rows):
                return [keras.random.uniform(tf.shape(x), seed=generator),
                        keras.random.normal(tf.shape(x), seed=3),
                        keras.random.truncated_normal(tf.shape(x), seed=4),
                        dropout(tf.ones_like(x), training=True),
                        columns(tf.ones_like(x), training=True),
                        keras.random.uniform([5, 3], seed=8)]
        out.append([t.numpy() for t in draw(tf.ones(shape))])
    return out


def test_keras_draws_of_a_replicas_rows_are_its_rows_of_the_global_draw():
    # distribute.random_draws="global" (trainer.step.random_streams): Keras' uniform,
    # normal and truncated normal draws and its dropout reach TensorFlow through
    # pinned_draws.PINNED_TF, which draws a tensor led by a replica's rows for all rows
    # and keeps the replica's. A Keras upgrade that draws elsewhere fails here.
    keras_compat.keyed_seed_drawing()
    b, n = 4, 3
    whole = _row_draws((0, b * n, b * n), (b * n, 6))[0]
    parts = [_row_draws((r * b, b, b * n), (b, 6)) for r in range(n)]
    for trace in range(2):
        for i in range(5):
            rows = np.concatenate([part[trace][i] for part in parts])
            np.testing.assert_array_equal(rows, whole[i], err_msg=f"trace {trace} draw {i}")
        for part in parts:  # not led by the rows: drawn whole, the same on every replica
            np.testing.assert_array_equal(part[trace][5], whole[5])
    assert 0.3 < float(np.mean(whole[3] > 0)) < 0.7  # a dropout mask, not all kept


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


def test_rewound_seeds_include_the_installed_global_generator():
    # Manual data parallelism's slices under distribute.random_draws="global" draw the
    # same seeds: the rewind covers the Trainer's global generator an unseeded op draws
    # from as well as a SeedGenerator passed as the seed.
    generator = keras.random.SeedGenerator(9)
    held = keras.random.SeedGenerator(4)
    start = generator.state.numpy()

    @tf.function
    def draw_twice():
        with keras_compat.global_seed_generator(generator), \
                keras_compat.rewindable_seeds() as rewind:
            first = [keras.random.uniform([8]), keras.random.uniform([8], seed=held)]
            rewind()
            return first, [keras.random.uniform([8]), keras.random.uniform([8], seed=held)]

    first, second = draw_twice()
    for i, (a, b) in enumerate(zip(first, second)):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"draw {i}")
    assert not np.array_equal(generator.state.numpy(), start)  # drawn once, not undone
