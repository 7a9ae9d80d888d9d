"""trainer.step.ema.ExponentialMovingAverage on its own: both forms of the update (one
XLA-compiled function on one replica, three ops per variable) against numpy. The
Trainer-level scenarios (evaluate, resume, export, 2 Mirrored replicas) are in
tests/services/test_training_controls.py."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from trainer.step.ema import ExponentialMovingAverage

DECAY = 0.9


def averaged_run(fused: bool, steps: int = 12):
    """Weights set to random values before every update -> (ema, weights seen, step fn)."""
    rng = np.random.default_rng(0)
    kernel = tf.Variable(rng.normal(size=(5, 3)).astype(np.float32))
    bias = tf.Variable(rng.normal(size=(3,)).astype(np.float32))
    untracked = tf.Variable(np.zeros(3, np.float32))
    ema = ExponentialMovingAverage(DECAY, fused=fused)
    ema.build(tf.distribute.get_strategy(), [kernel, bias])
    seen = [[kernel.numpy(), bias.numpy()]]

    @tf.function(autograph=False)
    def step(new_kernel, new_bias):
        kernel.assign(new_kernel)
        bias.assign(new_bias)
        ema.update([kernel, untracked, bias])  # untracked: no average, ignored

    for _ in range(steps):
        values = [rng.normal(size=(5, 3)).astype(np.float32),
                  rng.normal(size=(3,)).astype(np.float32)]
        step(*values)
        seen.append(values)
    return ema, seen, step


@pytest.mark.parametrize("fused", [True, False])
def test_update_matches_the_numpy_ema(fused):
    ema, seen, _ = averaged_run(fused)
    want = [w.astype(np.float64) for w in seen[0]]  # starts at the built weights
    for weights in seen[1:]:
        want = [DECAY * e + (1 - DECAY) * w for e, w in zip(want, weights)]
    for got, expected in zip(ema.variables, want):
        np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-6)


def xla_compiled_ops(step) -> list[str]:
    """The types of the ops of ``step``'s graph that XLA must compile."""
    graph = step.get_concrete_function(
        tf.TensorSpec((5, 3), tf.float32), tf.TensorSpec((3,), tf.float32)).graph
    found = []
    for op in graph.get_operations():
        try:
            if op.get_attr("_XlaMustCompile"):
                found.append(op.type)
        except ValueError:  # the op has no such attribute
            continue
    return found


def test_one_replica_update_is_one_xla_compiled_call():
    _, _, fused_step = averaged_run(True, steps=1)
    _, _, ops_step = averaged_run(False, steps=1)
    assert len(xla_compiled_ops(fused_step)) == 1
    assert xla_compiled_ops(ops_step) == []


@pytest.mark.parametrize("fused", [True, False])
def test_every_n_updates_moves_by_the_decay_to_the_n_at_multiples_of_the_update_count(fused):
    """optimizer.ema_every_steps=N: after the updates whose count is a multiple of N,
    ema = d^N ema + (1 - d^N) w; between them the average stays."""
    rng = np.random.default_rng(1)
    weight = tf.Variable(rng.normal(size=(4,)).astype(np.float32))
    count = tf.Variable(0, dtype=tf.int64)  # the optimizer's update count
    ema = ExponentialMovingAverage(DECAY, fused=fused, every=3)
    ema.build(tf.distribute.get_strategy(), [weight])
    want = weight.numpy().astype(np.float64)

    @tf.function(autograph=False)
    def step(value):
        weight.assign(value)
        count.assign_add(1)
        ema.update([weight], count)

    for n in range(1, 11):
        value = rng.normal(size=(4,)).astype(np.float32)
        step(value)
        if n % 3 == 0:
            want = DECAY ** 3 * want + (1 - DECAY ** 3) * value
        np.testing.assert_allclose(ema.variables[0].numpy(), want, rtol=0, atol=1e-6)
