"""Precision policy, loss-scale state, schedules and perf options (one process, one replica).

The multi-replica comparisons are in tests/distribution/test_replica_count_numerics.py.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support import toy
from trainer import Callback
from trainer import config as config_lib
from trainer import optimizers, precision


@pytest.fixture(autouse=True)
def float32_policy_afterwards():
    """A Trainer sets the global Keras policy; leave float32 for the other tests."""
    yield
    keras.mixed_precision.set_global_policy("float32")


def counter() -> tf.Variable:
    return tf.Variable(0, dtype=tf.int64)


def flat_weights(t) -> np.ndarray:
    return np.concatenate([w.ravel() for w in t.model.get_weights()])


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_float32_and_bfloat16_use_no_loss_scaling(policy):
    state = precision.PrecisionState(policy, 2.0**15, 2000, counter())
    assert not state.dynamic
    assert float(state.scale_loss(tf.constant(3.0))) == 3.0
    grads = [tf.constant([1.5, -2.0])]
    assert state.unscale(grads) is grads


def test_dynamic_scale_halves_on_nonfinite_and_grows_after_growth_interval():
    step = counter()
    state = precision.PrecisionState("mixed_float16", 8.0, 2, step)
    assert float(state.scale_loss(tf.constant(3.0))) == 24.0
    step.assign(6)
    state.on_nonfinite()
    assert float(state.scale.numpy()) == 4.0
    assert int(state.skipped_steps.numpy()) == 1 and int(state.last_skipped_step.numpy()) == 7
    state.on_finite()
    assert float(state.scale.numpy()) == 4.0
    state.on_finite()
    assert float(state.scale.numpy()) == 8.0
    for _ in range(6):
        state.on_nonfinite()
    assert float(state.scale.numpy()) == 1.0  # never below 1


def test_all_finite_sees_inf_and_nan_in_dense_and_sparse_gradients():
    assert bool(precision.all_finite([tf.ones([2]), tf.ones([3])]))
    assert not bool(precision.all_finite([tf.ones([2]), tf.constant([1.0, np.inf])]))
    sparse = tf.IndexedSlices(tf.constant([[np.nan]]), tf.constant([0]), tf.constant([4, 1]))
    assert not bool(precision.all_finite([tf.ones([2]), sparse]))


class DtypeRecordingTrainer(toy.ToyTrainer):
    def compute_loss(self, batch, outputs):
        self.loss_input_dtype = outputs.dtype
        return super().compute_loss(batch, outputs)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_policy_computes_in_low_precision_and_the_loss_sees_float32(policy):
    t = DtypeRecordingTrainer(toy.toy_config(**{"precision.policy": policy,
                                                "train.steps": 5}))
    result = t.fit()
    assert t.model.layers[0].compute_dtype == policy.split("_")[1]
    assert all(w.dtype == np.float32 for w in t.model.get_weights())
    assert t.loss_input_dtype == tf.float32
    assert np.isfinite(result["train/loss"])
    expected_scale = t.config.precision.initial_loss_scale if policy == "mixed_float16" else 1.0
    assert float(t.precision.scale.numpy()) == expected_scale


class CountingLayer(keras.layers.Layer):
    """Identity that counts how often its call is traced."""

    calls = 0

    def call(self, x):
        CountingLayer.calls += 1
        return x


class RecomputeProbeTrainer(toy.ToyTrainer):
    def build_model(self):
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                 CountingLayer(), keras.layers.Dense(3)])


class FirstWeights(Callback):
    """The model's weights as the first train loop starts."""

    def on_fit_start(self, trainer) -> None:
        self.weights = flat_weights(trainer)


def test_recompute_reruns_the_forward_pass_in_the_backward_pass_with_same_result():
    traced, first, weights = {}, {}, {}
    for recompute in (False, True):
        CountingLayer.calls = 0
        first[recompute] = FirstWeights()
        t = RecomputeProbeTrainer(toy.toy_config(**{"perf.recompute": recompute,
                                                    "train.steps": 5}),
                                  callbacks=[first[recompute]])
        t.fit()
        traced[recompute], weights[recompute] = CountingLayer.calls, flat_weights(t)
    assert traced[True] == traced[False] + 1  # once more: the recomputation in backward
    # Both start from the same weights (a failure says whether the start or the steps
    # differ: once in CI the ends were 2.5e-3 apart, never reproduced alone or loaded).
    np.testing.assert_array_equal(first[True].weights, first[False].weights)
    np.testing.assert_allclose(weights[True], weights[False], atol=1e-6)


