"""A sequence classifier over variable-length token ids: the sequence-model recipe.

What a user writes for text: an ``Embedding(vocab, dim, mask_zero=True)`` over padded
batches of token ids (0 = padding), averaged over the real tokens, a custom metric and
a custom ``train_step``. The embedding's gradient is sparse (``tf.IndexedSlices``: only
the rows of the tokens in the batch); the framework reduces it across replicas and
workers by ``perf.sparse_reduce`` (:mod:`trainer.step.sparse_gradients`).

Data (no download): ``config.data.examples`` sequences of ``config.data.min_len`` to
``config.data.max_len`` token ids drawn with a fixed seed; the label says whether most
tokens lie in the lower half of the vocabulary. Batching is
``padded_batch(per_replica, padded_shapes=([None], []))`` (each batch padded to its own
longest sequence), or with ``config.data.buckets`` > 0 TensorFlow's
``bucket_by_sequence_length`` (fewer padding tokens, a few shapes).

    python -m trainer.main --config=models/configs/text_classifier.py --workdir=/tmp/text
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import trainer


def make_sequences(examples: int, vocab: int, min_len: int, max_len: int,
                   seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """``(token id sequences: int32 arrays of min_len..max_len ids in [1, vocab),
    labels [examples] int32)``."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, examples)
    low = rng.random(examples) < 0.5
    rows, labels = [], np.zeros(examples, np.int32)
    for i, length in enumerate(lengths):
        lower_share = 0.75 if low[i] else 0.25
        lower = rng.random(length) < lower_share
        ids = np.where(lower, rng.integers(1, vocab // 2, length),
                       rng.integers(vocab // 2, vocab, length)).astype(np.int32)
        rows.append(ids)
        labels[i] = int(lower.mean() > 0.5)
    return rows, labels


def sequence_dataset(rows: list[np.ndarray], labels: np.ndarray) -> tf.data.Dataset:
    """Elements ``(ids [length] int32, label [] int32)``, one per sequence."""
    flat = tf.constant(np.concatenate(rows))
    lengths = np.array([len(r) for r in rows], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return tf.data.Dataset.from_tensor_slices((starts, lengths, labels)).map(
        lambda start, length, label: (flat[start:start + length], label))


class PositiveRate(keras.metrics.Metric):
    """A custom metric: the share of examples predicted positive (class 1)."""

    def __init__(self, name: str = "positive_rate", **kwargs):
        super().__init__(name=name, **kwargs)
        self.positive = self.add_variable(shape=(), initializer="zeros", name="positive")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, labels, logits, sample_weight=None):
        predicted = tf.cast(tf.argmax(logits, axis=-1) == 1, tf.float32)
        self.positive.assign_add(tf.reduce_sum(predicted))
        self.count.assign_add(tf.cast(tf.size(predicted), tf.float32))

    def result(self):
        return tf.math.divide_no_nan(self.positive, self.count)


class TextClassifierTrainer(trainer.Trainer):
    """Embedding + masked average + dense head, over padded variable-length batches."""

    def build_model(self) -> keras.Model:
        model = self.config.model
        ids = keras.Input((None,), dtype="int32", name="ids")
        x = keras.layers.Embedding(model.vocab, model.dim, mask_zero=True)(ids)
        x = keras.layers.GlobalAveragePooling1D()(x)
        x = keras.layers.Dense(model.hidden, activation="relu")(x)
        return keras.Model(ids, keras.layers.Dense(2)(x))

    def _dataset(self, ctx: tf.distribute.InputContext, global_batch: int, split: str,
                 repeat: bool) -> tf.data.Dataset:
        data = self.config.data
        seed = 0 if split == "train" else 1
        dataset = sequence_dataset(*make_sequences(
            data.examples, self.config.model.vocab, data.min_len, data.max_len, seed))
        dataset = dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        if repeat:
            dataset = dataset.repeat()
        batch = ctx.get_per_replica_batch_size(global_batch)
        if data.buckets > 0:
            step = max(1, (data.max_len - data.min_len) // data.buckets)
            boundaries = list(range(data.min_len + step, data.max_len + 1, step))
            return dataset.bucket_by_sequence_length(
                lambda ids_, _: tf.shape(ids_)[0], boundaries,
                [batch] * (len(boundaries) + 1), padded_shapes=([None], []),
                drop_remainder=repeat)
        return dataset.padded_batch(batch, padded_shapes=([None], []), drop_remainder=repeat)

    def build_train_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        return self._dataset(ctx, self.config.train.global_batch_size, "train", repeat=True)

    def build_eval_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        return self._dataset(ctx, self.eval_global_batch_size, "eval", repeat=False)

    def compute_loss(self, batch, outputs) -> tf.Tensor:
        return keras.losses.sparse_categorical_crossentropy(batch[1], outputs,
                                                            from_logits=True)

    def build_metrics(self) -> dict:
        return {"accuracy": keras.metrics.SparseCategoricalAccuracy(),
                "positive_rate": PositiveRate()}

    def train_step(self, batch) -> dict:
        """A custom step, as a user writes one: forward, per-example loss, then
        ``apply_gradients`` (global-batch averaging, loss scale, the reduction)."""
        ids, labels = batch
        with tf.GradientTape() as tape:
            logits = tf.cast(self.model(ids, training=True), tf.float32)
            per_example_loss = self.compute_loss(batch, logits)
        loss = self.apply_gradients(tape, per_example_loss)
        self.update_metrics(self.train_metrics, batch, logits)
        return {"loss": loss}
