"""Subprocess entry for multi-replica tests: one replica count per process.

    python -m tests.support.run_toy --replicas N --out weights.npz

Trains ToyTrainer (SGD and Adam), a custom step on the framework's path
(``self.apply_gradients``), a model whose forward pass updates a running mean, the
per-replica-mean negative control, and the ``manual_optimization`` step of
docs/training.md (the block ``my_project/manual_step.py``, read from the page) and its
negative control returning the loss divided by the global batch, for 20 steps on N
virtual CPU devices and saves every final weight and logged loss (``loss/NAME``), plus
the evaluate() result of ToyEvalTrainer.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def docs_recipe(out: pathlib.Path):
    """The module ``my_project/manual_step.py`` of docs/training.md, written beside
    ``out`` (the file the page asks you to write) and imported."""
    from tests.docs.code_blocks import blocks
    from tests.support.helpers import REPO

    (block,) = [b for b in blocks(REPO / "docs" / "training.md")
                if b.file == "my_project/manual_step.py"]
    path = out.with_name(f"{out.stem}_manual_step.py")
    path.write_text(block.body)
    spec = importlib.util.spec_from_file_location("manual_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    class ManualRecipe(docs_recipe(pathlib.Path(args.out)).ManualStepTrainer, toy.ToyTrainer):
        pass

    runs.update(manual_recipe=(ManualRecipe, config()),
                manual_global_share=(toy.GlobalShareLossTrainer, config()))
    for name, (cls, cfg) in runs.items():
        t = cls(cfg)
        assert t.strategy.num_replicas_in_sync == args.replicas
        out[f"loss/{name}"] = np.array(t.fit()["train/loss"])
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
