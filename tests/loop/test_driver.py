"""The driver: steps_per_loop, exact step counts, hooks, and clear errors (default strategy)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support import toy


def fit_weights(**overrides) -> list[np.ndarray]:
    t = toy.ToyTrainer(toy.toy_config(**overrides))
    t.fit()
    return t.model.get_weights()


def test_steps_per_loop_1_10_and_7_give_identical_weights():
    # 20 steps: 7 is not a divisor, so the last loop is short (and must not retrace).
    reference = fit_weights(**{"train.steps_per_loop": 1})
    for steps_per_loop in (10, 7):
        for ref, got in zip(reference, fit_weights(**{"train.steps_per_loop": steps_per_loop})):
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)


def test_fit_stops_exactly_at_train_steps():
    t = toy.ToyTrainer(toy.toy_config(**{"train.steps": 23, "train.steps_per_loop": 5}))
    results = t.fit()
    assert t.step == 23
    assert int(t.step_counter.numpy()) == 23
    assert int(t.optimizer.iterations.numpy()) == 23
    assert set(results) == {"train/loss"}
    assert t.driver.loops.train.experimental_get_tracing_count() == 1


def test_required_hooks_only_subclass_trains():
    t = toy.ToyTrainer(toy.toy_config(**{"train.steps": 60, "train.log_every_steps": 20}))
    first = None

    def loss_now():
        x, y = toy.toy_data()
        return float(np.mean(keras.losses.sparse_categorical_crossentropy(
            y, t.model(x), from_logits=True)))

    t.model(np.zeros((1, 8), np.float32))
    first = loss_now()
    results = t.fit()
    assert loss_now() < first
    assert np.isfinite(results["train/loss"])


class CustomStepTrainer(toy.ToyTrainer):
    """Overrides train_step with its own logic: a second, separately logged term."""

    def train_step(self, batch):
        x, _ = batch
        with tf.GradientTape() as tape:
            logits = self.model(x, training=True)
            per_example = self.compute_loss(batch, logits) + 0.01 * tf.reduce_sum(
                tf.square(logits), axis=-1)
        loss = self.apply_gradients(tape, per_example)
        return {"loss": loss, "logit_norm": tf.reduce_mean(tf.norm(logits, axis=-1))}


def test_custom_train_step_trains_and_reports_its_outputs():
    t = CustomStepTrainer(toy.toy_config(**{"train.steps": 30}))
    results = t.fit()
    assert set(results) == {"train/loss", "train/logit_norm"}
    assert results["train/logit_norm"] > 0
    assert int(t.optimizer.iterations.numpy()) == 30


class ScalarLossTrainer(toy.ToyTrainer):
    def compute_loss(self, batch, outputs):
        return tf.reduce_mean(super().compute_loss(batch, outputs))


class WrongShapeLossTrainer(toy.ToyTrainer):
    def compute_loss(self, batch, outputs):
        return keras.losses.sparse_categorical_crossentropy(
            tf.concat([batch[1], batch[1]], 0), tf.concat([outputs, outputs], 0),
            from_logits=True)


def test_scalar_loss_is_rejected_with_explanation():
    with pytest.raises(ValueError, match="PER-EXAMPLE"):
        ScalarLossTrainer(toy.toy_config()).fit()


def test_loss_of_wrong_length_is_rejected():
    with pytest.raises(ValueError, match="64 losses for a batch of 32"):
        WrongShapeLossTrainer(toy.toy_config()).fit()


class GlobalBatchDatasetTrainer(toy.ToyTrainer):
    def build_train_dataset(self, ctx):
        x, y = toy.toy_data()
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
            64, drop_remainder=True)


def test_dataset_with_wrong_per_replica_batch_is_rejected():
    with pytest.raises(ValueError, match="batches of \\[64\\] examples but the per-replica batch is 32"):
        GlobalBatchDatasetTrainer(toy.toy_config()).fit()


class FiniteDatasetTrainer(toy.ToyTrainer):
    def build_train_dataset(self, ctx):
        return super().build_train_dataset(ctx).take(3)


def test_dataset_running_out_says_to_repeat():
    with pytest.raises(ValueError, match="ran out of data at step 4 .*repeat"):
        FiniteDatasetTrainer(toy.toy_config(**{"train.steps_per_loop": 1})).fit()


def test_evaluate_without_eval_dataset_says_what_to_override():
    with pytest.raises(ValueError, match="build_eval_dataset"):
        toy.ToyTrainer(toy.toy_config()).evaluate()


def test_fit_reports_eval_metrics_with_eval_dataset():
    t = toy.ToyEvalTrainer(toy.toy_config(**{"eval.every_steps": 10}))
    results = t.fit()
    assert set(results) == {"train/loss", "train/accuracy", "eval/loss", "eval/accuracy"}
    assert all(isinstance(v, float) for v in results.values())


def test_second_fit_continues_where_the_first_stopped():
    # fit() to 10 then to 20 on the same Trainer == one fit() to 20 (same data order).
    split = toy.ToyTrainer(toy.toy_config(**{"train.steps": 10}))
    split.fit()
    split.config.train.steps = 20
    split.fit()
    assert split.step == 20
    for ref, got in zip(fit_weights(), split.model.get_weights()):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)


def test_default_strategy_trains_like_one_device():
    default = toy.ToyTrainer(toy.toy_config(**{"distribute.strategy": "default"}))
    default.fit()
    for ref, got in zip(fit_weights(), default.model.get_weights()):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)


class SecondOptimizerTrainer(toy.ToyTrainer):
    """Builds a second optimizer's variables from build_model, as documented."""

    def build_model(self):
        model = super().build_model()
        self.head_optimizer = keras.optimizers.SGD(0.1)
        self.build_optimizer_variables(self.head_optimizer, model.layers[-1].trainable_variables)
        return model


