"""``perf.jit_compile=True`` on batches with dynamic shapes (padded sequences of varying
length) is dropped with one warning saying why, whether or not an execution plan
measures: XLA would compile the step again for every new batch shape."""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support import toy


class PaddedSequences(toy.ToyTrainer):
    """Token sequences of 3 to 12 tokens, padded per batch: the length varies by batch."""

    def build_model(self):
        return keras.Sequential([keras.Input((None,), dtype="int32"),
                                 keras.layers.Embedding(50, 8),
                                 keras.layers.GlobalAveragePooling1D(),
                                 keras.layers.Dense(3)])

    def build_train_dataset(self, ctx):
        rng = np.random.default_rng(0)
        lengths = rng.integers(3, 13, 256)
        tokens = [rng.integers(1, 50, n).astype("int32") for n in lengths]
        labels = rng.integers(0, 3, 256)
        ds = tf.data.Dataset.from_generator(
            lambda: zip(tokens, labels),
            output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int64)))
        batch = ctx.get_per_replica_batch_size(self.config.train.global_batch_size)
        return ds.repeat().padded_batch(batch, drop_remainder=True)


@pytest.mark.parametrize("plan", ["fixed", "auto"])
def test_jit_compile_on_dynamic_shapes_is_dropped_with_one_warning(plan, caplog):
    config = toy.toy_config(**{"perf.jit_compile": True, "perf.plan": plan,
                               "train.steps": 10, "train.steps_per_loop": 5})
    trainer = PaddedSequences(config)
    assert trainer.steps.xla  # configured, and nothing forbids it before the data is seen
    with caplog.at_level(logging.WARNING):
        trainer.fit()
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("perf.jit_compile=True is not applied")]
    assert len(lines) == 1, lines
    assert "the batches have dynamic shapes (" in lines[0]
    assert "training without XLA" in lines[0]
    assert not trainer.steps.xla
    assert trainer.step == 10


def test_fixed_shapes_keep_the_configured_xla():
    config = toy.toy_config(**{"perf.jit_compile": True, "perf.plan": "fixed"})
    trainer = toy.ToyTrainer(config)
    trainer.fit()
    assert trainer.steps.xla
