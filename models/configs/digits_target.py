"""Digits MLP that stops at a target eval accuracy (the Callback example).

    python -m trainer.main --config=models/configs/digits_target.py --workdir=/tmp/target
"""

import ml_collections

from models.configs import digits


def get_config() -> ml_collections.ConfigDict:
    config = digits.get_config()
    config.trainer = "models.digits:DigitsToTargetTrainer"
    config.train.steps = 5000
    config.eval.every_steps = 100
    config.model.target_accuracy = 0.9
    return config