def test_second_optimizer_can_be_built_from_build_model():
    t = SecondOptimizerTrainer(toy.toy_config())
    assert t.head_optimizer.built


# ------------------------------------------------------------------ AutoGraph
class PythonControlFlowTrainer(toy.ToyTrainer):
    """User hooks with Python control flow on tensors (needs AutoGraph to trace)."""

    def compute_loss(self, batch, outputs):
        loss = super().compute_loss(batch, outputs)
        if tf.reduce_mean(loss) > 1e6:  # a tensor condition: AutoGraph makes it a tf.cond
            loss = loss * 0.0
        return loss

    def update_metrics(self, metrics, batch, outputs):
        for metric in metrics.values():
            if tf.shape(outputs)[0] > 0:
                metric.update_state(batch[1], outputs)


def test_user_hooks_keep_autograph_while_framework_code_is_not_converted(monkeypatch):
    from tensorflow.python.autograph.pyct import transpiler

    converted = []
    original = transpiler.PyToPy.transform_function

    def record(self, fn, user_context):
        converted.append(f"{fn.__module__}.{fn.__qualname__}")
        return original(self, fn, user_context)

    monkeypatch.setattr(transpiler.PyToPy, "transform_function", record)

    class WithMetrics(PythonControlFlowTrainer):
        def build_metrics(self):
            return {"accuracy": keras.metrics.SparseCategoricalAccuracy()}

    results = WithMetrics(toy.toy_config()).fit()
    assert results["train/accuracy"] > 0
    assert any(name.endswith("PythonControlFlowTrainer.compute_loss") for name in converted)
    assert any(name.endswith("PythonControlFlowTrainer.update_metrics") for name in converted)
    # Framework functions traced in the step run as written: converting each costs
    # ~0.05-0.5 s of cold start. Only the in-graph loops themselves (tf.range/while) are.
    loops = {"trainer.loop.compiled_loops.CompiledLoops.__init__.<locals>.train",
             "trainer.telemetry.probes.InputProbe.__init__.<locals>.drain",
             "trainer.telemetry.probes.ComputeProbe.__init__.<locals>.run"}
    assert "trainer.loop.compiled_loops.CompiledLoops.__init__.<locals>.train" in converted
    assert {n for n in converted if n.startswith("trainer.")} <= loops


def test_nonfinite_train_loss_is_logged_once_with_what_to_do(caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="absl")

    class NaNLossTrainer(toy.ToyTrainer):
        def compute_loss(self, batch, outputs):
            return super().compute_loss(batch, outputs) * float("nan")

    NaNLossTrainer(toy.toy_config(**{"train.steps": 30})).fit()
    warnings = [r.getMessage() for r in caplog.records if "Train loss is nan" in r.getMessage()]
    assert len(warnings) == 1
    assert "train.on_nonfinite='skip'" in warnings[0] and "step 10" in warnings[0]


def test_train_step_outputs_of_unknown_shape_are_refused_by_name():
    class RaggedOutputTrainer(toy.ToyTrainer):
        def train_step(self, batch):
            outputs = super().train_step(batch)
            positive = tf.boolean_mask(batch[0][:, 0], batch[0][:, 0] > 0)  # shape [None]
            return {**outputs, "positive": positive}

    with pytest.raises(ValueError, match=r"'positive' with shape \(None,\).*return scalars"):
        RaggedOutputTrainer(toy.toy_config()).fit()


class IdleMetricTrainer(toy.TapeStepTrainer):
    """A custom step that never updates the metric build_metrics declares."""

    def build_metrics(self):
        return {"accuracy": keras.metrics.SparseCategoricalAccuracy()}


class UpdatedMetricTrainer(IdleMetricTrainer):
    def train_step(self, batch):
        outputs = super().train_step(batch)
        self.update_metrics(self.train_metrics, batch, self.model(batch[0], training=False))
        return outputs


@pytest.mark.parametrize("cls, warned", [(IdleMetricTrainer, 1), (UpdatedMetricTrainer, 0)])
def test_a_declared_metric_the_step_never_updates_is_one_warning(caplog, cls, warned):
    t = cls(toy.toy_config())
    with caplog.at_level("WARNING"):
        t.fit()
        t.fit()  # a later fit() says nothing again
    lines = [r.getMessage() for r in caplog.records if "not updated in the first" in
             r.getMessage()]
    assert len(lines) == warned, lines
    if warned:
        assert lines[0].startswith("train metric(s) 'accuracy': not updated in the first 10 "
                                   "steps (IdleMetricTrainer.train_step does not update them)")
