"""Byte-level Transformer LM (2 layers, d=64, 64-byte context) on Python's documentation topics.

    python -m trainer.main --config=models/configs/lm.py --workdir=/tmp/lm \
        [--config.data.text_file=PATH]

The default text ships with CPython (``pydoc_data.topics``): no download. Reports
``perplexity`` (per byte) on the held-out last 10 % of the text.
"""

import ml_collections

from trainer import config as config_lib


def get_config() -> ml_collections.ConfigDict:
    config = config_lib.get_config()
    config.trainer = "models.lm:TransformerLMTrainer"
    config.train.global_batch_size = 32
    config.train.steps = 1000
    config.train.steps_per_loop = 100
    config.train.log_every_steps = 200
    config.eval.every_steps = 500
    config.eval.steps = 20
    config.optimizer.name = "adamw"
    config.optimizer.learning_rate = 1e-3
    config.optimizer.weight_decay = 0.01
    config.optimizer.schedule = "warmup_cosine"
    config.optimizer.warmup_steps = 50
    config.optimizer.clipnorm = 1.0
    config.model.d_model = 64
    config.model.heads = 4
    config.model.layers = 2
    config.model.mlp_dim = 256
    config.model.dropout = 0.0
    config.data.text_file = ""  # "": Python's documentation topics (pydoc_data)
    config.data.seq_len = 64
    config.data.eval_fraction = 0.1
    return config
