"""The embedded-default demo: an MLP on scikit-learn's 8x8 handwritten digits.

The 1,797 digits ship inside scikit-learn (``sklearn.datasets.load_digits``), so this
runs with no download. They are read as a real TFDS dataset,
:class:`models.digits_tfds.SklearnDigits`: the first run prepares it (TFRecord files,
4 per split) into the TFDS data directory, every later run reads those files. The
train/test split is fixed by ``config.data.split_seed``.

``config.data`` keys: ``data_dir`` (TFDS data directory, "" = TFDS's default),
``split_seed``, ``sharding`` ("auto" | "file" | "data": with several workers, each
reads only its own files when there are enough; see :func:`models.tfds_data.read_split`),
``cache`` (keep the decoded split in memory after the first epoch),
``service`` (tf.data service dispatcher, see :mod:`trainer.data`).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import trainer
from models import digits_tfds, tfds_data
from models.callbacks import StopAtMetric


def load_digits_split(split_seed: int = 0):
    """Returns ``(x_train, y_train), (x_test, y_test)``: float32 [n, 64] in [0, 1], int32.

    In memory, straight from scikit-learn; the same examples as the TFDS splits of
    :class:`models.digits_tfds.SklearnDigits` for this ``split_seed`` (in another order).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            "The digits demo needs scikit-learn: pip install 'tf-trainer[examples]'."
        ) from error
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    train, test = digits_tfds.split_indices(len(x), split_seed)
    return (x[train], y[train]), (x[test], y[test])


def preprocess(example: dict) -> tuple[tf.Tensor, tf.Tensor]:
    """``{"image": uint8 [64] in 0..16, "label": int64}`` -> ``(float32 [64] in [0, 1], int32)``."""
    return tf.cast(example["image"], tf.float32) / 16.0, tf.cast(example["label"], tf.int32)


class DigitsTrainer(trainer.Trainer):
    """A small MLP classifier; overrides only the required hooks plus data/metrics."""

    def __init__(self, config, workdir=None, strategy=None, callbacks=()):
        data = config.data
        self.builder = digits_tfds.prepare(data.get("data_dir", ""), data.split_seed)
        super().__init__(config, workdir, strategy, callbacks)

    def build_read_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        """The ``train`` split's examples (dicts) this input pipeline reads, in file order."""
        return tfds_data.read_split(self.builder, "train", ctx,
                                    sharding=self.config.data.get("sharding", "auto"))

    def build_model(self) -> keras.Model:
        cfg = self.config.model
        return keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(cfg.hidden, activation="relu"),
            keras.layers.Dense(10),
            keras.layers.Activation("linear", dtype="float32"),
        ])

    def build_train_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        """Per-replica batches: this pipeline's files, decoded, shuffled, repeated."""
        batch = ctx.get_per_replica_batch_size(self.config.train.global_batch_size)
        ds = self.build_read_dataset(ctx).map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
        if self.config.data.get("cache", True):
            ds = ds.cache()
        return (ds.shuffle(self.builder.info.splits["train"].num_examples, seed=self.config.seed)
                .repeat()
                .batch(batch, drop_remainder=True))

    def build_eval_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        batch = ctx.get_per_replica_batch_size(self.eval_global_batch_size)
        return (tfds_data.read_split(self.builder, "test")
                .map(preprocess, num_parallel_calls=tf.data.AUTOTUNE).batch(batch))

    def compute_loss(self, batch, outputs) -> tf.Tensor:
        _, labels = batch
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_metrics(self) -> dict[str, keras.metrics.Metric]:
        return {"accuracy": keras.metrics.SparseCategoricalAccuracy()}


class DigitsToTargetTrainer(DigitsTrainer):
    """The digits MLP that stops once eval accuracy reaches ``config.model.target_accuracy``
    (the Callback example of docs/guide.md: :class:`models.callbacks.StopAtMetric`)."""

    def build_callbacks(self) -> list[trainer.Callback]:
        return [StopAtMetric("eval/accuracy", self.config.model.target_accuracy)]
