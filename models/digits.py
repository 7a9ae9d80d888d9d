"""The embedded-default demo: an MLP on scikit-learn's 8x8 handwritten digits.

The 1,797 digits ship inside scikit-learn (``sklearn.datasets.load_digits``), so this
runs with no download. The train/test split is fixed by ``config.data.split_seed``.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import trainer
from models.callbacks import StopAtMetric


def load_digits_split(split_seed: int = 0, test_fraction: float = 0.2):
    """Returns ``(x_train, y_train), (x_test, y_test)``: float32 [n, 64] in [0, 1], int32."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            "The digits demo needs scikit-learn: pip install 'tf-trainer[examples]'."
        ) from error
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(split_seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


class DigitsTrainer(trainer.Trainer):
    """A small MLP classifier; overrides only the required hooks plus data/metrics."""

    def __init__(self, config, workdir=None, strategy=None, callbacks=()):
        self._train, self._test = load_digits_split(config.data.split_seed)
        super().__init__(config, workdir, strategy, callbacks)

    def build_model(self) -> keras.Model:
        cfg = self.config.model
        return keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(cfg.hidden, activation="relu"),
            keras.layers.Dense(10),
            keras.layers.Activation("linear", dtype="float32"),
        ])

    def build_train_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        batch = ctx.get_per_replica_batch_size(self.config.train.global_batch_size)
        x, y = self._train
        return (tf.data.Dataset.from_tensor_slices((x, y))
                .shuffle(len(x), seed=self.config.seed)
                .repeat()
                .batch(batch, drop_remainder=True))

    def build_eval_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        batch = ctx.get_per_replica_batch_size(self.eval_global_batch_size)
        return tf.data.Dataset.from_tensor_slices(self._test).batch(batch)

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
