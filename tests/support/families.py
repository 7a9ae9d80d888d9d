"""The model families a user brings, as tiny Trainers: each must train to the same weights
on 1, 2 and 4 replicas (tests/distribution/test_model_families.py; docs/guide.md lists the families).

Every family is a :class:`trainer.Trainer` subclass over deterministic in-memory data
(``family_config(name)`` is its config). Families:

* ``text``: Embedding(mask_zero) over variable-length ``padded_batch`` batches, a custom
  metric and a custom ``train_step`` (:mod:`models.text_classifier`): sparse gradients.
* ``text_gather``, ``tied_gather``: with ``perf.sparse_reduce="gather"`` (their small
  tables go dense under ``"auto"``).
* ``text_controls``: gathered, one step per call, clipping by global norm (binding),
  the EMA and the non-finite guard; ``text_accum``: gathered, 2 accumulation steps.
* ``text_bucketed``: the same over ``bucket_by_sequence_length`` batches.
* ``dict_io``: dict features, two outputs (a dict), dict labels.
* ``string_lookup``: string features looked up inside the model (``StringLookup``).
* ``frozen_backbone``: a backbone with ``trainable=False`` under a trained head.
* ``regularized``: kernel regularizers and an ``add_loss`` activity penalty.
* ``tied``: an embedding whose table is also the output projection (sparse + dense
  gradients of one variable).
* ``running_state``: a non-trainable running mean updated in the step
  (``aggregation="mean"``).
* ``unfreeze_by_callback``: the frozen backbone unfrozen by a callback at step 4;
  ``unfreeze_between_fits``: unfrozen between a fit() of 4 steps and one to step 8.
* ``sync_bn``: ``BatchNormalization(synchronized=True)`` (``plain_bn`` is the documented
  per-replica-statistics counterpart: it must differ).
* ``*_mixed``: the family under ``precision.policy="mixed_float16"``.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import trainer
from models.text_classifier import TextClassifierTrainer
from trainer import config as config_lib

FAMILIES = ("text", "text_gather", "text_controls", "text_accum", "text_bucketed", "dict_io", "string_lookup", "frozen_backbone",
            "unfreeze_by_callback", "unfreeze_between_fits", "regularized", "tied", "running_state", "sync_bn", "plain_bn", "text_mixed",
            "dict_io_mixed")
EXAMPLES = 256
#: How far (relative, ``tests.support.helpers.relative_diff``) a model's final weights on 2
#: or 4 replicas may be from one replica's in float32: test_model_families.py and the
#: property tests (tests/properties/test_model_properties.py, test_found_by_properties.py).
TOL = 1e-5


def _features(seed: int, width: int = 6) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(EXAMPLES, width)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int32)
    return x, y


def _batched(dataset: tf.data.Dataset, ctx, config) -> tf.data.Dataset:
    batch = ctx.get_per_replica_batch_size(config.train.global_batch_size)
    return dataset.repeat().batch(batch, drop_remainder=True)


def _sparse_loss(labels, outputs):
    return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)


class _DenseData(trainer.Trainer):
    """``(x [b, 6] float32, y [b] int32)`` batches; the per-example cross-entropy."""

    def build_train_dataset(self, ctx):
        return _batched(tf.data.Dataset.from_tensor_slices(_features(0)), ctx, self.config)

    def compute_loss(self, batch, outputs):
        return _sparse_loss(batch[1], outputs)


class DictIOTrainer(trainer.Trainer):
    """Dict features ``{"a", "b"}``, outputs ``{"label", "score"}``, dict labels."""

    def build_model(self):
        a = keras.Input((6,), name="a")
        b = keras.Input((3,), name="b")
        h = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([a, b]))
        return keras.Model({"a": a, "b": b},
                           {"label": keras.layers.Dense(2, name="label")(h),
                            "score": keras.layers.Dense(1, name="score")(h)})

    def build_train_dataset(self, ctx):
        x, y = _features(1)
        rng = np.random.default_rng(2)
        b = rng.normal(size=(EXAMPLES, 3)).astype(np.float32)
        features = {"a": x, "b": b}
        labels = {"label": y, "score": (x[:, 2] - b[:, 0]).astype(np.float32)}
        return _batched(tf.data.Dataset.from_tensor_slices((features, labels)), ctx,
                        self.config)

    def compute_loss(self, batch, outputs):
        labels = batch[1]
        score = tf.squeeze(outputs["score"], -1)
        return (_sparse_loss(labels["label"], outputs["label"])
                + 0.5 * tf.square(score - labels["score"]))


class StringLookupTrainer(trainer.Trainer):
    """String tokens looked up inside the model, then embedded."""

    WORDS = tuple(f"w{i}" for i in range(20))

    def build_model(self):
        words = keras.Input((4,), dtype="string")
        ids = keras.layers.StringLookup(vocabulary=list(self.WORDS))(words)
        x = keras.layers.Embedding(len(self.WORDS) + 1, 4)(ids)
        x = keras.layers.GlobalAveragePooling1D()(x)
        return keras.Model(words, keras.layers.Dense(2)(x))

    def build_train_dataset(self, ctx):
        rng = np.random.default_rng(3)
        picks = rng.integers(0, len(self.WORDS) + 3, (EXAMPLES, 4))  # some out of vocabulary
        words = np.array([[f"w{i}" for i in row] for row in picks])
        labels = (picks[:, 0] < 10).astype(np.int32)
        return _batched(tf.data.Dataset.from_tensor_slices((words, labels)), ctx, self.config)

    def compute_loss(self, batch, outputs):
        return _sparse_loss(batch[1], outputs)


class FrozenBackboneTrainer(_DenseData):
    """A backbone layer with ``trainable=False`` under a trained head."""

    def build_model(self):
        backbone = keras.layers.Dense(8, activation="tanh", name="backbone")
        backbone.trainable = False
        return keras.Sequential([keras.Input((6,)), backbone, keras.layers.Dense(2)])


class Unfreeze(trainer.Callback):
    """Makes the layer ``name`` trainable at the first loop end at or after ``step``."""

    def __init__(self, name: str, step: int):
        self.name, self.step = name, step

    def on_loop_end(self, t):
        if t.step >= self.step:
            t.model.get_layer(self.name).trainable = True


class UnfreezingTrainer(FrozenBackboneTrainer):
    """The frozen backbone, unfrozen by a callback at ``config.model.unfreeze_at``."""

    def build_callbacks(self):
        return [Unfreeze("backbone", self.config.model.unfreeze_at)]


class RegularizedTrainer(_DenseData):
    """Kernel regularizers and an activity penalty added with ``add_loss``."""

    def build_model(self):
        return keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh",
                               kernel_regularizer=keras.regularizers.L2(1e-2),
                               activity_regularizer=keras.regularizers.L1(1e-3)),
            keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L1L2(1e-3, 1e-3)),
        ])


class TiedProjection(keras.layers.Layer):
    """Logits = hidden @ embedding table^T: the table is used twice (tied weights)."""

    def __init__(self, embedding: keras.layers.Embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, hidden):
        return tf.matmul(hidden, self.embedding.embeddings, transpose_b=True)


class TiedTrainer(trainer.Trainer):
    """Predicts the first token from the mean embedding, through the same table."""

    VOCAB = 30

    def build_model(self):
        ids = keras.Input((5,), dtype="int32")
        embedding = keras.layers.Embedding(self.VOCAB, 8)
        hidden = keras.layers.GlobalAveragePooling1D()(embedding(ids))
        return keras.Model(ids, TiedProjection(embedding)(hidden))

    def build_train_dataset(self, ctx):
        rng = np.random.default_rng(4)
        ids = rng.integers(0, self.VOCAB, (EXAMPLES, 5)).astype(np.int32)
        return _batched(tf.data.Dataset.from_tensor_slices((ids, ids[:, 0])), ctx,
                        self.config)

    def compute_loss(self, batch, outputs):
        return _sparse_loss(batch[1], outputs)


class RunningMean(keras.layers.Layer):
    """Keeps a running mean of its inputs in a non-trainable variable (updated in the
    step, ``aggregation="mean"``: the replicas' updates are averaged) and centres by it."""

    def build(self, input_shape):
        self.mean = self.add_weight(shape=(input_shape[-1],), initializer="zeros",
                                    trainable=False, aggregation="mean", name="mean")

    def call(self, x, training=False):
        if training:
            self.mean.assign(0.9 * self.mean + 0.1 * tf.reduce_mean(x, axis=0))
        return x - self.mean


class RunningStateTrainer(_DenseData):
    def build_model(self):
        return keras.Sequential([keras.Input((6,)), RunningMean(),
                                 keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(2)])


class BatchNormTrainer(_DenseData):
    """Dense + BatchNormalization; ``config.model.sync_bn`` synchronizes its statistics."""

    def build_model(self):
        return keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(8, use_bias=False),  # BN has the bias
            keras.layers.BatchNormalization(synchronized=bool(self.config.model.sync_bn)),
            keras.layers.Activation("tanh"), keras.layers.Dense(2)])


