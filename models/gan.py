"""A two-optimizer example: a small GAN on scikit-learn's 8x8 digits (no download).

    python -m trainer.main --config=models/configs/gan.py --workdir=/tmp/gan

The custom-loop case ``model.fit`` serves badly: two networks, two optimizers, two
updates per step. :class:`DigitsGANTrainer` overrides ``train_step`` and calls
``Trainer.apply_gradients`` twice with explicit ``variables=`` and ``optimizer=``:

1. the discriminator D (``self.d_optimizer``) on real digits (label 1) and generated
   ones (label 0);
2. the generator G (``self.optimizer``, from ``config.optimizer``) so that D labels its
   samples real (the non-saturating loss).

Each call averages by the global batch and all-reduces its own gradients, so the
example trains identically on 1, 2 or N replicas. ``self.model`` is a
:class:`GAN` holding both networks (its weights are G's and D's); calling it maps
latent vectors ``[b, latent_dim]`` to generated digits ``[b, 64]`` in [0, 1].

Noise is ``tf.random.stateless_normal`` seeded by (step, replica id): different on
every replica and step, identical on a rerun with the same seed.
"""

from __future__ import annotations

from typing import Sequence

import keras
import ml_collections
import tensorflow as tf

import trainer
from models.digits import load_digits_split
from trainer import optimizers, precision


class GAN(keras.Model):
    """Generator + discriminator; ``call(z)`` generates (the inference function)."""

    def __init__(self, generator: keras.Model, discriminator: keras.Model, **kwargs):
        super().__init__(**kwargs)
        self.generator = generator
        self.discriminator = discriminator
        self.built = True  # both networks start with keras.Input: their weights exist

    def call(self, z, training=False):
        return self.generator(z, training=training)


def _mlp(inputs: int, hidden: int, outputs: int, out_activation: str | None,
         name: str) -> keras.Model:
    return keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(hidden),
        keras.layers.LeakyReLU(0.2),
        keras.layers.Dense(hidden),
        keras.layers.LeakyReLU(0.2),
        keras.layers.Dense(outputs),
        keras.layers.Activation(out_activation or "linear", dtype="float32"),
    ], name=name)


def _bce(labels_value: float, logits: tf.Tensor) -> tf.Tensor:
    """Per-example binary cross-entropy against a constant label; ``logits`` [b, 1] -> [b]."""
    labels = tf.fill(tf.shape(logits), labels_value)
    return keras.losses.binary_crossentropy(labels, logits, from_logits=True)


class DigitsGANTrainer(trainer.Trainer):
    """GAN on the digits train split; ``config.model``: latent_dim, hidden, d_learning_rate.

    Overrides ``train_step`` only (no ``compute_loss``: its two losses live in the step).
    """

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | None = None,
                 strategy: tf.distribute.Strategy | None = None,
                 callbacks: Sequence[trainer.Callback] = ()):
        (self._images, _), _ = load_digits_split(config.data.split_seed)
        super().__init__(config, workdir, strategy, callbacks)
        # The second optimizer's slots must exist before the first (traced) step, in
        # scope; the framework does this for self.optimizer only.
        self.build_optimizer_variables(self.optimizer, self.model.generator.trainable_variables)
        self.build_optimizer_variables(self.d_optimizer,
                                       self.model.discriminator.trainable_variables)

    def build_model(self) -> keras.Model:
        cfg = self.config.model
        generator = _mlp(cfg.latent_dim, cfg.hidden, 64, "sigmoid", "generator")
        discriminator = _mlp(64, cfg.hidden, 1, None, "discriminator")
        d_config = ml_collections.ConfigDict(self.config.to_dict())
        d_config.optimizer.learning_rate = cfg.d_learning_rate
        self.d_optimizer = optimizers.build_optimizer(d_config)
        return GAN(generator, discriminator, name="digits_gan")

    def build_train_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        """Per-replica batches of real digits ``(images [b, 64], zeros [b])``."""
        batch = ctx.get_per_replica_batch_size(self.config.train.global_batch_size)
        images = self._images
        return (tf.data.Dataset.from_tensor_slices((images, tf.zeros(len(images), tf.int32)))
                .shuffle(len(images), seed=self.config.seed)
                .repeat()
                .batch(batch, drop_remainder=True))

    def _noise(self, batch_size: tf.Tensor, salt: int) -> tf.Tensor:
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        seed = tf.stack([tf.cast(self.step_counter, tf.int64) * 2 + salt,
                         tf.cast(replica, tf.int64) + 1000 * self.config.seed])
        return tf.random.stateless_normal([batch_size, self.config.model.latent_dim], seed)

    def train_step(self, batch) -> dict[str, tf.Tensor]:
        """Replica context: one D update, then one G update; returns both losses.

        ``loss`` (required by the loop) is ``d_loss + g_loss``; ``d_real`` and
        ``d_fake`` are D's mean probability of "real" on the real and generated digits.
        """
        real, _ = batch
        gan = self.model
        batch_size = tf.shape(real)[0]

        with tf.GradientTape() as tape:
            fake = gan.generator(self._noise(batch_size, 0), training=True)
            real_logits = precision.outputs_to_float32(gan.discriminator(real, training=True))
            fake_logits = precision.outputs_to_float32(gan.discriminator(fake, training=True))
            d_per_example = _bce(1.0, real_logits) + _bce(0.0, fake_logits)
        d_loss = self.apply_gradients(tape, d_per_example,
                                      variables=gan.discriminator.trainable_variables,
                                      optimizer=self.d_optimizer)

        with tf.GradientTape() as tape:
            fake = gan.generator(self._noise(batch_size, 1), training=True)
            fake_logits = precision.outputs_to_float32(gan.discriminator(fake, training=True))
            g_per_example = _bce(1.0, fake_logits)
        g_loss = self.apply_gradients(tape, g_per_example,
                                      variables=gan.generator.trainable_variables,
                                      optimizer=self.optimizer)
        return {"loss": d_loss + g_loss, "d_loss": d_loss, "g_loss": g_loss,
                "d_real": tf.reduce_mean(tf.sigmoid(real_logits)),
                "d_fake": tf.reduce_mean(tf.sigmoid(fake_logits))}
