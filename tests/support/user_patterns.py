"""Trainers written as a new user writes them from TensorFlow's and Keras' guides, for
the tests that each stays right on N replicas (or is refused with one line).

``config.trainer`` names them (``tests.support.user_patterns:RawGatherContrastiveTrainer``)
so that ``trainer.main`` subprocesses run them unchanged.
"""

from __future__ import annotations

import tensorflow as tf

from models.contrastive import ContrastiveDigitsTrainer


class RawGatherContrastiveTrainer(ContrastiveDigitsTrainer):
    """models/contrastive.py gathering through TensorFlow's replica context, as its
    distribution guide writes it, instead of ``self.all_gather``: exact on Mirrored
    replicas, refused under ``distribute.strategy='manual'`` over several devices."""

    def all_gather(self, value, axis: int = 0):
        return tf.distribute.get_replica_context().all_gather(value, axis=axis)


class LearnedTemperatureContrastiveTrainer(ContrastiveDigitsTrainer):
    """models/contrastive.py with a learnable log-scale of its logits held by the Trainer
    (CLIP's learned temperature), made in ``build_model`` as a plain ``tf.Variable``:
    trained with the model (it was never trained), the same on every replica count."""

    def build_model(self):
        self.log_scale = tf.Variable(0.0, trainable=True)
        return super().build_model()

    def compute_loss(self, batch, outputs):
        z1, z2 = outputs
        return super().compute_loss(batch, (z1 * tf.exp(self.log_scale), z2))
