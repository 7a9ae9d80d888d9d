"""Subprocess entry for the numerics tests: one replica count per process.

    python -m tests.distribution.run_numerics --replicas N --out numerics.npz

Trains the toy model for 20 optimizer updates on N virtual CPU devices in each of the
distributed-numerics scenarios, each next to its negative control (plain Keras behaviour or a
deliberately wrong setting), and saves final weights and the facts the tests check
(loss scale, skipped steps, error messages, whether every replica holds the same
weights). tests/distribution/test_replica_count_numerics.py compares the files of 1, 2 and 4 replicas.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

INJECT_STEP = 5  # 1-based global step whose gradients are made non-finite
UNEVEN_EXAMPLES = 19 * 32 + 20  # 20 global batches of 32, the last one short (20)


def _trainers():
    """Scenario Trainers (defined here: TensorFlow is imported after argument parsing)."""
    import keras
    import tensorflow as tf

    from tests.support import toy

    def inject_inf_on_last_replica(trainer, per_example_loss):
        """Makes step INJECT_STEP's loss (hence gradients) inf on the LAST replica only."""
        ctx = tf.distribute.get_replica_context()
        last = tf.equal(ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync - 1)
        hit = tf.logical_and(last, tf.equal(trainer.step_counter, INJECT_STEP - 1))
        return per_example_loss * tf.where(hit, float("inf"), 1.0)

    class InfTrainer(toy.ToyTrainer):
        def compute_loss(self, batch, outputs):
            return inject_inf_on_last_replica(self, super().compute_loss(batch, outputs))

    class UnevenTrainer(toy.ToyTrainer):
        """A finite dataset whose 20th (last) global batch has 20 of 32 examples."""

        def build_train_dataset(self, ctx):
            x, y = toy.toy_data()
            x, y = np.concatenate([x, x])[:UNEVEN_EXAMPLES], np.concatenate([y, y])[:UNEVEN_EXAMPLES]
            batch = ctx.get_per_replica_batch_size(self.config.train.global_batch_size)
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)

    class KerasStep:
        """NEGATIVE CONTROL mixin: the textbook custom step, the Keras optimizer doing the
        cross-replica sum (and clipping / loss scaling) itself."""

        average_by_global_batch = True
        manual_optimization = True  # this step owns its updates, as a Keras user would

        def train_step(self, batch):
            with tf.GradientTape() as tape:
                outputs = tf.cast(self.model(batch[0], training=True), tf.float32)
                per_example_loss = self.compute_loss(batch, outputs)
                if self.average_by_global_batch:
                    loss = tf.nn.compute_average_loss(
                        per_example_loss, global_batch_size=self.config.train.global_batch_size)
                else:
                    loss = tf.nn.compute_average_loss(per_example_loss)
                loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
                scaled = (self.optimizer.scale_loss(loss)
                          if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
                          else loss)
            grads = tape.gradient(scaled, self.model.trainable_variables)
            self.optimizer.apply(grads, self.model.trainable_variables)
            return {"loss": loss}

    class KerasClipTrainer(KerasStep, toy.ToyTrainer):
        def build_optimizer(self):
            return keras.optimizers.SGD(self.config.optimizer.learning_rate, momentum=0.9,
                                        global_clipnorm=CLIP)

    class KerasLossScaleTrainer(KerasStep, InfTrainer):
        def build_optimizer(self):
            return keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(self.config.optimizer.learning_rate, momentum=0.9),
                initial_scale=self.config.precision.initial_loss_scale)

    class UserLossScaleTrainer(InfTrainer):
        """build_optimizer returns what TensorFlow's mixed-precision guide teaches for
        custom loops; the framework's default step (which takes it apart)."""

        def build_optimizer(self):
            return keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(self.config.optimizer.learning_rate, momentum=0.9),
                initial_scale=self.config.precision.initial_loss_scale)

    class LocalAverageUnevenTrainer(KerasStep, UnevenTrainer):
        average_by_global_batch = False  # tf.nn.compute_average_loss: local batch x replicas

    return dict(toy=toy.ToyTrainer, inf=InfTrainer, uneven=UnevenTrainer,
                keras_clip=KerasClipTrainer, keras_loss_scale=KerasLossScaleTrainer,
                user_loss_scale=UserLossScaleTrainer,
                local_average_uneven=LocalAverageUnevenTrainer)


CLIP = 0.05  # well below the toy gradients' global norm (~0.5), so clipping is active


