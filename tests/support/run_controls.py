"""Scenarios of the training controls (EMA, rollback, the NaN checkpoint guard) on N
replicas; one replica count per process.

    python -m tests.support.run_controls --replicas N --workdir DIR --out results.json

Writes a JSON object whose numbers tests/services/test_training_controls.py checks with the same
assertions for every replica count.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

EMA_DECAY = 0.9
POISON_STEP = 12  # 0-based global step whose batch holds an inf (first replica's share)


def ema_scenario(config, out: dict) -> None:
    """Raw weights after every step -> the documented EMA in numpy -> evaluate()."""
    import keras

    from tests.support import toy
    from tests.support.run_callbacks import Recorder

    class WeightLog(Recorder):
        def __init__(self):
            super().__init__()
            self.weights = []

        def on_fit_start(self, trainer):
            self.weights.append(trainer.model.get_weights())

        def on_loop_end(self, trainer):
            self.weights.append(trainer.model.get_weights())

    log = WeightLog()
    cfg = config(**{"optimizer.ema_decay": EMA_DECAY, "train.steps_per_loop": 1,
                    "optimizer.name": "adam", "optimizer.learning_rate": 0.05,
                    "eval.global_batch_size": 20})
    t = toy.ToyEvalTrainer(cfg, callbacks=[log])
    t.fit()
    ema = [w.copy() for w in log.weights[0]]
    for weights in log.weights[1:]:
        ema = [EMA_DECAY * e + (1 - EMA_DECAY) * w for e, w in zip(ema, weights)]
    x, y = toy.toy_data(100, seed=1)

    def plain_keras_loss(weights):
        model = t.build_model()
        model.set_weights(weights)
        return float(np.mean(keras.losses.sparse_categorical_crossentropy(
            y, model(x), from_logits=True)))

    out["ema_evaluate"] = t.evaluate()["loss"]
    out["ema_numpy_loss"] = plain_keras_loss(ema)
    out["raw_numpy_loss"] = plain_keras_loss(log.weights[-1])
    out["raw_after_evaluate"] = float(max(np.max(np.abs(a - b)) for a, b in
                                          zip(t.model.get_weights(), log.weights[-1])))
    out["ema_vars_vs_numpy"] = float(max(np.max(np.abs(v.numpy() - e)) for v, e in
                                         zip(t.ema.variables, ema)))


def poisoned_trainer(toy, tf):
    class Poisoned(toy.ToyTrainer):
        """Step POISON_STEP's batch (first replica's share) holds an inf feature."""

        def build_train_dataset(self, ctx):
            replicas = ctx.num_replicas_in_sync // ctx.num_input_pipelines
            bad = POISON_STEP * replicas

            def poison(i, batch):
                x, y = batch
                return tf.where(tf.equal(i, bad), x * float("inf"), x), y

            return super().build_train_dataset(ctx).enumerate().map(poison)

    return Poisoned


def rollback_scenario(config, workdir: str, out: dict) -> None:
    import tensorflow as tf

    from tests.support import toy
    from trainer.services.nonfinite import NonFiniteError

    cls = poisoned_trainer(toy, tf)
    common = {"train.steps": 30, "train.steps_per_loop": 5, "checkpoint.every_steps": 5,
              "checkpoint.async_save": False}
    t = cls(config(**common, **{"train.on_nonfinite": "rollback"}),
            os.path.join(workdir, "rollback"))
    t.fit()
    out["rollback_final_step"] = t.step
    out["rollback_finite"] = bool(all(np.isfinite(w).all() for w in t.model.get_weights()))
    with open(os.path.join(workdir, "rollback", "metrics.jsonl")) as f:
        out["rollback_records"] = [r for r in map(json.loads, f) if r["kind"] == "rollback"]

    auto_dir = os.path.join(workdir, "auto")
    try:
        cls(config(**common), auto_dir).fit()
        out["auto_error"] = "no error"
    except NonFiniteError as error:
        out["auto_error"] = str(error)
    steps = sorted(int(s) for s in os.listdir(os.path.join(auto_dir, "checkpoints")))
    out["auto_steps"] = steps
    finite = []
    for step in steps:
        r = toy.ToyTrainer(config(**common), auto_dir)
        r.restore(step)
        finite.append(bool(all(np.isfinite(w).all() for w in r.model.get_weights())))
    out["auto_restored_finite"] = finite


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from tests.support import toy

    def config(**overrides):
        return toy.on_replicas(toy.toy_config(**overrides), args.replicas)

    out: dict = {"replicas": args.replicas}
    ema_scenario(config, out)
    rollback_scenario(config, args.workdir, out)
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    from trainer.runtime.fast_exit import exit_now

    main()
    exit_now(0)
