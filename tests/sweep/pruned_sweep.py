"""A digits sweep whose trial 0 learns (learning rate 3e-3) and whose later trials barely
move (1e-6): with the median pruner from the first completed trial on, each later trial
is worse than trial 0 at its first evaluation, so it is pruned there.

    python -m trainer.sweep --config=tests/sweep/pruned_sweep.py --workdir=DIR --trials=2
"""

import ml_collections

from models.configs import digits_sweep


def get_config() -> ml_collections.ConfigDict:
    config = digits_sweep.get_config()
    config.sweep.space = ()  # search_space below
    config.sweep.pruner = "median"
    config.sweep.pruner_startup_trials = 1
    config.train.steps = 100
    config.train.log_every_steps = 50
    config.eval.every_steps = 20
    return config


def search_space(trial) -> dict:
    rate = 3e-3 if trial.number == 0 else 1e-6
    return {"optimizer.learning_rate": trial.suggest_float("optimizer.learning_rate",
                                                           rate, rate)}
