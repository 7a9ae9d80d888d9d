"""Training controls on callbacks and the gradient path: EMA of the weights, early
stopping, rollback after a blow-up, no checkpoint with non-finite weights, and the
learning rate / gradient norm in the logs. Multi-replica scenarios run in
tests/support/run_controls.py, one process per replica count, with the same assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.support import toy
from tests.support.helpers import REPO, run_in_parallel, subprocess_env
from tests.support.run_callbacks import CallbackTrainer, get_config
from trainer import optimizers
from trainer.checkpoint.storage.reader import read_manifest
from trainer.config import ConfigError, validate


@pytest.fixture(scope="session")
def control_runs(tmp_path_factory) -> dict:
    """tests.support.run_controls on 1 and 2 replicas (in parallel): {replicas: results}."""
    root = tmp_path_factory.mktemp("controls")
    for n in (1, 2):
        (root / str(n)).mkdir()
    run_in_parallel({n: [sys.executable, "-m", "tests.support.run_controls", "--replicas", str(n),
                         "--workdir", str(root / str(n)), "--out", str(root / f"{n}.json")]
                     for n in (1, 2)})
    return {n: json.loads((root / f"{n}.json").read_text()) for n in (1, 2)}


# ------------------------------------------------------------------------- EMA
@pytest.mark.parametrize("replicas", [1, 2])
def test_evaluate_uses_the_documented_ema_of_the_weights(control_runs, replicas):
    run = control_runs[replicas]
    assert run["ema_vars_vs_numpy"] <= 1e-6  # ema = d*ema + (1-d)*w after every update
    assert abs(run["ema_evaluate"] - run["ema_numpy_loss"]) <= 1e-5
    assert abs(run["ema_evaluate"] - run["raw_numpy_loss"]) > 1e-3  # not the raw weights
    assert run["raw_after_evaluate"] == 0.0  # the model holds the raw weights again


def ema_config(**overrides):
    return toy.toy_config(**{"optimizer.ema_decay": 0.9, "optimizer.name": "adam",
                             "optimizer.learning_rate": 0.05, "checkpoint.every_steps": 10,
                             **overrides})


@pytest.mark.parametrize("every", [1, 3])
def test_resume_gives_bit_identical_ema(tmp_path, every):
    """Also when the EMA moves every 3 updates and the checkpoint (step 10) falls
    between two moves: the schedule follows the optimizer's checkpointed update count."""
    config = {"optimizer.ema_every_steps": every}
    whole = toy.ToyTrainer(ema_config(**config), str(tmp_path / "whole"))
    whole.fit()
    first = toy.ToyTrainer(ema_config(**config, **{"train.steps": 10}), str(tmp_path / "split"))
    first.fit()
    resumed = toy.ToyTrainer(ema_config(**config), str(tmp_path / "split"))
    resumed.fit()
    assert resumed.step == 20
    for got, want in zip(resumed.ema.variables, whole.ema.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    if every > 1:  # the option changes the average (a sampled, not a per-update, EMA)
        per_update = toy.ToyTrainer(ema_config())
        per_update.fit()
        assert not np.allclose(per_update.ema.variables[0].numpy(),
                               whole.ema.variables[0].numpy(), atol=1e-7)


def test_export_holds_the_ema_weights(tmp_path):
    trainer = toy.ToyTrainer(ema_config())
    trainer.fit()
    trainer.export(str(tmp_path / "exported"))
    x = toy.toy_data(4)[0]
    loaded = tf.saved_model.load(str(tmp_path / "exported"))
    served = loaded.serve(x).numpy()
    averaged = trainer.build_model()
    averaged.set_weights([v.numpy() for v in trainer.ema.variables])
    np.testing.assert_allclose(served, averaged(x).numpy(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(served, trainer.model(x).numpy(), atol=1e-4)


# -------------------------------------------------------------------- rollback
@pytest.mark.parametrize("replicas", [1, 2])
def test_rollback_skips_the_poisoned_window_and_finishes_finite(control_runs, replicas):
    run = control_runs[replicas]
    assert run["rollback_final_step"] == 30 and run["rollback_finite"]
    assert [(r["step"], r["from_step"]) for r in run["rollback_records"]] == [(10, 15)]


@pytest.mark.parametrize("replicas", [1, 2])
def test_nan_weights_are_never_checkpointed(control_runs, replicas):
    run = control_runs[replicas]
    assert "NaN/inf at step 15" in run["auto_error"] and "last good checkpoint is step 10" in (
        run["auto_error"])
    assert run["auto_steps"] == [5, 10] and all(run["auto_restored_finite"])


# --------------------------------------------------------------- early stopping
EARLY = {"optimizer.learning_rate": 0.0, "train.steps": 100, "eval.every_steps": 5,
         "checkpoint.every_steps": 0, "train.early_stopping.metric": "eval/loss",
         "train.early_stopping.patience": 2}


def early_config(**overrides):
    config = get_config()
    config.distribute.strategy = "one_device"
    config.update_from_flattened_dict({**EARLY, **overrides})
    return config


def _eval_steps(workdir, task: str = "local-0") -> list[int]:
    calls = json.loads((workdir / f"hooks-{task}.json").read_text())
    return [step for name, step, _ in calls if name == "on_eval_end"]


def test_early_stopping_stops_after_patience_plus_one_evals(tmp_path):
    trainer = CallbackTrainer(early_config(), str(tmp_path))
    trainer.fit()
    assert _eval_steps(tmp_path) == [5, 10, 15]
    assert trainer.step == 15 and "best" in trainer.driver.stopped_by
    assert os.listdir(tmp_path / "checkpoints") == ["15"]


def test_early_stopping_resumes_its_judgement_from_the_checkpoint(tmp_path):
    """Interrupted at step 10 (2 evaluations without improvement after the best at 5):
    the resumed run stops at its first evaluation, 15, as the uninterrupted one does
    (a fresh judgement would run to 25)."""
    first = CallbackTrainer(early_config(**{"train.steps": 10}), str(tmp_path))
    first.fit()
    assert _eval_steps(tmp_path) == [5, 10] and first.driver.stopped_by is None
    saved = read_manifest(str(tmp_path / "checkpoints" / "10"))["services"]["early_stopping"]
    assert saved["best_step"] == 5 and saved["since_best"] == 2
    resumed = CallbackTrainer(early_config(), str(tmp_path))
    resumed.fit()
    assert _eval_steps(tmp_path) == [15]
    assert resumed.step == 15 and "at step 5" in resumed.driver.stopped_by
    # Judged the other way: the saved judgement is not taken; a fresh one runs 3 evals.
    other = CallbackTrainer(early_config(**{"train.early_stopping.mode": "max",
                                            "train.steps": 200}), str(tmp_path))
    other.fit()
    assert _eval_steps(tmp_path) == [20, 25, 30]


def test_early_stopping_on_two_workers_stops_both_at_the_same_step(tmp_path):
    """Two real workers, interrupted at step 10 and relaunched: both stop at 15, where
    the uninterrupted run stops (the chief's saved judgement reaches both)."""
    for steps, evals in ((10, [5, 10]), (100, [15])):
        flags = [f"--config.{k}={v}" for k, v in {**EARLY, "train.steps": steps}.items()]
        run = subprocess.run(
            [sys.executable, "-m", "launch.multiworker", "--workers", "2",
             f"--config={REPO / 'tests' / 'support' / 'run_callbacks.py'}", f"--workdir={tmp_path}",
             *flags], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
            timeout=400)
        assert run.returncode == 0, run.stderr[-4000:]
        for task in ("worker-0", "worker-1"):
            assert _eval_steps(tmp_path, task) == evals
            calls = json.loads((tmp_path / f"hooks-{task}.json").read_text())
            assert calls[-1][:2] == ["on_fit_end", min(steps, 15)]


def test_early_stopping_metric_that_eval_does_not_produce_names_the_ones_it_does():
    config = toy.toy_config(**{"eval.every_steps": 10})
    config.train.early_stopping.metric = "eval/acuracy"
    with pytest.raises(ConfigError, match=r"eval/acuracy.*eval/accuracy, eval/loss"):
        toy.ToyEvalTrainer(config).fit()


@pytest.mark.parametrize("field, value", [("metric", "accuracy"), ("mode", "up"),
                                          ("patience", -1), ("min_delta", -0.1)])
def test_early_stopping_config_is_checked(field, value):
    config = toy.toy_config()
    config.train.early_stopping[field] = value
    with pytest.raises(ConfigError, match=f"train.early_stopping.{field}"):
        validate(config)


def test_unknown_key_inside_a_nested_section_is_named():
    config = toy.toy_config()
    config.train.early_stopping.patiense = 3
    with pytest.raises(ConfigError, match=r"train\.early_stopping\.patiense.*'patience'"):
        validate(config)


# ------------------------------------------------------------------------ logs
def _train_records(workdir) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def test_grad_norm_is_the_mean_over_the_window_of_the_sampled_updates(tmp_path):
    """Logging does not change training, so the per-step norms of a run logging every
    step are the truth: every update's norm averaged (grad_norm_every=1), or the norm of
    every 4th update (the window's updates 1 and 5, iterations 0, 4, 8, ...)."""
    runs = {"per_step": dict(log=1, every=1), "exact": dict(log=8, every=1),
            "sampled": dict(log=8, every=4)}
    norms = {}
    for name, run in runs.items():
        workdir = tmp_path / name
        config = toy.toy_config(**{"train.steps": 24, "train.log_every_steps": run["log"],
                                   "telemetry.grad_norm_every": run["every"]})
        toy.ToyTrainer(config, str(workdir)).fit()
        norms[name] = [r["train/grad_norm"] for r in _train_records(workdir)]
    truth = np.asarray(norms["per_step"]).reshape(3, 8)
    np.testing.assert_allclose(norms["exact"], truth.mean(axis=1), rtol=1e-5)
    np.testing.assert_allclose(norms["sampled"], truth[:, [0, 4]].mean(axis=1), rtol=1e-5)
    assert not np.allclose(norms["sampled"], norms["exact"], rtol=1e-3)


def test_logged_learning_rate_follows_the_schedule_and_grad_norm_is_before_clipping(tmp_path):
    config = toy.toy_config(**{"train.steps": 40, "train.log_every_steps": 5,
                               "optimizer.schedule": "warmup_cosine",
                               "optimizer.warmup_steps": 10, "optimizer.clipnorm": 0.01})
    toy.ToyTrainer(config, str(tmp_path)).fit()
    train = _train_records(tmp_path)
    schedule = optimizers.build_schedule(config)
    for record in train:
        want = float(schedule(record["step"]))
        assert record["train/learning_rate"] == pytest.approx(want, rel=1e-5, abs=1e-7)
    norms = [r["train/grad_norm"] for r in train]
    assert all(np.isfinite(norms)) and min(norms) > 0.01  # clipping acted on every step