_CLASSES = {
    "text": TextClassifierTrainer, "text_gather": TextClassifierTrainer,
    "text_controls": TextClassifierTrainer, "text_accum": TextClassifierTrainer,
    "text_bucketed": TextClassifierTrainer, "tied_gather": TiedTrainer,
    "text_mixed": TextClassifierTrainer, "dict_io": DictIOTrainer,
    "dict_io_mixed": DictIOTrainer, "string_lookup": StringLookupTrainer,
    "frozen_backbone": FrozenBackboneTrainer, "unfreeze_by_callback": UnfreezingTrainer,
    "unfreeze_between_fits": FrozenBackboneTrainer, "regularized": RegularizedTrainer,
    "tied": TiedTrainer, "running_state": RunningStateTrainer,
    "sync_bn": BatchNormTrainer, "plain_bn": BatchNormTrainer,
}


def family_config(name: str, replicas: int = 1, **overrides):
    """The config of family ``name`` on ``replicas`` Mirrored replicas (virtual CPUs)."""
    config = config_lib.get_config()
    cls = _CLASSES[name]
    config.trainer = f"{cls.__module__}:{cls.__name__}"
    config.train.global_batch_size = 16
    config.train.steps = 8
    config.train.steps_per_loop = 4
    config.train.log_every_steps = 4
    config.eval.every_steps = 0
    config.optimizer.name = "adam"
    config.optimizer.learning_rate = 0.01
    config.perf.plan = "fixed"
    config.distribute.strategy = "one_device"
    if name.startswith("text"):
        config.model.vocab = 64
        config.model.dim = 8
        config.model.hidden = 8
        config.data.examples = EXAMPLES
        config.data.min_len = 2
        config.data.max_len = 20
        config.data.buckets = 3 if name == "text_bucketed" else 0
    if name == "unfreeze_by_callback":
        config.model.unfreeze_at = 4
    if name.endswith("_bn"):
        config.model.sync_bn = name == "sync_bn"
    if name.endswith("_mixed"):
        config.precision.policy = "mixed_float16"
    if name.endswith("_gather") or name in ("text_mixed", "text_controls", "text_accum"):
        config.perf.sparse_reduce = "gather"  # small tables: "auto" would densify
    if name == "text_controls":  # one step per call, clipping, EMA, the finiteness guard
        config.update_from_flattened_dict({
            "train.steps_per_loop": 1, "optimizer.clipnorm": 0.05,
            "optimizer.ema_decay": 0.9, "train.on_nonfinite": "skip"})
    if name == "text_accum":
        config.perf.grad_accum_steps = 2
    if replicas > 1:
        config.distribute.strategy = "mirrored"
        config.distribute.virtual_devices = replicas
    config.update_from_flattened_dict(overrides)
    return config


def train_family(name: str, replicas: int = 1,
                 **overrides) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Trains family ``name`` on ``replicas`` replicas: ``(initial, final weights)``."""
    config = family_config(name, replicas, **overrides)
    t = _CLASSES[name](config)
    assert t.strategy.num_replicas_in_sync == replicas, t.strategy
    initial = [np.asarray(w) for w in t.model.get_weights()]
    if name == "unfreeze_between_fits":
        t.config.train.steps = 4
        t.fit()
        t.model.get_layer("backbone").trainable = True
        t.config.train.steps = 8
    t.fit()
    return initial, [np.asarray(w) for w in t.model.get_weights()]