def _replicas_agree(model) -> bool:
    """True when every replica's copy of every weight is bitwise identical."""
    for variable in model.weights:
        copies = [np.asarray(c) for c in variable.value.values] if hasattr(
            variable.value, "values") else [np.asarray(variable.value)]
        if any(not np.array_equal(copies[0], c, equal_nan=True) for c in copies[1:]):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from trainer.services.nonfinite import NonFiniteError
    from tests.support import toy

    classes = _trainers()

    def config(**overrides):
        cfg = toy.toy_config(**overrides)
        cfg.telemetry.progress = "off"
        cfg.telemetry.probe_every_windows = 0
        if args.replicas > 1:
            cfg.distribute.strategy = "mirrored"
            cfg.distribute.virtual_devices = args.replicas
        return cfg

    out: dict[str, np.ndarray] = {}
    facts: dict[str, object] = {}

    def save(name, t):
        assert t.strategy.num_replicas_in_sync == args.replicas
        for i, w in enumerate(t.model.get_weights()):
            out[f"{name}/{i}"] = w
        facts[f"{name}/replicas_agree"] = _replicas_agree(t.model)
        facts[f"{name}/updates"] = int(t.optimizer.iterations.numpy())

    live = []  # every Trainer stays alive: a destroyed distributed iterator can stall 60 s

    def new(cls, **overrides):
        live.append(classes[cls](config(**overrides)))
        return live[-1]

    def run(name, cls, **overrides):
        t = new(cls, **overrides)
        t.fit()
        save(name, t)
        return t

    clip = {"optimizer.clipnorm": CLIP}
    run("clip", "toy", **clip)
    t = run("clip_jit", "toy", **clip, **{"perf.jit_compile": True})
    facts["clip_jit/xla"] = t.steps.jit_compiled
    run("clip_recompute", "toy", **clip, **{"perf.recompute": True})
    run("keras_clip", "keras_clip")  # negative control: Keras clips per replica

    adam = {"optimizer.name": "adam", "optimizer.learning_rate": 0.01}
    run("big_batch", "toy", **adam)
    micro = {"train.global_batch_size": 8, "train.steps": 80, **adam}
    run("accum", "toy", **micro, **{"perf.grad_accum_steps": 4})
    run("no_accum", "toy", **micro)  # negative control: forgot accumulation

    # mixed_float16, inf on the last replica at step 5: stop after 4, 5 and 20 steps.
    fp16 = {"precision.policy": "mixed_float16", "optimizer.momentum": 0.9}
    for name, cls in (("fp16_inf", "inf"), ("keras_fp16_inf", "keras_loss_scale"),
                      ("user_fp16_inf", "user_loss_scale")):
        t = new(cls, **fp16, **{"train.steps": INJECT_STEP - 1})
        t.fit()
        scale_variable = (t.optimizer.dynamic_scale if cls == "keras_loss_scale"
                          else t.precision.scale)

        def scale():
            return float(scale_variable.numpy())

        before = [w.copy() for w in t.model.get_weights()]
        facts[f"{name}/scale_before"] = scale()
        t.config.train.steps = INJECT_STEP
        t.fit()
        facts[f"{name}/scale_after"] = scale()
        facts[f"{name}/unchanged_by_inf_step"] = all(
            np.array_equal(a, b) for a, b in zip(before, t.model.get_weights()))
        facts[f"{name}/replicas_agree_after_inf_step"] = _replicas_agree(t.model)
        t.config.train.steps = 20
        t.fit()
        save(name, t)
        facts[f"{name}/finite"] = all(np.isfinite(w).all() for w in t.model.get_weights())
        if cls != "keras_loss_scale":
            facts[f"{name}/skipped_steps"] = int(t.precision.skipped_steps.numpy())
            facts[f"{name}/last_skipped_step"] = int(t.precision.last_skipped_step.numpy())

    # float32, inf on the last replica at step 5: "skip" skips it everywhere; the default
    # "auto" does not check float32 updates (the inf is applied, identically everywhere).
    for name, mode in (("fp32_skip", "skip"), ("fp32_auto", "auto")):
        t = run(name, "inf", **{"train.on_nonfinite": mode})
        facts[f"{name}/finite"] = all(np.isfinite(w).all() for w in t.model.get_weights())
        facts[f"{name}/skipped_steps"] = int(t.precision.skipped_steps.numpy())

    # float32 with train.on_nonfinite="stop": a clear error naming the step, everywhere.
    t = new("inf", **{"train.on_nonfinite": "stop"})
    try:
        t.fit()
        facts["stop/error"] = ""
    except NonFiniteError as error:
        facts["stop/error"] = str(error)
    facts["stop/step"] = t.step
    facts["stop/replicas_agree"] = _replicas_agree(t.model)
    facts["stop/finite"] = all(np.isfinite(w).all() for w in t.model.get_weights())

    run("uneven", "uneven")
    run("local_average_uneven", "local_average_uneven")  # negative control

    out["facts"] = np.array(json.dumps(facts))
    np.savez(args.out, **out)


if __name__ == "__main__":
    from trainer.runtime.fast_exit import exit_now

    main()
    exit_now(0)  # no teardown of distributed iterators (up to 60 s each)
