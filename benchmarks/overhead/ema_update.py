"""The EMA update alone, per implementation, next to Adam's update of the same
variables (the MLP workload's weights: 784x256, 256, 256x10, 10), in one process.

    python -m benchmarks.overhead.ema_update [--rounds 15] [--updates 500]

Each implementation runs ``--updates`` updates inside one ``tf.function`` (a
``tf.while_loop``), rounds interleaved; prints the median and best microseconds per
update. Less disturbed by other processes than a whole training step, it shows what
the EMA adds to a step: compare with the step time of ``benchmarks.overhead.controls``.
Implementations: ``fused`` (the framework's default on one replica: one XLA-compiled
function), ``ops`` (three ops per variable, ``fused=False``), ``gd`` (a difference and
``ResourceApplyGradientDescent``, benchmarks/common/ema_variants.py), ``adam`` (Keras Adam's
``apply``, for scale), ``empty`` (the loop alone).
"""

from __future__ import annotations

import argparse
import os

from benchmarks.common import rounds

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SHAPES = [(784, 256), (256,), (256, 10), (10,)]


def updates(n: int) -> dict:
    """name -> a ``tf.function`` running ``n`` updates of that implementation."""
    import keras
    import tensorflow as tf

    from benchmarks.common.ema_variants import ApplyGradientDescentEMA
    from trainer.step.ema import ExponentialMovingAverage

    weights = [tf.Variable(tf.random.normal(s)) for s in SHAPES]
    grads = [tf.random.normal(s) * 1e-3 for s in SHAPES]
    adam = keras.optimizers.Adam()
    adam.build(weights)
    strategy = tf.distribute.get_strategy()
    emas = {"fused": ExponentialMovingAverage(0.999), "ops": ExponentialMovingAverage(
        0.999, fused=False), "gd": ApplyGradientDescentEMA(0.999)}
    for ema in emas.values():
        ema.build(strategy, weights)
    bodies = {name: (lambda ema=ema: ema.update(weights)) for name, ema in emas.items()}
    bodies["adam"] = lambda: adam.apply(grads, weights)
    bodies["empty"] = lambda: None

    def loop(body):
        def step(i):
            body()
            return i + 1
        return tf.function(lambda: tf.while_loop(lambda i: i < n, step, [0],
                                                 parallel_iterations=1), autograph=False)
    return {name: loop(body) for name, body in bodies.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--updates", type=int, default=500)
    args = parser.parse_args()
    print(rounds.table(updates(args.updates), args.rounds, args.updates, "ops", "per update",
                       f"ema_update: {args.rounds} rounds x {args.updates} updates"))


if __name__ == "__main__":
    main()
