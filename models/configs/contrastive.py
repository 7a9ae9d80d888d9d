"""Contrastive digits: a global-batch contrastive loss through ``self.all_gather``.

    python -m trainer.main --config=models/configs/contrastive.py --workdir=/tmp/contrastive
"""

import ml_collections

from trainer import config as config_lib


def get_config() -> ml_collections.ConfigDict:
    config = config_lib.get_config()
    config.trainer = "models.contrastive:ContrastiveDigitsTrainer"
    config.train.global_batch_size = 32
    config.train.steps = 200
    config.train.steps_per_loop = 20
    config.train.log_every_steps = 100
    config.optimizer.name = "adam"
    config.optimizer.learning_rate = 1e-3
    config.model.hidden = 64
    config.model.embedding = 16
    config.model.noise = 0.1
    config.model.temperature = 0.2
    config.data.split_seed = 0
    return config
