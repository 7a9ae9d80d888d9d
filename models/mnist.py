"""MNIST digits (TFDS ``mnist``, 28x28x1): a small CNN classifier.

    python -m trainer.main --config=models/configs/mnist.py --workdir=/tmp/mnist

Data: the real ``train`` (60k) and ``test`` (10k) splits from ``config.data.data_dir``;
nothing is downloaded unless ``--config.data.download=True`` (see
:mod:`models.tfds_data`). The input pipeline, loss and accuracy metric are shared with
CIFAR-10 in :mod:`models.image_classifier`; this file is only the model.
"""

from __future__ import annotations

import keras

from models.image_classifier import TFDSImageClassifier


class MnistTrainer(TFDSImageClassifier):
    """Conv(f)-pool-Conv(2f)-pool-Dense(hidden)-Dense(10).

    ``config.model``: ``filters`` (f), ``hidden``, ``dropout``.
    """

    dataset = "mnist"
    mean = (0.1307,)
    std = (0.3081,)

    def build_model(self) -> keras.Model:
        cfg = self.config.model
        return keras.Sequential([
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(cfg.filters, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(2 * cfg.filters, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dropout(cfg.dropout),
            keras.layers.Dense(cfg.hidden, activation="relu"),
            keras.layers.Dense(10),
            keras.layers.Activation("linear", dtype="float32"),  # float32 logits (mixed precision)
        ], name="mnist_cnn")
