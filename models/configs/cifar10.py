"""ResNet-20 on TFDS ``cifar10`` (SGD, warmup + cosine, L2 5e-4, flip/crop augmentation).

    python -m trainer.main --config=models/configs/cifar10.py --workdir=/tmp/cifar10

On several GPUs/TPU cores add ``--config.model.sync_bn=True`` for global-batch batch
norm. Offline by default: ``tfds build cifar10 --data_dir=DIR`` once, then
``--config.data.data_dir=DIR`` (or ``--config.data.download=True``).
"""

import ml_collections

from trainer import config as config_lib


def get_config() -> ml_collections.ConfigDict:
    config = config_lib.get_config()
    config.trainer = "models.cifar10:Cifar10Trainer"
    config.train.global_batch_size = 128
    config.train.steps = 20_000
    config.train.steps_per_loop = 100
    config.train.log_every_steps = 500
    config.eval.every_steps = 2000
    config.optimizer.name = "sgd"
    config.optimizer.momentum = 0.9
    config.optimizer.learning_rate = 0.1
    config.optimizer.schedule = "warmup_cosine"
    config.optimizer.warmup_steps = 500
    config.model.widths = (16, 32, 64)
    config.model.blocks_per_stage = 3  # 3: ResNet-20
    config.model.sync_bn = False
    config.model.l2 = 5e-4
    config.data.data_dir = ""
    config.data.download = False
    config.data.shuffle_buffer = 10_000
    config.data.cache = True
    config.data.augment = True
    return config
