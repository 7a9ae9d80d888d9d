"""Distributed numerics: 1, 2 and 4 replicas train to the same weights.

Each scenario runs for 20 optimizer updates in tests/distribution/run_numerics.py, one process per
replica count (virtual CPU devices), next to a negative control that must FAIL the same
comparison: plain Keras behaviour (per-replica clipping, LossScaleOptimizer's
one-replica finiteness check, per-replica loss averaging) or a deliberately wrong
setting (no accumulation).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, subprocess_env
from tests.support.helpers import max_abs_diff

TOL = 1e-5  # float32 runs: max |dw|
FP16_RTOL = 1e-2  # mixed_float16 runs (SGD): max |dw| / max |w|
REPLICAS = (1, 2, 4)


@pytest.fixture(scope="session")
def numerics_runs(tmp_path_factory) -> dict:
    """{n: {"weights": npz dict, "facts": dict, "log": str}} for n in 1, 2, 4."""
    out_dir = tmp_path_factory.mktemp("numerics")
    procs = {
        n: subprocess.Popen(
            [sys.executable, "-m", "tests.distribution.run_numerics", "--replicas", str(n),
             "--out", str(out_dir / f"{n}.npz")],
            cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
        for n in REPLICAS
    }
    runs = {}
    for n, proc in procs.items():
        log, _ = proc.communicate(timeout=1200)
        assert proc.returncode == 0, f"{n}-replica numerics run failed:\n{log[-4000:]}"
        weights = dict(np.load(out_dir / f"{n}.npz"))
        facts = json.loads(str(weights.pop("facts")))
        runs[n] = {"weights": weights, "facts": facts, "log": log}
    return runs


def weights(runs: dict, n: int, run: str) -> list[np.ndarray]:
    saved = runs[n]["weights"]
    keys = sorted((k for k in saved if k.startswith(run + "/")), key=lambda k: int(k.split("/")[1]))
    assert keys, f"no weights saved for {run}"
    return [saved[k] for k in keys]


def relative_diff(a: list, reference: list) -> float:
    return max_abs_diff(a, reference) / max(float(np.max(np.abs(r))) for r in reference)


# ----------------------------------------------------- fp32 + global-norm clipping
@pytest.mark.parametrize("replicas", [2, 4])
def test_global_norm_clipping_same_weights_on_every_replica_count(numerics_runs, replicas):
    assert max_abs_diff(weights(numerics_runs, 1, "clip"),
                    weights(numerics_runs, replicas, "clip")) <= TOL


def test_global_norm_clipping_matches_keras_on_one_replica(numerics_runs):
    # On one replica there is no per-replica question: our clip equals Keras's.
    assert max_abs_diff(weights(numerics_runs, 1, "clip"), weights(numerics_runs, 1, "keras_clip")) <= TOL


@pytest.mark.parametrize("replicas", [2, 4])
def test_negative_control_keras_global_clipnorm_clips_per_replica(numerics_runs, replicas):
    # NEGATIVE CONTROL: Keras clips each replica's gradients before the cross-replica sum.
    assert max_abs_diff(weights(numerics_runs, 1, "keras_clip"),
                    weights(numerics_runs, replicas, "keras_clip")) > 100 * TOL


# ------------------------------------------------------------- accumulation
@pytest.mark.parametrize("replicas", REPLICAS)
def test_accumulation_x4_equals_one_4x_batch(numerics_runs, replicas):
    # 80 micro-batches of 8 with perf.grad_accum_steps=4 == 20 batches of 32 (Adam, so
    # the optimizer's step count must be the number of updates, not of micro-steps).
    assert numerics_runs[replicas]["facts"]["accum/updates"] == 20
    assert max_abs_diff(weights(numerics_runs, 1, "big_batch"),
                    weights(numerics_runs, replicas, "accum")) <= TOL


@pytest.mark.parametrize("replicas", REPLICAS)
def test_negative_control_no_accumulation_differs_from_4x_batch(numerics_runs, replicas):
    # NEGATIVE CONTROL: the same 80 micro-batches without accumulation (80 updates).
    assert max_abs_diff(weights(numerics_runs, 1, "big_batch"),
                    weights(numerics_runs, replicas, "no_accum")) > 100 * TOL


# ------------------------------------- mixed_float16, inf on the LAST replica at step 5
@pytest.mark.parametrize("replicas", REPLICAS)
def test_fp16_inf_on_last_replica_skips_step_everywhere(numerics_runs, replicas):
    facts = numerics_runs[replicas]["facts"]
    assert facts["fp16_inf/unchanged_by_inf_step"]
    assert facts["fp16_inf/replicas_agree_after_inf_step"]
    assert facts["fp16_inf/scale_after"] == facts["fp16_inf/scale_before"] / 2
    assert facts["fp16_inf/skipped_steps"] == 1
    assert facts["fp16_inf/last_skipped_step"] == 5
    assert facts["fp16_inf/updates"] == 19
    assert facts["fp16_inf/finite"] and facts["fp16_inf/replicas_agree"]


@pytest.mark.parametrize("replicas", [2, 4])
def test_fp16_inf_on_last_replica_same_weights_on_every_replica_count(numerics_runs, replicas):
    assert relative_diff(weights(numerics_runs, replicas, "fp16_inf"),
                         weights(numerics_runs, 1, "fp16_inf")) <= FP16_RTOL


@pytest.mark.parametrize("replicas", REPLICAS)
def test_a_users_loss_scale_optimizer_is_taken_apart(numerics_runs, replicas):
    # build_optimizer returns LossScaleOptimizer(SGD) with the framework's step: its inner
    # SGD trains under the framework's scaling (the inf on the last replica skipped
    # everywhere), to the weights of the framework's own scaling, on every replica count.
    facts = numerics_runs[replicas]["facts"]
    assert facts["user_fp16_inf/unchanged_by_inf_step"]
    assert facts["user_fp16_inf/replicas_agree_after_inf_step"]
    assert facts["user_fp16_inf/skipped_steps"] == 1 and facts["user_fp16_inf/updates"] == 19
    assert max_abs_diff(weights(numerics_runs, replicas, "user_fp16_inf"),
                        weights(numerics_runs, replicas, "fp16_inf")) == 0
    assert relative_diff(weights(numerics_runs, replicas, "user_fp16_inf"),
                         weights(numerics_runs, 1, "user_fp16_inf")) <= FP16_RTOL


def test_keras_loss_scale_optimizer_is_right_on_one_replica(numerics_runs):
    # The control is a fair one: with one replica Keras skips the step and halves the scale.
    facts = numerics_runs[1]["facts"]
    assert facts["keras_fp16_inf/unchanged_by_inf_step"]
    assert facts["keras_fp16_inf/scale_after"] == facts["keras_fp16_inf/scale_before"] / 2


@pytest.mark.parametrize("replicas", [2, 4])
def test_negative_control_keras_loss_scale_optimizer_applies_inf_from_last_replica(
        numerics_runs, replicas):
    # NEGATIVE CONTROL: LossScaleOptimizer checks finiteness on replica 0's local gradients,
    # so the inf from the last replica is applied and the scale is not halved.
    facts = numerics_runs[replicas]["facts"]
    assert not facts["keras_fp16_inf/unchanged_by_inf_step"]
    assert facts["keras_fp16_inf/scale_after"] != facts["keras_fp16_inf/scale_before"] / 2
    assert not facts["keras_fp16_inf/finite"]


# ------------------------------------------ float32, inf on the LAST replica at step 5
@pytest.mark.parametrize("replicas", REPLICAS)
def test_fp32_on_nonfinite_skip_skips_step_everywhere(numerics_runs, replicas):
    facts = numerics_runs[replicas]["facts"]
    assert facts["fp32_skip/skipped_steps"] == 1
    assert facts["fp32_skip/updates"] == 19
    assert facts["fp32_skip/finite"] and facts["fp32_skip/replicas_agree"]


@pytest.mark.parametrize("replicas", REPLICAS)
def test_fp32_default_auto_applies_nonfinite_update_identically_everywhere(
        numerics_runs, replicas):
    # "auto" does not check float32 updates (no tf.cond on the step's critical path): the
    # inf reaches the weights, on every replica alike, and nothing is counted as skipped.
    facts = numerics_runs[replicas]["facts"]
    assert facts["fp32_auto/skipped_steps"] == 0
    assert facts["fp32_auto/updates"] == 20
    assert not facts["fp32_auto/finite"] and facts["fp32_auto/replicas_agree"]


# --------------------------------------------------------- on_nonfinite="stop"
@pytest.mark.parametrize("replicas", REPLICAS)
def test_on_nonfinite_stop_raises_naming_the_step_and_keeps_weights(numerics_runs, replicas):
    facts = numerics_runs[replicas]["facts"]
    assert "at step 5" in facts["stop/error"]
    assert facts["stop/step"] == 5
    assert facts["stop/finite"] and facts["stop/replicas_agree"]


# ----------------------------------------------------------- short final batch
@pytest.mark.parametrize("replicas", [2, 4])
def test_uneven_final_batch_same_weights_on_every_replica_count(numerics_runs, replicas):
    # The 20th global batch has 20 examples: 16+4 on 2 replicas, 8+8+4+0 on 4.
    assert numerics_runs[replicas]["facts"]["uneven/updates"] == 20
    assert max_abs_diff(weights(numerics_runs, 1, "uneven"),
                    weights(numerics_runs, replicas, "uneven")) <= TOL


def test_local_average_control_is_right_on_one_replica(numerics_runs):
    assert max_abs_diff(weights(numerics_runs, 1, "uneven"),
                    weights(numerics_runs, 1, "local_average_uneven")) <= TOL


@pytest.mark.parametrize("replicas", [2, 4])
def test_negative_control_local_batch_averaging_wrong_on_short_batch(numerics_runs, replicas):
    # NEGATIVE CONTROL: tf.nn.compute_average_loss without global_batch_size divides by
    # local batch x replicas, which is wrong only on the short final batch.
    assert max_abs_diff(weights(numerics_runs, 1, "uneven"),
                    weights(numerics_runs, replicas, "local_average_uneven")) > 100 * TOL


# ------------------------------------------------------------ jit and recompute
@pytest.mark.parametrize("replicas", REPLICAS)
def test_jit_compile_and_recompute_do_not_change_the_result(numerics_runs, replicas):
    clip = weights(numerics_runs, replicas, "clip")
    assert max_abs_diff(clip, weights(numerics_runs, replicas, "clip_jit")) <= TOL
    assert max_abs_diff(clip, weights(numerics_runs, replicas, "clip_recompute")) <= TOL


def test_jit_compile_used_on_one_replica(numerics_runs):
    assert numerics_runs[1]["facts"]["clip_jit/xla"]
    assert "perf.jit_compile=True is not applied" not in numerics_runs[1]["log"]


@pytest.mark.parametrize("replicas", [2, 4])
def test_jit_compile_falls_back_with_one_log_line_on_mirrored(numerics_runs, replicas):
    log = numerics_runs[replicas]["log"]
    assert log.count("perf.jit_compile=True is not applied under MirroredStrategy") == 1
    assert not numerics_runs[replicas]["facts"]["clip_jit/xla"]
