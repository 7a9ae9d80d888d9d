"""config.sweep.space and the sweep section: what parses, and every mistake in one line
(a ConfigError naming the string), checked against the digits demo's config; and the
study's heartbeat of a trial that finished meanwhile."""

from __future__ import annotations

import optuna
import pytest

from models.configs import digits_sweep
from trainer.config import ConfigError
from trainer.sweep import settings, space
from trainer.sweep import study as study_lib


@pytest.fixture
def config():
    return digits_sweep.get_config()


def test_the_four_distributions_parse_and_sample_within_their_ranges(config):
    dims = space.parse_space(("optimizer.learning_rate=log(1e-4, 3e-2)",
                              "optimizer.weight_decay=float(0, 0.1)",
                              "model.hidden=int(16, 128)",
                              "optimizer.name = choice(adam, 'sgd')"), config)
    assert [(d.key, d.dist) for d in dims] == [
        ("optimizer.learning_rate", "log"), ("optimizer.weight_decay", "float"),
        ("model.hidden", "int"), ("optimizer.name", "choice")]
    assert dims[3].args == ("adam", "sgd")
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()
    values = space.sampler(dims, None, config, "cfg.py")(trial)
    assert 1e-4 <= values["optimizer.learning_rate"] <= 3e-2
    assert 0 <= values["optimizer.weight_decay"] <= 0.1
    assert isinstance(values["model.hidden"], int) and 16 <= values["model.hidden"] <= 128
    assert values["optimizer.name"] in ("adam", "sgd")
    assert space.override("optimizer.name", "sgd") == "--config.optimizer.name=sgd"
    assert space.override("model.hidden", 64) == "--config.model.hidden=64"


@pytest.mark.parametrize("text, says", [
    ("optimizer.learnin_rate=log(1e-4, 1e-2)",
     "config.optimizer has no field 'learnin_rate'"),
    ("optimizer.learning_rate=uniform(0, 1)", "unknown distribution 'uniform'"),
    ("optimizer.learning_rate=float(0.1, 0.01)", "the range [0.1, 0.01] is empty"),
    ("model.hidden=int(64, 64)", "the range [64, 64] is empty"),
    ("optimizer.learning_rate=log(0, 0.1)", "log(0, 0.1) needs 0 < lo"),
    ("model.hidden=int(1.5, 8)", "int(1.5, 8) needs integer bounds"),
    ("train.steps=float(10, 100)", "the field is an integer"),
    ("train.global_batch_size=choice(32, 'big')", "'big' (str) cannot be set on it"),
    ("model.hidden=choice(64)", "choice() needs at least two values"),
    ("optimizer.learning_rate=log(1e-4)", "log() takes two numbers"),
    ("optimizer.learning_rate", "is not of the form 'KEY=DIST(ARGS)'"),
    ("optimizer=choice(1, 2)", "config.optimizer is a section"),
])
def test_each_bad_string_is_one_line_naming_it(config, text, says):
    with pytest.raises(ConfigError) as raised:
        space.parse_space((text,), config)
    message = str(raised.value)
    assert says in message and repr(text) in message and "\n" not in message


def test_a_key_swept_twice_is_refused(config):
    with pytest.raises(ConfigError, match="names model.hidden more than once"):
        space.parse_space(("model.hidden=choice(32, 64)", "model.hidden=int(8, 16)"), config)


def test_what_search_space_returns_is_checked_against_the_config(config):
    with pytest.raises(ConfigError, match="config.model has no field 'hiden'"):
        space.check_sampled({"model.hiden": 3}, config, "search_space(trial) of cfg.py")
    with pytest.raises(ConfigError, match="must return a non-empty dict"):
        space.check_sampled(None, config, "search_space(trial) of cfg.py")
    assert space.check_sampled({"model.hidden": 32}, config, "x") == {"model.hidden": 32}


@pytest.mark.parametrize("field, value, says", [
    ("metric", "", "config.sweep.metric is empty"),
    ("metric", "accuracy", "must name a value a run reports"),
    ("direction", "up", "config.sweep.direction='up' is not one of"),
    ("pruner", "random", "config.sweep.pruner='random' is not one of"),
    ("pruner_startup_trials", -1, "config.sweep.pruner_startup_trials=-1 must be a non-neg"),
    ("trial", 3, "are set by the sweep on each trial's command"),
    ("max_retries", -1, "config.sweep.max_retries=-1 must be a non-negative integer"),
])
def test_each_wrong_value_of_the_sweep_section_is_one_line(config, field, value, says):
    config.sweep[field] = value
    with pytest.raises(ConfigError) as raised:
        settings.check_section(config, None, "cfg.py")
    assert says in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("field, value, says", [
    ("eval.every_steps", 0, "config.sweep.pruner='median' judges the evaluations during "
                            "training, but eval.every_steps=0 evaluates only at the end"),
    ("sweep.metric", "train/loss", "config.sweep.metric='train/loss' must be an 'eval/NAME'"),
])
def test_a_pruner_without_evaluations_to_judge_is_one_line(config, field, value, says):
    config.sweep.pruner = "median"
    settings.check_section(config, None, "cfg.py")  # the demo evaluates every 500 steps
    section, key = field.split(".")
    config[section][key] = value
    with pytest.raises(ConfigError) as raised:
        settings.check_section(config, None, "cfg.py")
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_a_sweep_needs_a_space_and_only_one(config):
    settings.check_section(config, None, "cfg.py")
    with pytest.raises(ConfigError, match="defines search_space.trial. and config.sweep.space"):
        settings.check_section(config, lambda trial: {}, "cfg.py")
    config.sweep.space = ()
    with pytest.raises(ConfigError, match="nothing to sweep"):
        settings.check_section(config, None, "cfg.py")


def test_a_heartbeat_for_a_trial_that_just_finished_leaves_it_as_it_is(tmp_path):
    """The runner renews the heartbeat of the trials it saw running; one may be told
    COMPLETE by its worker thread in between (CI: 'Trial#1 has already finished and can
    not be updated' ended a PostgreSQL sweep)."""
    storage = study_lib.open_storage(f"sqlite:///{tmp_path / 'study.db'}")
    study = study_lib.Study.open(storage, "s", "maximize", ["x=float(0, 1)"], "eval/accuracy")
    trial = study.optuna.ask()
    study.beat(trial.number)
    running_beat = study.trial(trial.number).user_attrs["heartbeat"]
    study.optuna.tell(trial, 0.5)
    study.beat(trial.number)
    finished = study.trial(trial.number)
    assert finished.state == optuna.trial.TrialState.COMPLETE
    assert finished.user_attrs["heartbeat"] == running_beat
