"""The digits config, run by WeightsTrainer, short enough for launcher tests."""

import ml_collections

from models.configs import digits


def get_config() -> ml_collections.ConfigDict:
    config = digits.get_config()
    config.trainer = "tests.launch_helpers.weights_trainer:WeightsTrainer"
    config.train.global_batch_size = 64
    config.train.steps = 30
    config.train.steps_per_loop = 5
    config.train.log_every_steps = 5
    config.eval.every_steps = 0
    # Batch sharding: the same global batches on any number of workers as in one process
    # (the tests compare final weights). File sharding is tested in test_input_scale.py.
    config.data.sharding = "data"
    return config
