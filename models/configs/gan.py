"""GAN on scikit-learn's 8x8 digits: two optimizers, custom train_step (no download).

    python -m trainer.main --config=models/configs/gan.py --workdir=/tmp/gan

``config.optimizer`` drives the generator; the discriminator uses the same optimizer
settings with ``config.model.d_learning_rate``.
"""

import ml_collections

from trainer import config as config_lib


def get_config() -> ml_collections.ConfigDict:
    config = config_lib.get_config()
    config.trainer = "models.gan:DigitsGANTrainer"
    config.train.global_batch_size = 64
    config.train.steps = 3000
    config.train.steps_per_loop = 100
    config.train.log_every_steps = 500
    config.optimizer.name = "adam"
    config.optimizer.learning_rate = 1e-3  # generator
    config.model.d_learning_rate = 1e-3  # discriminator
    config.model.latent_dim = 16
    config.model.hidden = 128
    config.data.split_seed = 0
    return config
