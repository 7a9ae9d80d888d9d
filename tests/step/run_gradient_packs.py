"""A worker of tests/step/test_gradient_packs.py, started by the launcher:

    python -m launch.multiworker --workers 2 --module tests.step.run_gradient_packs \
        --pack_bytes N [--compression bf16]

Under MultiWorkerMirroredStrategy (TF_CONFIG from the launcher), traces the gradient
path's all-reduce
(``trainer.step.sparse_gradients.all_reduce_sum``) of 3 gradients (1,000 + 10 + 4,000
float32) and a scalar, runs it, and prints one JSON line: the number of collective
all-reduce ops in the graph, their dtypes and the reduced values.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pack_bytes", type=int, default=0)
    parser.add_argument("--compression", default="none")  # distribute.grad_compression
    args, _ = parser.parse_known_args()  # the launcher adds --config.distribute.strategy

    import tensorflow as tf

    from trainer.step import sparse_gradients

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    shapes = [(1000,), (10,), (40, 100)]
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(s)) for s in shapes]

    def replica_fn():
        replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group,
                          tf.float32)
        grads = [tf.reshape(tf.range(tf.reduce_prod(s), dtype=tf.float32), s) * 0.1 + replica
                 for s in shapes]
        reduced, extras = sparse_gradients.all_reduce_sum(
            grads, variables, [replica + 1.0], "auto", strategy, args.pack_bytes,
            args.compression)
        return [tf.reduce_sum(g) for g in reduced] + extras

    step = tf.function(lambda: strategy.run(replica_fn))
    graph = step.get_concrete_function().graph
    collectives = [op for op in graph.get_operations() if op.type.startswith("CollectiveReduce")]
    values = [float(strategy.experimental_local_results(v)[0]) for v in step()]
    print(json.dumps({"collectives": len(collectives), "values": values,
                      "dtypes": sorted(op.get_attr("T").name for op in collectives)}))


if __name__ == "__main__":
    main()
