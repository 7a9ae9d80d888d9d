"""A sweep of the digits demo: learning rate, hidden width and batch size.

    python -m trainer.sweep --config=models/configs/digits_sweep.py \
        --workdir=/tmp/digits_sweep --trials=8 --parallel=2

Each trial is the digits demo (models/configs/digits.py) with the sampled values; the
objective is the final evaluation's accuracy.
"""

import ml_collections

from models.configs import digits


def get_config() -> ml_collections.ConfigDict:
    config = digits.get_config()
    config.sweep.space = (
        "optimizer.learning_rate=log(1e-4, 3e-2)",
        "model.hidden=choice(32, 64, 128)",
        "train.global_batch_size=choice(32, 64)",
    )
    config.sweep.metric = "eval/accuracy"
    config.sweep.direction = "maximize"
    return config
