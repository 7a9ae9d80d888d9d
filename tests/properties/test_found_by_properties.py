"""Example-based regression tests for what the loop properties found, one per bug,
named by the behaviour (the property in test_loop_properties.py may find it again
only by chance; these always check it)."""

from __future__ import annotations

import pytest

from tests.support import toy
from tests.properties import scenario
from tests.properties.strategies import Case
from trainer.config import ConfigError


def _early_stopping_config(metric: str):
    config = toy.toy_config(**{"train.steps": 4, "eval.every_steps": 2})
    config.telemetry.progress = "off"
    config.train.early_stopping.metric = metric
    return config


def test_early_stopping_without_an_eval_dataset_is_a_config_error_before_any_step(tmp_path):
    watch = scenario.LoopWatch()
    trainer = toy.ToyTrainer(_early_stopping_config("eval/loss"), str(tmp_path),
                             callbacks=[watch])
    with pytest.raises(ConfigError, match=r"early_stopping\.metric.*no eval dataset"):
        trainer.fit()
    assert watch.loop_ends == [] and trainer.step == 0


def test_early_stopping_metric_that_eval_does_not_produce_fails_before_any_step(tmp_path):
    watch = scenario.LoopWatch()
    trainer = toy.ToyEvalTrainer(_early_stopping_config("eval/acuracy"), str(tmp_path),
                                 callbacks=[watch])
    with pytest.raises(ConfigError, match=r"eval/acuracy.*eval/accuracy, eval/loss"):
        trainer.fit()
    assert watch.loop_ends == [] and trainer.step == 0


def test_a_rollback_does_not_evaluate_the_restored_step_again(tmp_path):
    """The poisoned loop ends at 8, the run rolls back to the checkpoint of step 4,
    which was evaluated when first reached: no second eval record of step 4, and early
    stopping (patience 1) does not count the restored step as an evaluation without
    improvement (it stopped the run at step 4). The toy's eval loss rises from
    evaluation to evaluation here, so mode "max" makes each one an improvement."""
    case = Case({"train.steps": 12, "train.steps_per_loop": 2, "train.log_every_steps": 4,
                 "eval.every_steps": 4, "checkpoint.every_steps": 4,
                 "checkpoint.async_save": False, "train.on_nonfinite": "rollback",
                 "train.early_stopping.metric": "eval/loss",
                 "train.early_stopping.mode": "max", "train.early_stopping.patience": 1},
                poison_step=6)
    outcome = scenario.fit(case, str(tmp_path))
    assert outcome.error is None and outcome.step == 12
    kinds = [(r["kind"], r["step"]) for r in scenario.records(str(tmp_path))
             if r["kind"] in ("eval", "rollback")]
    assert kinds == [("eval", 4), ("rollback", 4), ("eval", 8), ("eval", 12)]


# ---------------------------------------------- found by test_model_properties.py


def _regularized_before_sync_bn(adds_loss: dict) -> dict:
    """Dense(6, tanh) + ``adds_loss`` + BatchNormalization(synchronized=True) + a
    3-class head over 3 float features, 3 Adam steps on a global batch of 16."""
    from tests.properties import model_specs

    dense = {"layer": "dense", "units": 6, "activation": "tanh", "use_bias": True,
             "trainable": True, "kernel_regularizer": None, "activity_regularizer": None}
    trunk = [dense, {"layer": "batch_norm", "momentum": 0.5, "center": True, "scale": True}]
    if adds_loss["layer"] == "dense":
        dense["activity_regularizer"] = adds_loss["activity_regularizer"]
    else:
        trunk.insert(1, adds_loss)
    return model_specs.normalized({
        "seed": 7, "inputs": [{"kind": "dense", "width": 3, "dtype": "float32", "units": 0}],
        "dict_inputs": False, "trunk": trunk, "heads": [{"kind": "class", "classes": 3}],
        "dict_outputs": False,
        "train": {"global_batch": 16, "steps": 3, "steps_per_loop": 1, "learning_rate": 0.01,
                  "sparse_reduce": "auto"}})


# Found by test_model_properties.py: Keras keeps the losses a forward pass adds in one
# list per layer, and Mirrored replicas run in threads that take turns at the batch
# norm's all-reduce, so replica 1 replaced replica 0's entry before replica 0 read
# model.losses (3 Adam steps: the Dense bias 7e-3 / 1.5e-2 relative off). Fixed by
# trainer.runtime.keras_compat.losses_per_replica.
@pytest.mark.parametrize("adds_loss", [
    {"layer": "dense", "activity_regularizer": {"l1": 0.001, "l2": 0.0}},
    {"layer": "add_loss", "coef": 0.01}], ids=["activity_regularizer", "add_loss"])
def test_a_loss_added_before_a_synchronized_batch_norm_counts_on_every_replica(
        spec_workers, adds_loss):
    from tests.properties.run_spec_worker import differences, train_on_every_replica_count
    from tests.support.families import TOL

    runs = train_on_every_replica_count(spec_workers, _regularized_before_sync_bn(adds_loss))
    diffs = differences(runs, 2)
    assert max(diffs.values()) <= TOL, diffs
