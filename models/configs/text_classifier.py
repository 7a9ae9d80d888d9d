"""Sequence classifier over variable-length padded batches (embedding, sparse gradients).

    python -m trainer.main --config=models/configs/text_classifier.py --workdir=/tmp/text
    python -m launch.multiworker --workers 2 --config=models/configs/text_classifier.py \
        --workdir=/tmp/text2
"""

import ml_collections

from trainer import config as config_lib


def get_config() -> ml_collections.ConfigDict:
    config = config_lib.get_config()
    config.trainer = "models.text_classifier:TextClassifierTrainer"
    config.train.global_batch_size = 32
    config.train.steps = 400
    config.train.steps_per_loop = 20
    config.train.log_every_steps = 100
    config.eval.global_batch_size = 64
    config.eval.every_steps = 200
    config.optimizer.name = "adam"
    config.optimizer.learning_rate = 1e-2
    config.model.vocab = 2000
    config.model.dim = 16
    config.model.hidden = 32
    config.data.examples = 2048
    config.data.min_len = 4
    config.data.max_len = 48
    config.data.buckets = 0  # > 0: bucket_by_sequence_length with this many buckets
    return config
