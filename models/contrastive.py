"""A contrastive step that needs the whole global batch: SimCLR-style on the 8x8 digits.

Each digit is seen in two noisy views; an MLP encoder maps each view to a unit vector,
and each example's first view must pick out its own second view among the second views
of EVERY example of the global batch (and the other way round): a softmax over
``global_batch_size`` candidates, temperature ``config.model.temperature``. On N replicas
each replica holds 1/N of the batch, so the step gathers the other replicas' embeddings
with ``self.all_gather`` (differentiable: the gradient reaches the replica that made each
embedding) and labels each local example by its place in the global batch. The loss is
then the same on 1 or N replicas and on several workers (docs/guide.md, "Collectives").

The views' noise is drawn per example from its index (stateless), in the input
pipeline, so every replica count sees the same views. No download: the digits ship in
scikit-learn.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import trainer
from models.digits import load_digits_split


class ContrastiveDigitsTrainer(trainer.Trainer):
    """An encoder trained with a global-batch contrastive loss (no labels used)."""

    def build_model(self) -> keras.Model:
        cfg = self.config.model
        return keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(cfg.hidden, activation="relu"),
            keras.layers.Dense(cfg.embedding),
            keras.layers.UnitNormalization(),
        ])

    def build_train_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        (x, _), _ = load_digits_split(self.config.data.split_seed)
        noise = self.config.model.noise

        def views(index, image):
            seeds = tf.stack([tf.cast(index, tf.int32), tf.constant(0)]), tf.stack(
                [tf.cast(index, tf.int32), tf.constant(1)])
            return tuple(image + noise * tf.random.stateless_normal([64], seed)
                         for seed in seeds)

        batch = ctx.get_per_replica_batch_size(self.config.train.global_batch_size)
        ds = tf.data.Dataset.from_tensor_slices((np.arange(len(x)), x)).map(views)
        return ds.repeat().batch(batch, drop_remainder=True)

    def compute_loss(self, batch, outputs) -> tf.Tensor:
        """Per example: the cross-entropy of picking its own other view among the other
        views of the whole global batch, both ways. ``outputs``: ``(z1, z2)``, the local
        embeddings ``[b, d]``."""
        z1, z2 = outputs
        first = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group,
                        tf.int32) * tf.shape(z1)[0]
        labels = first + tf.range(tf.shape(z1)[0])  # places in the global batch
        every_z1, every_z2 = self.all_gather((z1, z2))  # [global batch, d]
        temperature = self.config.model.temperature
        loss = keras.losses.sparse_categorical_crossentropy
        return 0.5 * (loss(labels, tf.matmul(z1, every_z2, transpose_b=True) / temperature,
                           from_logits=True)
                      + loss(labels, tf.matmul(z2, every_z1, transpose_b=True) / temperature,
                             from_logits=True))

    def train_step(self, batch) -> dict[str, tf.Tensor]:
        view1, view2 = batch
        with tf.GradientTape() as tape:
            outputs = (self.model(view1, training=True), self.model(view2, training=True))
            per_example_loss = self.compute_loss(batch, outputs)
        return {"loss": self.apply_gradients(tape, per_example_loss)}
