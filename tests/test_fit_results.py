"""``fit()`` returns the same keys every time: a finished run fitted again (the same
Trainer, or a new one on its workdir: a notebook cell run again) returns its last train
values with the evaluation, not the evaluation alone."""

from __future__ import annotations

from tests.support import toy

KEYS = {"train/loss", "train/accuracy", "eval/loss", "eval/accuracy"}


def eval_config(**overrides):
    return toy.toy_config(**{"eval.every_steps": 10, **overrides})


def test_a_finished_trainer_fitted_again_returns_its_last_train_values(tmp_path):
    t = toy.ToyEvalTrainer(eval_config(), str(tmp_path))
    first = t.fit()
    again = t.fit()
    assert set(first) == set(again) == KEYS
    assert again["train/loss"] == first["train/loss"]
    assert again["train/accuracy"] == first["train/accuracy"]


def test_a_new_trainer_on_a_finished_workdir_returns_the_checkpointed_train_values(tmp_path):
    first = toy.ToyEvalTrainer(eval_config(), str(tmp_path)).fit()
    again = toy.ToyEvalTrainer(eval_config(), str(tmp_path)).fit()
    assert set(again) == KEYS
    assert again["train/loss"] == first["train/loss"]
    assert again["eval/loss"] == first["eval/loss"]


def test_a_resumed_run_returns_what_it_trained_itself(tmp_path):
    # Values restored from the checkpoint are replaced by the ones the fit logs.
    first = toy.ToyEvalTrainer(eval_config(), str(tmp_path)).fit()
    longer = toy.ToyEvalTrainer(eval_config(**{"train.steps": 30}), str(tmp_path))
    results = longer.fit()
    assert longer.step == 30 and set(results) == KEYS
    assert results["train/loss"] != first["train/loss"]
