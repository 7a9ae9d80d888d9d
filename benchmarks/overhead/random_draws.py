"""What keyed, algorithm-pinned random draws cost: a dropout mask of a [64, 1024]
activation per draw, in one process.

    python -m benchmarks.overhead.random_draws [--rounds 15] [--draws 200]

Each implementation runs ``--draws`` dropouts inside one ``tf.function`` (a
``tf.while_loop``; ``_xla``: compiled with XLA), rounds interleaved; prints the median
and best microseconds per draw. Implementations: ``auto`` (TensorFlow's
``stateless_dropout`` with its default algorithm, ``auto_select``: philox without XLA,
ThreeFry under XLA on a CPU, so the two draw other masks), ``philox`` (the algorithm
pinned, as Keras' draws are under the framework: :data:`trainer.runtime.pinned_draws.PINNED_TF`),
``keyed`` (``keras.random.dropout`` with a ``SeedGenerator`` inside
:func:`trainer.runtime.keras_compat.seed_key` of a step and a replica id: the seed drawn,
the key folded in, philox; what a replica's step does).
"""

from __future__ import annotations

import argparse
import os

from benchmarks.common import rounds

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SHAPE = (64, 1024)


def draws(n: int) -> dict:
    """name -> a ``tf.function`` running ``n`` dropout draws of that implementation."""
    import keras
    import tensorflow as tf

    from trainer.runtime import keras_compat

    x = tf.ones(SHAPE)
    generator = keras.random.SeedGenerator(1)
    step = tf.Variable(0, dtype=tf.int64)

    def keyed(i):
        with keras_compat.seed_key(step.read_value(), 1):
            return keras.random.dropout(x, 0.5, seed=generator)

    bodies = {
        "auto": lambda i: tf.nn.experimental.stateless_dropout(x, 0.5, seed=[i, 1]),
        "philox": lambda i: tf.nn.experimental.stateless_dropout(x, 0.5, seed=[i, 1],
                                                                 rng_alg="philox"),
        "keyed": keyed,
    }

    def loop(body, jit):
        def once(i, total):
            return i + 1, total + tf.reduce_sum(body(i))
        return tf.function(lambda: tf.while_loop(lambda i, _: i < n, once, [0, 0.0],
                                                 parallel_iterations=1),
                           autograph=False, jit_compile=jit)
    functions = {name: loop(body, False) for name, body in bodies.items()}
    functions.update({f"{name}_xla": loop(body, True) for name, body in bodies.items()})
    return functions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--draws", type=int, default=200)
    args = parser.parse_args()
    print(rounds.table(draws(args.draws), args.rounds, args.draws, "auto", "per draw",
                       f"random_draws: {args.rounds} rounds x {args.draws} dropouts of "
                       f"{SHAPE[0]}x{SHAPE[1]}"))


if __name__ == "__main__":
    main()
