"""Config validation: every bad input raises a ConfigError naming the field."""

from __future__ import annotations

import pytest

from tests.conftest import run_main
from trainer import config as config_lib
from trainer.config import ConfigError
from trainer.trainer import resolve_trainer_class


def config_with(section: str, field: str, value):
    config = config_lib.get_config()
    config.trainer = "tests.support.toy:ToyTrainer"
    config[section][field] = value
    return config


def test_default_config_is_valid():
    config_lib.validate(config_lib.get_config())


def test_unknown_strategy_names_the_field_and_choices():
    with pytest.raises(ConfigError, match=r"distribute\.strategy='mirorred'.*Did you mean 'mirrored'"):
        config_lib.validate(config_with("distribute", "strategy", "mirorred"))


@pytest.mark.parametrize("field", ["global_batch_size", "steps", "steps_per_loop", "log_every_steps"])
@pytest.mark.parametrize("value", [0, -5])
def test_non_positive_train_values_are_rejected(field, value):
    with pytest.raises(ConfigError, match=rf"config\.train\.{field}={value} must be a positive"):
        config_lib.validate(config_with("train", field, value))


def test_batch_not_divisible_by_replicas_suggests_multiples():
    with pytest.raises(ConfigError, match=r"train\.global_batch_size=30 is not divisible by 4 "
                                          r"replicas; use a multiple of 4 \(e\.g\. 28 or 32\)"):
        config_lib.check_batch_divisible("train.global_batch_size", 30, 4)
    assert config_lib.check_batch_divisible("train.global_batch_size", 32, 4) == 8


def test_unknown_key_in_a_section_gets_a_suggestion():
    config = config_lib.get_config()
    config.train.step = 10
    with pytest.raises(ConfigError, match=r"config\.train\.step is not a field.*'steps'"):
        config_lib.validate(config)


def test_unknown_top_level_key_points_to_free_form_sections():
    config = config_lib.get_config()
    config.optimiser = {}
    with pytest.raises(ConfigError, match=r"config\.optimiser.*'optimizer'.*config\.model"):
        config_lib.validate(config)


def test_free_form_sections_accept_any_key():
    config = config_lib.get_config()
    config.model.anything = 3
    config.data.path = "/x"
    config_lib.validate(config)


@pytest.mark.parametrize("path, message", [
    ("tests.support.toy.ToyTrainer", "must name a Trainer subclass as 'package.module:ClassName'"),
    ("tests.no_such_module:ToyTrainer", "module 'tests.no_such_module' cannot be imported"),
    ("tests.support.toy:ToyTrainr", "has no attribute 'ToyTrainr'. Did you mean 'ToyTrainer'"),
    ("models.digits:DigitTrainer",
     r"^config\.trainer='models\.digits:DigitTrainer': module 'models\.digits' has no "
     r"attribute 'DigitTrainer'\. Did you mean 'DigitsTrainer' or 'DigitsToTargetTrainer'\?$"),
    ("tests.support.toy:Trainr",  # the classes defined there, not the base class it imports
     r"has no attribute 'Trainr'\. Did you mean 'ToyTrainer' or 'ToyEvalTrainer'\?$"),
    ("tests.support.toy:toy_config", "is not a subclass of trainer.Trainer"),
])
def test_trainer_path_that_does_not_resolve(path, message):
    config = config_lib.get_config()
    config.trainer = path
    with pytest.raises(ConfigError, match=message):
        resolve_trainer_class(config.trainer)


def test_trainer_path_that_resolves():
    from tests.support.toy import ToyTrainer

    assert resolve_trainer_class("tests.support.toy:ToyTrainer") is ToyTrainer


def test_other_fields_are_checked():
    for section, field, value in [("precision", "policy", "float8"),
                                  ("optimizer", "name", "adamm"),
                                  ("eval", "steps", 0),
                                  ("perf", "grad_accum_steps", 0),
                                  ("checkpoint", "best_mode", "up"),
                                  ("checkpoint", "local_every_steps", -5)]:
        with pytest.raises(ConfigError, match=rf"config\.{section}\.{field}"):
            config_lib.validate(config_with(section, field, value))


def test_local_checkpoints_inside_an_accumulation_window_are_refused():
    config = config_with("perf", "grad_accum_steps", 4)
    config.checkpoint.local_every_steps = 6
    with pytest.raises(ConfigError, match=r"checkpoint\.local_every_steps=6 is not a multiple "
                                          r"of perf\.grad_accum_steps=4"):
        config_lib.validate(config)
    config.checkpoint.local_every_steps = 8
    config_lib.validate(config)
    config.checkpoint.local_dir_typo = "/x"  # the section's unknown keys stay refused
    with pytest.raises(ConfigError, match=r"config\.checkpoint\.local_dir_typo is not a field"):
        config_lib.validate(config)


def test_main_rejects_bad_override_before_starting(tmp_path):
    proc = run_main(tmp_path, "--config.train.steps=0", timeout=120)
    assert proc.returncode != 0
    assert "config.train.steps=0 must be a positive integer" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_grad_compression_names_the_choices():
    with pytest.raises(ConfigError, match=r"^config\.distribute\.grad_compression='bf8' is not "
                                          r"one of 'none', 'bf16', 'fp16'\."):
        config_lib.validate(config_with("distribute", "grad_compression", "bf8"))


def test_unknown_random_draws_names_the_choices():
    with pytest.raises(ConfigError, match=r"^config\.distribute\.random_draws='globl' is not "
                                          r"one of 'per_replica', 'global'\. Did you mean"):
        config_lib.validate(config_with("distribute", "random_draws", "globl"))


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_fp16_compression_without_loss_scaling_says_what_to_do(policy):
    config = config_with("distribute", "grad_compression", "fp16")
    config.precision.policy = policy
    with pytest.raises(ConfigError, match=(
            rf"^config\.distribute\.grad_compression='fp16' needs precision\.policy="
            rf"'mixed_float16' \(it is '{policy}'\): .*overflow to inf.* Use "
            rf"--config\.distribute\.grad_compression=bf16 .*, or "
            rf"--config\.precision\.policy=mixed_float16\.$")):
        config_lib.validate(config)


@pytest.mark.parametrize("compression, policy", [("none", "float32"), ("bf16", "float32"),
                                                 ("bf16", "mixed_float16"),
                                                 ("fp16", "mixed_float16")])
def test_grad_compression_settings_that_are_valid(compression, policy):
    config = config_with("distribute", "grad_compression", compression)
    config.precision.policy = policy
    config_lib.validate(config)
