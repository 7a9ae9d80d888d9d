"""A small decoder-only Transformer language model on a text file, byte-level.

    python -m trainer.main --config=models/configs/lm.py --workdir=/tmp/lm \
        [--config.data.text_file=my_corpus.txt]

Text: ``config.data.text_file``, or (``""``, the default) the Python documentation
topics that ship with CPython in ``pydoc_data.topics`` (~0.45 MB of English prose and
code), so nothing is downloaded. The text is held in memory as one token array; the
last ``config.data.eval_fraction`` of it is the held-out evaluation text.

Tokenizer: :class:`ByteTokenizer`, the UTF-8 bytes of the text (vocabulary 256), which
needs no vocabulary file. Training batches are windows of ``config.data.seq_len + 1``
tokens at random offsets; evaluation covers the held-out text in non-overlapping
windows. The loss is the per-token cross-entropy (nats) averaged over each window; the
``perplexity`` metric is ``exp`` of the mean per-token cross-entropy over all tokens
seen (so ``eval/perplexity == exp(eval/loss)``: every window has the same length).

Model (``config.model``): token + learned position embeddings, ``layers`` pre-norm
blocks of causal multi-head self-attention (``heads``) and a GELU MLP (``mlp_dim``),
final layer norm, and a dense projection to 256 float32 logits.
"""

from __future__ import annotations

from typing import Sequence

import keras
import ml_collections
import numpy as np
import tensorflow as tf

import trainer


class ByteTokenizer:
    """UTF-8 bytes as tokens: ``encode(str) -> int32 [n]`` in [0, 256), ``decode`` back."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def default_text() -> str:
    """The Python documentation topics shipped with CPython (``pydoc_data.topics``)."""
    try:
        from pydoc_data.topics import topics  # pylint: disable=import-outside-toplevel
    except ImportError as error:
        raise FileNotFoundError(
            "This Python has no pydoc_data module (the default text of the LM demo); "
            "point the model at a UTF-8 text file: --config.data.text_file=PATH.") from error
    return "\n\n".join(topics[key] for key in sorted(topics))


def load_text(path: str) -> str:
    """The training text: the file at ``path`` (UTF-8), or :func:`default_text` for ``""``."""
    if not path:
        return default_text()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"config.data.text_file={path!r} does not exist; pass a UTF-8 text file, or "
            f"leave it empty for the built-in text (Python's documentation topics).") from error


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to ``x`` ``[b, t, d]`` (``t <= max_len``)."""

    def __init__(self, max_len: int, **kwargs):
        super().__init__(**kwargs)
        self.max_len = max_len

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            shape=(self.max_len, input_shape[-1]), name="embeddings",
            initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, x):
        length = keras.ops.shape(x)[1]
        return x + keras.ops.cast(self.embeddings[:length], x.dtype)

    def get_config(self):
        return {**super().get_config(), "max_len": self.max_len}


def transformer_lm(seq_len: int, vocab_size: int, d_model: int, heads: int, layers: int,
                   mlp_dim: int, dropout: float = 0.0) -> keras.Model:
    """A causal Transformer: int tokens ``[b, seq_len]`` -> float32 logits ``[b, seq_len, V]``."""
    if d_model % heads:
        raise ValueError(f"config.model.d_model={d_model} must be divisible by "
                         f"config.model.heads={heads}.")
    tokens = keras.Input((seq_len,), dtype="int32")
    x = keras.layers.Embedding(vocab_size, d_model)(tokens)
    x = PositionEmbedding(seq_len)(x)
    for _ in range(layers):
        h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        h = keras.layers.MultiHeadAttention(heads, d_model // heads, dropout=dropout)(
            h, h, use_causal_mask=True)
        x = keras.layers.Add()([x, keras.layers.Dropout(dropout)(h)])
        h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        h = keras.layers.Dense(mlp_dim, activation="gelu")(h)
        h = keras.layers.Dense(d_model)(h)
        x = keras.layers.Add()([x, keras.layers.Dropout(dropout)(h)])
    x = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    logits = keras.layers.Dense(vocab_size)(x)
    logits = keras.layers.Activation("linear", dtype="float32")(logits)
    return keras.Model(tokens, logits, name="transformer_lm")


