"""Example-based regression tests for what the loop properties found, one per bug,
named by the behaviour (the property in test_loop_properties.py may find it again
only by chance; these always check it)."""

from __future__ import annotations

import pytest

from tests import toy
from tests.properties import scenario
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
