"""CIFAR-10 (TFDS ``cifar10``, 32x32x3): a small ResNet (:mod:`models.resnet`).

    python -m trainer.main --config=models/configs/cifar10.py --workdir=/tmp/cifar10

Data: the real ``train`` (50k) and ``test`` (10k) splits from ``config.data.data_dir``;
nothing is downloaded unless ``--config.data.download=True``. Training augments with
random flips and 4-pixel-padded crops (``config.data.augment``). Under Mirrored or TPU,
``--config.model.sync_bn=True`` normalises with the global batch's statistics.
"""

from __future__ import annotations

import keras

from models import resnet
from models.image_classifier import TFDSImageClassifier


class Cifar10Trainer(TFDSImageClassifier):
    """ResNet classifier; ``config.model``: widths, blocks_per_stage, sync_bn, l2."""

    dataset = "cifar10"
    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2470, 0.2435, 0.2616)

    def build_model(self) -> keras.Model:
        cfg = self.config.model
        return resnet.resnet((32, 32, 3), 10, widths=tuple(cfg.widths),
                             blocks_per_stage=cfg.blocks_per_stage, sync_bn=cfg.sync_bn,
                             l2=cfg.l2)
