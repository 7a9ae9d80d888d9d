"""The Trainer the benchmarks share: in-memory arrays in, class logits out.

:class:`ArraysTrainer` yields :meth:`~ArraysTrainer.arrays` repeated and batched per
replica, and its loss is the per-example sparse cross-entropy of logits; a subclass
gives ``build_model`` and ``arrays``. (A part of :mod:`benchmarks`, not a benchmark.)
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import trainer


class ArraysTrainer(trainer.Trainer):
    """``arrays()`` -> ``(x, y)`` (NumPy, labels int), repeated; sparse CE of logits."""

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def build_train_dataset(self, ctx):
        x, y = self.arrays()
        batch = ctx.get_per_replica_batch_size(self.config.train.global_batch_size)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
            batch, drop_remainder=True)

    def compute_loss(self, batch, outputs):
        return keras.losses.sparse_categorical_crossentropy(batch[1], outputs,
                                                            from_logits=True)
