"""A small CIFAR-style ResNet (He et al. 2016, section 4.2) built from Keras layers.

``resnet(...)`` with ``blocks_per_stage=3`` and ``widths=(16, 32, 64)`` is ResNet-20
(0.27 M parameters). Batch normalisation under distribution: with ``sync_bn=True``
every ``BatchNormalization`` is ``synchronized=True``, so the batch mean and variance
are all-reduced over the replicas of the step (the statistics of the GLOBAL batch, as on
one device); with False each replica normalises with its own per-replica batch.
"""

from __future__ import annotations

from typing import Sequence

import keras


def _bn(sync_bn: bool) -> keras.layers.Layer:
    return keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, synchronized=sync_bn)


def _conv(filters: int, kernel: int, stride: int, l2: float) -> keras.layers.Layer:
    return keras.layers.Conv2D(
        filters, kernel, strides=stride, padding="same", use_bias=False,
        kernel_initializer="he_normal",
        kernel_regularizer=keras.regularizers.L2(l2) if l2 else None)


def _basic_block(x, filters: int, stride: int, sync_bn: bool, l2: float):
    shortcut = x
    y = _conv(filters, 3, stride, l2)(x)
    y = keras.layers.ReLU()(_bn(sync_bn)(y))
    y = _bn(sync_bn)(_conv(filters, 3, 1, l2)(y))
    if stride != 1 or x.shape[-1] != filters:
        shortcut = _bn(sync_bn)(_conv(filters, 1, stride, l2)(x))
    return keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))


def resnet(input_shape: Sequence[int], num_classes: int, widths: Sequence[int] = (16, 32, 64),
           blocks_per_stage: int = 3, sync_bn: bool = False, l2: float = 0.0) -> keras.Model:
    """A ResNet: float images ``[b, *input_shape]`` -> float32 logits ``[b, num_classes]``.

    One stage per entry of ``widths`` (the first at stride 1, the others halve the
    resolution), ``blocks_per_stage`` basic blocks each; ``l2`` > 0 adds L2 weight
    regularisation to the convolutions (counted once per step by
    ``Trainer.apply_gradients``).
    """
    inputs = keras.Input(tuple(input_shape))
    x = keras.layers.ReLU()(_bn(sync_bn)(_conv(widths[0], 3, 1, l2)(inputs)))
    for stage, filters in enumerate(widths):
        for block in range(blocks_per_stage):
            stride = 2 if stage > 0 and block == 0 else 1
            x = _basic_block(x, filters, stride, sync_bn, l2)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(
        num_classes, kernel_regularizer=keras.regularizers.L2(l2) if l2 else None)(x)
    outputs = keras.layers.Activation("linear", dtype="float32")(x)
    depth = 2 + 2 * blocks_per_stage * len(widths)
    return keras.Model(inputs, outputs, name=f"resnet{depth}")
