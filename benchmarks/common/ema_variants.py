"""EMA update variants measured by ``benchmarks.overhead.controls`` next to the framework's own
(:class:`trainer.step.ema.ExponentialMovingAverage`, fused or not). Benchmark-only: each is a
subclass whose :meth:`update` replaces the framework's, on the same variables.

* :class:`ApplyGradientDescentEMA`: ``average - weight``, then one
  ``ResourceApplyGradientDescent`` (``average -= (1-d) * delta``): two ops per variable.
* :class:`EveryNEMA`: the fused update every ``n`` applied updates (when the optimizer's
  ``iterations`` is a multiple of ``n``) with decay ``d**n``, behind a ``tf.cond``.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from trainer.step.ema import ExponentialMovingAverage


def _pairs(ema: ExponentialMovingAverage, weights: list) -> list:
    ids = {id(w) for w in weights}
    return [(w, a) for w, a in ema.pairs if id(w) in ids]


class ApplyGradientDescentEMA(ExponentialMovingAverage):
    def update(self, weights: list) -> None:
        for weight, average in _pairs(self, weights):
            tf.raw_ops.ResourceApplyGradientDescent(
                var=average.handle, alpha=tf.constant(1.0 - self.decay, average.dtype),
                delta=average - tf.convert_to_tensor(weight))


class EveryNEMA(ExponentialMovingAverage):
    def __init__(self, decay: float, n: int, iterations: Callable[[], tf.Variable]):
        super().__init__(decay ** n)
        self.n = n
        self.iterations = iterations

    def update(self, weights: list) -> None:
        def move():
            super(EveryNEMA, self).update(weights)
            return tf.constant(True)

        tf.cond(tf.equal(self.iterations() % self.n, 0), move, lambda: tf.constant(False))
