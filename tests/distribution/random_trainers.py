"""A Trainer whose step draws random numbers every way a user writes them, for the tests
that replicas draw independent streams and a resume draws what an uninterrupted run draws
(tests/distribution/test_randomness.py, through run_randomness.py).

:class:`RandomTrainer`'s step draws from

* the model's own ``keras.layers.Dropout(0.5)`` (its SeedGenerator is a model variable);
* a ``keras.random.SeedGenerator`` the Trainer holds (``self.noise``, made in
  ``build_model``: not a model variable) through ``keras.random.normal``;
* ``keras.random.uniform`` with an int seed;
* ``keras.random.dropout`` without a seed (Keras' global ``SeedGenerator``);
* a ``tf.random.Generator`` a custom layer of the model holds (not a model variable;
  not under ``distribute.random_draws="global"``: TensorFlow gives each replica its own
  stream of it, so 1 and N replicas cannot draw alike);
* a ``keras.layers.Dropout(0.5)`` the Trainer holds (``self.probe``) on a tensor of
  ones: its output ``equal_share`` is the share of equal mask entries between the first
  and the second half of the global batch (on 2 replicas: replica 0's rows against
  replica 1's; about 0.5 when they draw independently). Not under
  ``distribute.strategy=manual`` (its slices cannot gather): ``equal_share`` is then 0.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from benchmarks.common.arrays_trainer import ArraysTrainer
from trainer import config as config_lib

WIDTH = 8
PROBE_UNITS = 64


class GeneratorNoise(keras.layers.Layer):
    """Adds noise drawn from a ``tf.random.Generator`` it holds, in training only."""

    def build(self, input_shape):
        self.generator = tf.random.Generator.from_seed(7)

    def call(self, x, training=False):
        if training:
            return x + 0.1 * self.generator.normal(tf.shape(x))
        return x


class RandomTrainer(ArraysTrainer):
    """Dense classifier over deterministic data with random ops of every kind in its step."""

    def build_model(self):
        self.noise = keras.random.SeedGenerator(3)
        self.probe = keras.layers.Dropout(0.5)
        noise = [GeneratorNoise()] if self.config.distribute.random_draws != "global" else []
        return keras.Sequential([keras.Input((WIDTH,)), *noise,
                                 keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dropout(0.5), keras.layers.Dense(2)])

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        x = np.random.default_rng(0).normal(size=(128, WIDTH)).astype(np.float32)
        return x, (x[:, 0] > 0).astype(np.int32)

    def train_step(self, batch):
        x, y = batch
        x = (x + keras.random.normal(tf.shape(x), stddev=0.1, seed=self.noise)
             + keras.random.uniform(tf.shape(x), maxval=0.1, seed=11))
        x = keras.random.dropout(x, rate=0.25)
        with tf.GradientTape() as tape:
            loss = self.compute_loss((x, y), self.model(x, training=True))
        mean_loss = self.apply_gradients(tape, loss)
        if self.config.distribute.strategy == "manual":
            return {"loss": mean_loss, "equal_share": tf.constant(0.0)}
        kept = self.probe(tf.ones([tf.shape(x)[0], PROBE_UNITS]), training=True) > 0
        masks = self.all_gather(tf.cast(kept, tf.float32))
        half = tf.shape(masks)[0] // 2
        equal = tf.cast(tf.equal(masks[:half], masks[half:2 * half]), tf.float32)
        return {"loss": mean_loss, "equal_share": tf.reduce_mean(equal)}


class UnseededLossTrainer(ArraysTrainer):
    """The default step (the one the telemetry's compute probe times) on
    :class:`RandomTrainer`'s data and model, its loss seeing the logits through
    ``keras.random.dropout`` without a seed."""

    build_model = RandomTrainer.build_model
    arrays = RandomTrainer.arrays

    def compute_loss(self, batch, outputs):
        return super().compute_loss(batch, keras.random.dropout(outputs, 0.25))


def probed_weights(replicas: int, probe_every_windows: int) -> list[np.ndarray]:
    """:class:`UnseededLossTrainer`'s weights after 8 steps, the compute probe run after
    every window from the 2nd (``probe_every_windows=1``) or never (0)."""
    config = random_config(replicas, 8, **{"telemetry.probe_every_windows": probe_every_windows})
    config.trainer = f"{UnseededLossTrainer.__module__}:{UnseededLossTrainer.__name__}"
    t = UnseededLossTrainer(config)
    t.fit()
    return [np.asarray(w) for w in t.model.get_weights()]


def final_arrays(t: RandomTrainer) -> list[np.ndarray]:
    """The model's weights, then the random generators' states outside the model."""
    return ([np.asarray(w) for w in t.model.get_weights()]
            + [np.asarray(v) for _, v in t.context.random_states()])


def random_config(replicas: int = 1, steps: int = 8, **overrides):
    """:class:`RandomTrainer`'s config on ``replicas`` Mirrored replicas (virtual CPUs)."""
    config = config_lib.get_config()
    config.trainer = f"{RandomTrainer.__module__}:{RandomTrainer.__name__}"
    config.train.global_batch_size = 16
    config.train.steps = steps
    config.train.steps_per_loop = 2
    config.train.log_every_steps = 2
    config.eval.every_steps = 0
    config.optimizer.name = "adam"
    config.optimizer.learning_rate = 0.01
    config.perf.plan = "fixed"
    config.distribute.strategy = "one_device"
    if replicas > 1:
        config.distribute.strategy = "mirrored"
        config.distribute.virtual_devices = replicas
    config.update_from_flattened_dict(overrides)
    return config


def train(replicas: int, steps: int, workdir: str | None = None,
          **overrides) -> tuple[list[np.ndarray], dict[str, float]]:
    """Trains (or resumes in ``workdir``) to ``steps`` (``overrides``: config fields):
    ``(final weights and random states, fit results)``."""
    t = RandomTrainer(random_config(replicas, steps, **overrides), workdir)
    assert t.strategy.num_replicas_in_sync == replicas, t.strategy
    results = t.fit()
    return final_arrays(t), results