def test_jit_compile_under_default_strategy_gives_the_same_weights():
    results = {}
    for jit in (False, True):
        t = toy.ToyTrainer(toy.toy_config(**{"perf.jit_compile": jit,
                                             "distribute.strategy": "default"}))
        assert t.steps.jit_compiled == jit
        t.fit()
        results[jit] = flat_weights(t)
    assert np.max(np.abs(results[True] - results[False])) <= 1e-5


def test_accumulation_in_replica_context_path_equals_4x_batch():
    # The default strategy takes the no-merge_call path (as MultiWorker and TPU do).
    adam = {"optimizer.name": "adam", "optimizer.learning_rate": 0.01,
            "distribute.strategy": "default"}
    big = toy.ToyTrainer(toy.toy_config(**adam))
    big.fit()
    accum = toy.ToyTrainer(toy.toy_config(**adam, **{
        "train.global_batch_size": 8, "train.steps": 80, "perf.grad_accum_steps": 4}))
    accum.fit()
    assert int(accum.optimizer.iterations.numpy()) == 20
    assert np.max(np.abs(flat_weights(big) - flat_weights(accum))) <= 1e-5


def test_effective_learning_rate_is_logged_at_start(caplog):
    # absl's own logger level is process-global (earlier tests may leave it at WARNING).
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="absl")
    toy.ToyTrainer(toy.toy_config(**{
        "optimizer.lr_scaling": "linear", "optimizer.reference_batch_size": 64,
        "train.global_batch_size": 16, "train.steps": 40, "perf.grad_accum_steps": 2}))
    line = next(r.getMessage() for r in caplog.records if "learning rate now" in r.getMessage())
    # 0.1 x (16 x 2) / 64
    assert "learning rate now 0.05" in line and "effective batch 16 x 2" in line


def test_linear_scaling_and_schedule_length_count_optimizer_updates():
    config = toy.toy_config(**{"optimizer.lr_scaling": "linear",
                               "optimizer.reference_batch_size": 32,
                               "optimizer.schedule": "cosine", "optimizer.min_learning_rate": 0.01,
                               "train.global_batch_size": 16, "train.steps": 80,
                               "perf.grad_accum_steps": 4})
    assert optimizers.effective_learning_rate(config) == pytest.approx(0.2)
    schedule = optimizers.build_schedule(config)
    assert float(schedule(0)) == pytest.approx(0.2)
    assert float(schedule(20)) == pytest.approx(0.01)  # 80 micro-steps = 20 updates


def test_warmup_schedule_starts_at_zero_and_reaches_peak():
    config = toy.toy_config(**{"optimizer.schedule": "warmup_cosine",
                               "optimizer.warmup_steps": 4})
    schedule = optimizers.build_schedule(config)
    assert float(schedule(0)) == 0.0
    assert float(schedule(4)) == pytest.approx(0.1)


@pytest.mark.parametrize("field", ["train.steps", "checkpoint.every_steps"])
def test_step_counts_must_be_multiples_of_accumulation(field):
    config = toy.toy_config(**{"perf.grad_accum_steps": 4, "train.steps": 80,
                               "checkpoint.every_steps": 40})
    section, name = field.split(".")
    config[section][name] = 42
    with pytest.raises(config_lib.ConfigError, match=f"{field}=42 is not a multiple"):
        config_lib.validate(config)


@pytest.mark.parametrize("mode, dynamic, checks, stops, rolls_back, warns", [
    ("auto", False, False, False, False, False),
    ("auto", True, True, False, False, False),
    ("skip", False, True, False, False, False),
    ("stop", False, True, True, False, False),
    ("stop", True, True, True, False, True),
    ("rollback", False, True, False, True, False),
])
def test_on_nonfinite_means_one_thing_everywhere(mode, dynamic, checks, stops, rolls_back, warns):
    """train.on_nonfinite is read in one place: what the gradient path checks, what the
    non-finite guard does, and the start-up warning all come from precision.NonFinitePolicy."""
    policy = precision.NonFinitePolicy(mode, dynamic)
    assert (policy.checks_updates, policy.stops, policy.rolls_back) == (checks, stops, rolls_back)
    assert (policy.warning() is not None) == warns


