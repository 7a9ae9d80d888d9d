"""Subprocess entry for the manual data parallelism tests: one device layout per process.

    python -m tests.distribution.run_manual --devices 3 --out manual3.npz
    python -m tests.distribution.run_manual --devices 2 --out manual2.npz

With 3 virtual CPU devices: each scenario trains the toy model (or one whose forward
pass updates a running mean) for 20 steps on one
device (the whole batch) and in manual mode with device_weights (1, 2, 1) (split
8/16/8 of 32), plus a negative control (per-device MEAN gradients averaged with equal
weights), a checkpoint resume, a non-finite step on one device, evaluate() with a
short last batch, the graph's op placement, the error messages of invalid settings (and
of a synchronized batch norm) and the weight-measuring helper. With 2: Mirrored (2 replicas) next to manual (1, 1).
Everything the tests check is saved to the npz (weights as ``NAME/i``).

    python -m tests.distribution.run_manual --devices 3 --log_placement

trains 5 manual steps with ``distribute.log_placement`` (TensorFlow applies it only
when set before its runtime starts, hence a process of its own): the placement log is
this process's stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

WEIGHTS = (1, 2, 1)
INJECT_STEP = 5  # 1-based step whose loss is made inf on the middle device only


def _classes():
    """Scenario classes (defined here: TensorFlow is imported after argument parsing)."""
    import keras
    import tensorflow as tf

    from tests.support import toy
    from trainer.distribution.data_parallel import ManualDataParallel

    class CustomStepTrainer(toy.ToyTrainer):
        """A user's own train_step: tape + apply_gradients + an extra output."""

        def train_step(self, batch):
            features, labels = batch
            with tf.GradientTape() as tape:
                logits = self.model(features, training=True)
                per_example_loss = keras.losses.sparse_categorical_crossentropy(
                    labels, logits, from_logits=True)
            loss = self.apply_gradients(tape, per_example_loss)
            return {"loss": loss, "mean_logit": tf.reduce_mean(logits)}

    class InfOnMiddleDevice(toy.ToyTrainer):
        """Step INJECT_STEP's loss is inf on the 16-example (middle) slice only."""

        def compute_loss(self, batch, outputs):
            loss = super().compute_loss(batch, outputs)
            hit = tf.logical_and(tf.equal(tf.shape(loss)[0], 16),
                                 tf.equal(self.step_counter, INJECT_STEP - 1))
            return loss * tf.where(hit, float("inf"), 1.0)

    class PerDeviceMeanManual(ManualDataParallel):
        """NEGATIVE CONTROL: each device's MEAN gradient, averaged with equal weights.

        The textbook combination for equal splits; on an uneven split it over-weights
        the examples of the small slices.
        """

        def intercept(self, optimizer, variables, grads, per_example_loss):
            if not self.deferring:
                return None
            n_slice = tf.cast(tf.shape(per_example_loss)[0], tf.float32)
            factor = float(sum(self.train_sizes)) / (n_slice * len(self.devices))
            grads = [g * factor for g in grads]
            return super().intercept(optimizer, variables, grads, per_example_loss)

    return CustomStepTrainer, InfOnMiddleDevice, PerDeviceMeanManual


def _save_weights(out: dict, name: str, trainer) -> None:
    for i, w in enumerate(trainer.model.get_weights()):
        out[f"{name}/{i}"] = w


def _error(fn) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


def _placement(trainer) -> dict[str, list[str]]:
    """Op types per device in the traced manual train step's graph."""
    import tensorflow as tf

    from trainer import data

    dataset = data.distribute(trainer.strategy, trainer.build_train_dataset, trainer.batch)
    trainer.context.ensure_built(dataset)
    step = trainer.gradients.reducer.wrap_train(trainer.train_step)
    traced = tf.function(lambda batch: trainer.strategy.run(step, args=(batch,)))
    graph = traced.get_concrete_function(dataset.element_spec).graph
    devices: dict[str, set] = {}
    for op in graph.get_operations():
        devices.setdefault(op.device, set()).add(op.type)
    return {d: sorted(types) for d, types in devices.items()}


