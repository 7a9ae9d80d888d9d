"""MNIST CNN on TFDS ``mnist``: ~99 % test accuracy after 3000 steps.

    python -m trainer.main --config=models/configs/mnist.py --workdir=/tmp/mnist

Offline by default: prepare the data once with ``tfds build mnist --data_dir=DIR`` and
pass ``--config.data.data_dir=DIR``, or add ``--config.data.download=True``.
"""

import ml_collections

from trainer import config as config_lib


def get_config() -> ml_collections.ConfigDict:
    config = config_lib.get_config()
    config.trainer = "models.mnist:MnistTrainer"
    config.train.global_batch_size = 128
    config.train.steps = 3000
    config.train.steps_per_loop = 100
    config.train.log_every_steps = 500
    config.eval.every_steps = 1000
    config.optimizer.name = "adam"
    config.optimizer.learning_rate = 1e-3
    config.model.filters = 32
    config.model.hidden = 128
    config.model.dropout = 0.25
    config.data.data_dir = ""  # "": $TFDS_DATA_DIR or ~/tensorflow_datasets
    config.data.download = False  # True: let tfds download and prepare the data
    config.data.shuffle_buffer = 10_000
    config.data.cache = True
    config.data.augment = False
    return config
