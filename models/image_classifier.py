"""Shared input pipeline, loss and metrics of the TFDS image classifiers (mnist, cifar10).

A subclass sets ``dataset`` (the TFDS name), ``mean``/``std`` (per-channel
normalisation of [0, 1] pixels) and implements ``build_model``. Training reads the real
``train`` split, evaluation the real ``test`` split, through
:func:`models.tfds_data.load_split` (offline unless ``config.data.download``).

``config.data`` keys used here: ``data_dir``, ``download`` (see :mod:`models.tfds_data`),
``shuffle_buffer`` (examples), ``cache`` (keep the decoded uint8 split in memory),
``augment`` (random flip and 4-pixel-padded crop; for natural images).
"""

from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf

import trainer
from models import tfds_data


class TFDSImageClassifier(trainer.Trainer):
    """Classifies ``(image uint8 [H, W, C], label int64)`` examples of a TFDS dataset."""

    dataset: str = ""
    mean: Sequence[float] = (0.0,)
    std: Sequence[float] = (1.0,)

    def _normalize(self, image: tf.Tensor) -> tf.Tensor:
        image = tf.cast(image, tf.float32) / 255.0
        return (image - tf.constant(self.mean)) / tf.constant(self.std)

    def _augment(self, image: tf.Tensor) -> tf.Tensor:
        shape = tf.shape(image)
        image = tf.image.random_flip_left_right(image, seed=self.config.seed)
        padded = tf.image.resize_with_crop_or_pad(image, shape[0] + 8, shape[1] + 8)
        return tf.image.random_crop(padded, shape, seed=self.config.seed)

    def _load(self, split: str) -> tf.data.Dataset:
        ds = tfds_data.load_split(self.dataset, split, self.config.data)
        return ds.cache() if self.config.data.cache else ds

    def build_train_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        """Shuffled, repeated per-replica batches of the ``train`` split."""
        batch = ctx.get_per_replica_batch_size(self.config.train.global_batch_size)
        augment = self.config.data.augment

        def preprocess(image, label):
            image = self._normalize(image)
            if augment:
                image = self._augment(image)
            return image, tf.cast(label, tf.int32)

        return (self._load("train")
                .shuffle(self.config.data.shuffle_buffer, seed=self.config.seed)
                .repeat()
                .map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
                .batch(batch, drop_remainder=True))

    def build_read_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        """The ``train`` split as read and decoded by TFDS (for the doctor)."""
        return tfds_data.load_split(self.dataset, "train", self.config.data)

    def build_eval_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        """One pass over the ``test`` split in per-replica batches (last one may be short)."""
        batch = ctx.get_per_replica_batch_size(self.eval_global_batch_size)
        return (self._load("test")
                .map(lambda image, label: (self._normalize(image), tf.cast(label, tf.int32)),
                     num_parallel_calls=tf.data.AUTOTUNE)
                .batch(batch))

    def compute_loss(self, batch, outputs) -> tf.Tensor:
        """Replica context: per-example softmax cross-entropy, shape ``[b]``."""
        _, labels = batch
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_metrics(self) -> dict[str, keras.metrics.Metric]:
        return {"accuracy": keras.metrics.SparseCategoricalAccuracy()}
