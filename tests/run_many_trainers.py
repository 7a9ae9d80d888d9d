"""Subprocess entry: the notebook pattern, several Trainers fitted one after another in
ONE process.

    python -m tests.run_many_trainers --trainers 4 --workdir DIR [--replicas 2]

Each Trainer (ToyEvalTrainer, a workdir of its own: summaries and checkpoints) is
built and fitted; odd ones through ``with Trainer(...) as t:``, the others by
``fit()`` then ``close()``; then one more is fitted and dropped without ``close()``
(``del`` and the collection a notebook's next cell would run). After each ``fit()``,
each close and the drop, with NO garbage collection in between (the process runs with
the collector off), one JSON line counts what is still alive once the pending releases
are done (``trainer.data.iterator_release`` destroys iterators on a background thread):
tf.data iterators and distributed iterators, distributed datasets, and threads;
``pending`` is the number of releases a ``fit()``, close or drop left running when it
returned. Ends with the line ``done``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def live(types: tuple) -> int:
    """Objects of ``types`` alive now (freed ones and unreachable cycles not yet
    collected both count: the collector is off)."""
    return sum(1 for o in gc.get_objects() if isinstance(o, types))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainers", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()

    import tensorflow as tf

    from tests.support import toy
    from trainer.data import iterator_release

    iterators = (tf.data.Iterator, tf.distribute.DistributedIterator)
    datasets = (tf.distribute.DistributedDataset,)
    gc.collect()
    gc.disable()  # whatever is freed below is freed by reference counting alone
    baseline = threading.active_count()

    def report(i: int, when: str, results: dict | None = None) -> None:
        pending = iterator_release.pending()
        iterator_release.wait()
        print(json.dumps({"trainer": i, "when": when, "pending": pending,
                          "iterators": live(iterators),
                          "datasets": live(datasets),
                          "threads": threading.active_count(), "baseline": baseline,
                          "keys": sorted(results or {})}), flush=True)

    for i in range(args.trainers):
        config = toy.on_replicas(toy.toy_config(**{"eval.every_steps": 10}), args.replicas)
        workdir = os.path.join(args.workdir, str(i))
        if i % 2:
            with toy.ToyEvalTrainer(config, workdir) as t:
                results = t.fit()
                report(i, "fit", results)
        else:
            t = toy.ToyEvalTrainer(config, workdir)
            results = t.fit()
            report(i, "fit", results)
            t.close()
        report(i, "closed")
        del t
        gc.collect()  # the Trainer's own reference cycles, between cells
    config = toy.on_replicas(toy.toy_config(**{"eval.every_steps": 10}), args.replicas)
    t = toy.ToyEvalTrainer(config, os.path.join(args.workdir, "dropped"))
    report(args.trainers, "fit", t.fit())
    del t
    # Its cycle's collection hands the iterator it kept for a next fit() to the release
    # (not destroyed on this thread); the rest of the cycle, which the iterator held, goes
    # at the next collection.
    gc.collect()
    iterator_release.wait()
    gc.collect()
    report(args.trainers, "dropped")
    print("done", flush=True)


if __name__ == "__main__":
    main()