class Perplexity(keras.metrics.Metric):
    """``exp(mean per-token cross-entropy)`` over every token seen since the last reset.

    ``update_state(labels int [b, t], logits float [b, t, vocab])`` (replica context
    under a strategy: the sums are aggregated over replicas).
    """

    def __init__(self, name: str = "perplexity", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        del sample_weight
        nll = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
        self.total.assign_add(keras.ops.sum(keras.ops.cast(nll, "float32")))
        self.count.assign_add(keras.ops.cast(keras.ops.size(nll), "float32"))

    def result(self):
        return keras.ops.exp(self.total / keras.ops.maximum(self.count, 1.0))


class TransformerLMTrainer(trainer.Trainer):
    """Next-byte prediction; batches are ``(tokens [b, t], next_tokens [b, t])``."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | None = None,
                 strategy: tf.distribute.Strategy | None = None,
                 callbacks: Sequence[trainer.Callback] = ()):
        self.tokenizer = ByteTokenizer()
        tokens = self.tokenizer.encode(load_text(config.data.text_file))
        seq_len = config.data.seq_len
        n_eval = int(len(tokens) * config.data.eval_fraction)
        split = len(tokens) - n_eval
        self.train_tokens, self.eval_tokens = tokens[:split], tokens[split:]
        if len(self.train_tokens) <= seq_len or len(self.eval_tokens) <= seq_len:
            raise ValueError(
                f"The text has {len(tokens)} bytes: too short for config.data.seq_len="
                f"{seq_len} with eval_fraction={config.data.eval_fraction} (each part needs "
                f"more than seq_len bytes). Use a longer text or a shorter seq_len.")
        super().__init__(config, workdir, strategy, callbacks)

    def build_model(self) -> keras.Model:
        cfg = self.config.model
        return transformer_lm(self.config.data.seq_len, self.tokenizer.vocab_size,
                              cfg.d_model, cfg.heads, cfg.layers, cfg.mlp_dim, cfg.dropout)

    def build_train_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        """Per-replica batches of windows at random offsets (seeded by ``config.seed``)."""
        batch = ctx.get_per_replica_batch_size(self.config.train.global_batch_size)
        seq_len = self.config.data.seq_len
        tokens = tf.constant(self.train_tokens)
        offsets = tf.range(seq_len + 1, dtype=tf.int64)
        num_starts = len(self.train_tokens) - seq_len

        def windows(randoms):
            starts = tf.math.floormod(randoms, num_starts)
            window = tf.gather(tokens, starts[:, None] + offsets[None, :])
            return window[:, :-1], window[:, 1:]

        return (tf.data.Dataset.random(seed=self.config.seed)
                .batch(batch, drop_remainder=True)
                .map(windows, num_parallel_calls=tf.data.AUTOTUNE))

    def build_eval_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        """The held-out text in non-overlapping windows (every eval token predicted once)."""
        batch = ctx.get_per_replica_batch_size(self.eval_global_batch_size)
        seq_len = self.config.data.seq_len
        n = (len(self.eval_tokens) - 1) // seq_len
        inputs = self.eval_tokens[:n * seq_len].reshape(n, seq_len)
        targets = self.eval_tokens[1:n * seq_len + 1].reshape(n, seq_len)
        return tf.data.Dataset.from_tensor_slices((inputs, targets)).batch(batch)

    def compute_loss(self, batch, outputs) -> tf.Tensor:
        """Replica context: mean next-token cross-entropy of each window, shape ``[b]``."""
        _, targets = batch
        nll = keras.losses.sparse_categorical_crossentropy(targets, outputs, from_logits=True)
        return tf.reduce_mean(nll, axis=-1)

    def build_metrics(self) -> dict[str, keras.metrics.Metric]:
        return {"perplexity": Perplexity()}
