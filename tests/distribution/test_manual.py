"""Manual data parallelism (distribute.strategy="manual"): uneven splits, exact updates.

Training runs happen in subprocesses (tests/distribution/run_manual.py), one device layout each:
3 virtual CPU devices (weights 1, 2, 1 against one device on the whole batch), 2
(weights 1, 1 against a 2-replica Mirrored run), and a placement-log run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from tests.conftest import REPO, subprocess_env
from tests.support.helpers import max_abs_diff, saved_run
from trainer import config as config_lib
from trainer.distribution.data_parallel import split_sizes

TOL = 1e-5
MIXED_TOL = 1e-3  # float16 sums over 8/16/8 examples round differently from one sum of 32
DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(3)]


@pytest.fixture(scope="module")
def manual_runs(tmp_path_factory) -> dict:
    """{3: npz, 2: npz, "placement_log": stdout} from one process per device layout."""
    out_dir = tmp_path_factory.mktemp("manual")
    commands = {
        3: ["--devices", "3", "--out", str(out_dir / "3.npz")],
        2: ["--devices", "2", "--out", str(out_dir / "2.npz")],
        "placement_log": ["--devices", "3", "--log_placement"],
    }
    procs = {
        key: subprocess.Popen([sys.executable, "-m", "tests.distribution.run_manual", *args], cwd=REPO,
                              env=subprocess_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        for key, args in commands.items()
    }
    results = {}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"run_manual {commands[key]} failed:\n{stderr[-4000:]}"
        results[key] = stdout if key == "placement_log" else dict(np.load(out_dir / f"{key}.npz"))
    return results


# ------------------------------------------------------------------ the split
def test_split_is_proportional_and_sums_to_the_batch():
    assert split_sizes(32, [1, 2, 1]) == [8, 16, 8]
    assert split_sizes(32, [1, 1.5, 2.5]) == [6, 10, 16]
    for batch in (3, 7, 32, 33, 1000):
        for weights in ([1, 1], [1, 2, 1], [0.3, 0.3, 0.4], [5, 1, 1, 1]):
            sizes = split_sizes(batch, weights)
            assert sum(sizes) == batch
            shares = [batch * w / sum(weights) for w in weights]
            assert all(abs(n - s) < 1 for n, s in zip(sizes, shares))


# ------------------------------------------------------------ equivalence
@pytest.mark.parametrize("scenario", ["sgd", "adam", "accum", "custom", "jit", "stateful"])
def test_uneven_split_trains_like_one_device_on_the_whole_batch(manual_runs, scenario):
    # 20 steps, weights (1, 2, 1): slices of 8/16/8 examples on 3 devices, one update.
    # accum: perf.grad_accum_steps=2; custom: a user train_step calling apply_gradients;
    # jit: perf.jit_compile=True (XLA on one device, not applied on three); stateful: a
    # running mean updated (and read) in the forward pass, its state among the weights.
    run = manual_runs[3]
    assert max_abs_diff(saved_run(run, f"single_{scenario}"), saved_run(run, f"manual_{scenario}")) <= TOL
    single = json.loads(str(run[f"single_{scenario}_results"]))
    manual = json.loads(str(run[f"manual_{scenario}_results"]))
    assert single.keys() == manual.keys()
    for key in single:  # the logged loss (and custom outputs) are global means too
        assert abs(single[key] - manual[key]) <= TOL


def test_mixed_precision_and_clipping_use_one_loss_scale(manual_runs):
    run = manual_runs[3]
    assert run["manual_mixed_clip_loss_scale"] == run["single_mixed_clip_loss_scale"] == 2.0**15
    assert max_abs_diff(saved_run(run, "single_mixed_clip"), saved_run(run, "manual_mixed_clip")) <= MIXED_TOL


def test_float_weights_split_whole_examples_and_train_the_same(manual_runs):
    run = manual_runs[3]
    assert list(run["float_weights_split"]) == [6, 10, 16]
    assert max_abs_diff(saved_run(run, "single_sgd"), saved_run(run, "manual_float_weights")) <= TOL


def test_negative_control_per_device_mean_gradients_differ(manual_runs):
    # Averaging each device's MEAN gradient with equal weights over-weights the 8-example
    # slices: the same comparison as above must fail, by far more than the tolerances.
    diff = max_abs_diff(saved_run(manual_runs[3], "single_sgd"), saved_run(manual_runs[3], "manual_per_device_mean"))
    assert diff > 1000 * TOL and diff > 10 * MIXED_TOL


def test_even_split_trains_like_mirrored(manual_runs):
    run = manual_runs[2]
    for scenario in ("sgd", "adam"):
        assert max_abs_diff(saved_run(run, f"mirrored_{scenario}"), saved_run(run, f"manual_{scenario}")) <= TOL


def test_runs_actually_trained(manual_runs):
    run = manual_runs[3]
    assert max_abs_diff(saved_run(run, "single_sgd"), saved_run(run, "single_adam")) > 1e-3


# ------------------------------------------------------ loop features
def test_checkpoint_resume_continues_exactly(manual_runs):
    run = manual_runs[3]
    assert int(run["resumed_from"]) == 20
    assert max_abs_diff(saved_run(run, "manual_sgd"), saved_run(run, "manual_resumed")) <= TOL


def test_nonfinite_loss_on_one_device_skips_the_step_for_all(manual_runs):
    run = manual_runs[3]
    assert int(run["inf_skipped"]) == 1
    assert int(run["inf_last_skipped"]) == 5
    assert float(run["inf_loss_scale"]) == 2.0**14
    assert bool(run["inf_finite_weights"])


def test_evaluate_with_short_last_batch_matches_one_device(manual_runs):
    single = json.loads(str(manual_runs[3]["single_eval"]))
    manual = json.loads(str(manual_runs[3]["manual_eval"]))
    assert single.keys() == manual.keys() == {"loss", "accuracy"}
    for key in single:
        assert abs(single[key] - manual[key]) <= TOL


# -------------------------------------------------------------- placement
def test_each_device_runs_forward_and_backward_and_the_first_applies(manual_runs):
    placement = json.loads(str(manual_runs[3]["placement"]))
    for device in DEVICES:
        assert {"MatMul", "TanhGrad", "BiasAddGrad"} <= set(placement[device]), device
    assert {"If", "IsFinite"} <= set(placement[DEVICES[0]])  # the one checked update
    assert not {"If", "IsFinite"} & (set(placement[DEVICES[1]]) | set(placement[DEVICES[2]]))


def test_placement_log_shows_every_device(manual_runs):
    log = manual_runs["placement_log"]
    matmuls = Counter(m.group(1) for m in re.finditer(r"\(MatMul\): (\S+)", log))
    assert set(matmuls) == set(DEVICES)
    assert len(set(matmuls.values())) == 1  # the same forward/backward on each device


def test_measure_suggests_one_weight_per_device(manual_runs):
    measured = json.loads(str(manual_runs[3]["measure"]))
    assert [m["device"] for m in measured] == [f"/device:CPU:{i}" for i in range(3)]
    assert all(m["examples_per_s"] > 0 and m["suggested_weight"] >= 1 for m in measured)
    assert min(m["suggested_weight"] for m in measured) == 1


# ------------------------------------------------------------------ errors
def _manual_config(**distribute):
    config = config_lib.get_config()
    config.distribute.strategy = "manual"
    for key, value in distribute.items():
        config.distribute[key] = value
    return config


@pytest.mark.parametrize("weights, message", [
    ((1, -2, 1), "must be >= 0"),
    ((0, 0), "positive sum"),
    ((1, 2, 1), "3 weights for 2"),
    (("fast", "slow"), "list of numbers"),
])
def test_invalid_weights_are_rejected_with_the_fix(weights, message):
    config = _manual_config(devices=("/cpu:0", "/cpu:1"), device_weights=weights)
    with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
        config_lib.validate(config)


def test_weights_without_manual_strategy_are_rejected():
    config = config_lib.get_config()
    config.distribute.device_weights = (1, 1)
    with pytest.raises(config_lib.ConfigError, match="only used by distribute.strategy='manual'"):
        config_lib.validate(config)


@pytest.mark.parametrize("case, message", [
    ("zero_split", "gives /device:CPU:1 0 of the 2 examples"),
    ("length_default_devices", "2 weights for 3 devices"),
    ("missing_device", "'/gpu:0' is not a device of this process"),
    ("missing_index", "'/cpu:7' is not a device of this process"),
    ("duplicate_device", "lists /device:CPU:1 twice"),
    ("sync_batch_norm", "all_reduce (the step's own, or a BatchNormalization(synchronized="
                        "True)'s, which distribute.sync_batch_norm=True makes of every one"),
])
def test_device_errors_name_the_problem(manual_runs, case, message):
    error = str(manual_runs[3][f"error_{case}"])
    assert error.startswith("ConfigError: ") and message in error, error
    assert "\n" not in error, error
