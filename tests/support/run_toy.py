"""Subprocess entry for multi-replica tests: one replica count per process.

    python -m tests.support.run_toy --replicas N --out weights.npz

Trains ToyTrainer (SGD and Adam), a custom step on the framework's path
(``self.apply_gradients``), a model whose forward pass updates a running mean and the per-replica-mean negative control for 20
steps on N virtual CPU devices and saves every final weight, plus the evaluate()
result of ToyEvalTrainer.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from tests.support import toy

    def config(**overrides):
        return toy.on_replicas(toy.toy_config(**overrides), args.replicas)

    out = {}
    runs = {
        "sgd": (toy.ToyTrainer, config()),
        "adam": (toy.ToyTrainer, config(**{"optimizer.name": "adam",
                                           "optimizer.learning_rate": 0.01})),
        "tape_step": (toy.TapeStepTrainer, config()),
        "stateful": (toy.StatefulTrainer, config()),
        "per_replica_mean": (toy.PerReplicaMeanTrainer, config()),
    }
    for name, (cls, cfg) in runs.items():
        t = cls(cfg)
        assert t.strategy.num_replicas_in_sync == args.replicas
        t.fit()
        for i, w in enumerate(t.model.get_weights()):
            out[f"{name}/{i}"] = w
        if name == "stateful":  # every replica's copy of the state, not only replica 0's
            for v in t.model.non_trainable_variables:
                for r, copy in enumerate(t.strategy.experimental_local_results(v.value)):
                    out[f"state/{v.path}/{r}"] = copy.numpy()
    evaluator = toy.ToyEvalTrainer(config(**{"eval.global_batch_size": 16}))
    evaluation = evaluator.evaluate()
    out["eval_weights"] = np.concatenate([w.ravel() for w in evaluator.model.get_weights()])
    out["eval_result"] = np.array(json.dumps(evaluation))
    np.savez(args.out, **out)


if __name__ == "__main__":
    from trainer.runtime.fast_exit import exit_now

    main()
    exit_now(0)  # no teardown of distributed iterators (up to 60 s each)