def run_three(out: dict, workdir: str) -> None:
    from tests.support import toy
    from trainer import manual

    custom_cls, inf_cls, mean_manual_cls = _classes()

    def config(manual_weights=None, **overrides):
        cfg = toy.toy_config(**overrides)
        cfg.distribute.virtual_devices = 3
        if manual_weights is not None:
            cfg.distribute.strategy = "manual"
            cfg.distribute.device_weights = manual_weights
        return cfg

    adam = {"optimizer.name": "adam", "optimizer.learning_rate": 0.01}
    mixed = dict(adam, **{"precision.policy": "mixed_float16", "optimizer.clipnorm": 0.5})
    scenarios = {
        "sgd": (toy.ToyTrainer, {}),
        "adam": (toy.ToyTrainer, adam),
        "mixed_clip": (toy.ToyTrainer, mixed),
        "accum": (toy.ToyTrainer, {"perf.grad_accum_steps": 2}),
        "custom": (custom_cls, {}),
        "jit": (toy.ToyTrainer, {"perf.jit_compile": True}),
        "stateful": (toy.ReadFirstStatefulTrainer, {}),
    }
    for name, (cls, overrides) in scenarios.items():
        for mode, weights in (("single", None), ("manual", WEIGHTS)):
            t = cls(config(weights, **overrides))
            results = t.fit()
            _save_weights(out, f"{mode}_{name}", t)
            out[f"{mode}_{name}_results"] = np.array(json.dumps(results))
            out[f"{mode}_{name}_loss_scale"] = t.precision.scale.numpy()

    # Float weights whose shares are not whole examples: split 6/10/16.
    t = toy.ToyTrainer(config((1, 1.5, 2.5)))
    out["float_weights_split"] = np.array(t.gradients.reducer.train_sizes)
    t.fit()
    _save_weights(out, "manual_float_weights", t)

    # NEGATIVE CONTROL: per-device mean gradients with equal weights on the 8/16/8 split.
    t = toy.ToyTrainer(config(WEIGHTS))
    t.gradients.plug(mean_manual_cls(t.config, t.strategy))
    t.fit()
    _save_weights(out, "manual_per_device_mean", t)

    # Checkpoint: 10 steps, a new Trainer resumes from workdir and runs to 20.
    first = toy.ToyTrainer(config(WEIGHTS, **{"train.steps": 10}), workdir)
    first.fit()
    resumed = toy.ToyTrainer(config(WEIGHTS), workdir)
    resumed.fit()
    out["resumed_from"] = np.array(resumed.step)
    _save_weights(out, "manual_resumed", resumed)

    # A non-finite loss on one device skips the step for all (one loss scale).
    t = inf_cls(config(WEIGHTS, **{"precision.policy": "mixed_float16"}))
    t.fit()
    out["inf_skipped"] = t.precision.skipped_steps.numpy()
    out["inf_last_skipped"] = t.precision.last_skipped_step.numpy()
    out["inf_loss_scale"] = t.precision.scale.numpy()
    out["inf_finite_weights"] = np.array(all(np.isfinite(w).all() for w in t.model.get_weights()))

    # evaluate(): 100 examples in batches of 16, the last batch of 4 is split in-graph.
    for mode, weights in (("single", None), ("manual", WEIGHTS)):
        t = toy.ToyEvalTrainer(config(weights, **{"eval.global_batch_size": 16}))
        out[f"{mode}_eval"] = np.array(json.dumps(t.evaluate()))

    # "skip": the update is then the one If(IsFinite) the placement test looks for.
    t = toy.ToyTrainer(config(WEIGHTS, **{"train.on_nonfinite": "skip"}))
    out["devices"] = np.array(t.gradients.reducer.devices)
    out["placement"] = np.array(json.dumps(_placement(t)))
    measured = manual.measure(t, repeats=2)
    out["measure"] = np.array(json.dumps(measured))

    import keras

    class BatchNormToy(toy.ToyTrainer):
        def build_model(self):
            return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                     keras.layers.BatchNormalization(), keras.layers.Dense(3)])

    errors = {
        # a synchronized batch norm's all-reduce would see one device slice alone
        "sync_batch_norm": lambda: BatchNormToy(config(WEIGHTS, **{
            "distribute.sync_batch_norm": True, "train.steps": 1})).fit(),
        "zero_split": lambda: toy.ToyTrainer(config((1, 1, 1), **{"train.global_batch_size": 2})),
        "length_default_devices": lambda: toy.ToyTrainer(config((1, 1))),
        "missing_device": lambda: toy.ToyTrainer(config(
            (1, 1), **{"distribute.devices": ("/cpu:0", "/gpu:0")})),
        "missing_index": lambda: toy.ToyTrainer(config(
            None, **{"distribute.strategy": "manual", "distribute.devices": ("/cpu:0", "/cpu:7")})),
        "duplicate_device": lambda: toy.ToyTrainer(config(
            None, **{"distribute.strategy": "manual", "distribute.devices": ("/cpu:1", "/CPU:1")})),
    }
    for name, fn in errors.items():
        out[f"error_{name}"] = np.array(_error(fn))


def run_two(out: dict) -> None:
    from tests.support import toy

    adam = {"optimizer.name": "adam", "optimizer.learning_rate": 0.01}
    for name, overrides in (("sgd", {}), ("adam", adam)):
        for mode in ("mirrored", "manual"):
            cfg = toy.toy_config(**overrides)
            cfg.distribute.virtual_devices = 2
            cfg.distribute.strategy = mode
            if mode == "manual":
                cfg.distribute.device_weights = (1, 1)
            t = toy.ToyTrainer(cfg)
            t.fit()
            if mode == "mirrored":
                assert t.strategy.num_replicas_in_sync == 2
            _save_weights(out, f"{mode}_{name}", t)


def run_log_placement() -> None:
    from tests.support import toy

    cfg = toy.toy_config(**{"train.steps": 5, "distribute.strategy": "manual",
                            "distribute.virtual_devices": 3, "distribute.log_placement": True})
    cfg.distribute.device_weights = WEIGHTS
    toy.ToyTrainer(cfg).fit()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, choices=(2, 3), required=True)
    parser.add_argument("--out")
    parser.add_argument("--log_placement", action="store_true")
    args = parser.parse_args()
    if args.log_placement:
        run_log_placement()
        return
    out: dict = {}
    if args.devices == 3:
        with tempfile.TemporaryDirectory() as workdir:
            run_three(out, workdir)
    else:
        run_two(out)
    np.savez(args.out, **out)


if __name__ == "__main__":
    from trainer.runtime.fast_exit import exit_now

    main()
    exit_now(0)  # no teardown of distributed iterators (up to 60 s each)