FLOAT16_WARNING = ("precision.policy='mixed_float16' on CPU, without fast float16: it runs "
                   "slower than float32 there, not faster (python -m benchmarks.speed.precision "
                   "measures it); set precision.policy='float32' "
                   "(--config.precision.policy=float32).")


@pytest.mark.parametrize("policy, warnings", [
    ("mixed_float16", [FLOAT16_WARNING]), ("float32", []), ("mixed_bfloat16", [])])
def test_float16_on_a_cpu_warns_once_with_the_policy_to_use(policy, warnings, caplog):
    caplog.set_level(logging.WARNING, logger="absl")
    t = toy.ToyTrainer(toy.toy_config(**{"precision.policy": policy, "train.steps": 10}))
    t.fit()
    t.config.train.steps = 20
    t.fit()  # a second fit (a notebook's re-run) says nothing new
    said = [r.getMessage() for r in caplog.records if "float16" in r.getMessage()]
    assert said == warnings


@pytest.mark.parametrize("devices, expected", [
    ([], None),
    (["TPU:0", "TPU:1"], "set precision.policy='mixed_bfloat16'"),
    (["GPU:0 (compute capability 6.1)"], "on GPU:0 (compute capability 6.1), without fast "
                                         "float16"),
])
def test_float16_warning_names_the_devices_and_their_half_type(devices, expected):
    warning = precision.float16_warning("mixed_float16", devices)
    assert warning is None if expected is None else expected in warning
    assert precision.float16_warning("mixed_bfloat16", devices or ["CPU"]) is None


class UserLossScaleTrainer(toy.ToyTrainer):
    """build_optimizer returns what TensorFlow's mixed-precision guide teaches."""

    def build_optimizer(self):
        return keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.05), initial_scale=1024.0, dynamic_growth_steps=3)


@pytest.mark.parametrize("policy", ["mixed_float16", "float32"])
def test_a_users_loss_scale_optimizer_is_taken_apart_with_one_info_line(policy, caplog):
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="absl")
    config = toy.toy_config(**{"precision.policy": policy, "train.steps": 12,
                               "train.steps_per_loop": 4, "telemetry.progress": "off"})
    t = UserLossScaleTrainer(config)
    assert type(t.optimizer) is keras.optimizers.SGD  # the inner optimizer trains
    said = [r.getMessage() for r in caplog.records if "LossScaleOptimizer" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    assert said[0].startswith("UserLossScaleTrainer.build_optimizer returned a "
                              "LossScaleOptimizer: training with its inner SGD; ")
    if policy == "mixed_float16":  # its settings are the framework's loss scaling
        assert "initial_scale=1024 and dynamic_growth_steps=3 become" in said[0]
        assert float(t.precision.scale.numpy()) == 1024.0
        t.fit()  # 12 finite updates: doubled every 3
        assert t.precision.counters() == (0, 1024.0 * 2 ** 4)
    else:
        assert "precision.policy='float32' scales no loss" in said[0]
        assert float(t.precision.scale.numpy()) == 1.0


def test_a_users_loss_scale_optimizer_trains_as_the_framework_scaling_alone():
    # The case: the update was divided by a second scale (the loss rose). Taken
    # apart, LossScaleOptimizer(SGD) trains to exactly the weights of SGD with the same
    # settings as precision.initial_loss_scale / growth_interval.
    overrides = {"precision.policy": "mixed_float16", "train.steps": 12,
                 "telemetry.progress": "off", "optimizer.learning_rate": 0.05,
                 "optimizer.momentum": 0.0, "precision.initial_loss_scale": 1024.0,
                 "precision.growth_interval": 3}
    wrapped = UserLossScaleTrainer(toy.toy_config(**overrides))
    wrapped.fit()
    plain = toy.ToyTrainer(toy.toy_config(**overrides))
    plain.fit()
    for a, b in zip(wrapped.model.get_weights(), plain.model.get_weights()):
        np.testing.assert_array_equal(a, b)
