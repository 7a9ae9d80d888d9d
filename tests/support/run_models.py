"""Tiny configs of the model zoo, and the subprocess entries of its tests.

    python -m tests.support.run_models replicas --replicas N --out DIR
        trains every model a few steps on N virtual CPU devices (Mirrored when N > 1)
        in ONE process (one Mirrored group size per process), TFDS models under
        ``tfds.testing.mock_data``; writes DIR/results.json and DIR/weights.npz.

In process, TFDS models run under ``tfds.testing.mock_data`` with ``download=False`` and
a ``data_dir`` that holds no data. Runs in other processes (the notebook, the guide's
commands) read a real prepared data directory of random images instead:
:func:`write_fake_tfds` stores ``mnist`` and ``cifar10`` with the registered builders'
names, versions and features, so ``tfds.load(..., download=False)`` reads them exactly
as it reads the real datasets (and tfds's mock, which patches file access globally,
never races a checkpoint writer thread).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

MODELS = ("mnist", "cifar10", "lm", "gan")
TFDS_MODELS = ("mnist", "cifar10")
MOCK_EXAMPLES = 64


def tiny_config(name: str, **overrides):
    """The model's real config file, shrunk to a few steps of a tiny network.

    ``overrides`` maps ``"section.field"`` to values (applied last).
    """
    import importlib

    config = importlib.import_module(f"models.configs.{name}").get_config()
    config.train.steps = 4
    config.train.steps_per_loop = 2
    config.train.log_every_steps = 2
    config.eval.every_steps = 0
    config.eval.steps = 2
    config.distribute.strategy = "one_device"
    if name in TFDS_MODELS:
        config.train.global_batch_size = 16
        config.data.shuffle_buffer = MOCK_EXAMPLES
        config.data.data_dir = "/nonexistent/tfds"  # must not be read: mock_data replaces it
    if name == "mnist":
        config.model.filters = 4
        config.model.hidden = 16
    if name == "cifar10":
        config.model.widths = (4, 8)
        config.model.blocks_per_stage = 1
        config.data.augment = False  # the sync-BN comparison needs identical inputs
        config.optimizer.warmup_steps = 1
    if name == "lm":
        config.train.global_batch_size = 16
        config.model.d_model = 32
        config.model.heads = 2
        config.model.layers = 1
        config.model.mlp_dim = 64
        config.model.dropout = 0.0
        config.data.seq_len = 32
        config.optimizer.warmup_steps = 1
    if name == "gan":
        config.train.global_batch_size = 32
        config.model.hidden = 32
    config.update_from_flattened_dict(overrides)
    return config


def mock_tfds():
    """``tfds.testing.mock_data`` with deterministic random examples (a context manager)."""
    import tensorflow_datasets as tfds

    return tfds.testing.mock_data(num_examples=MOCK_EXAMPLES)


def _trainer_class(config):
    from trainer.trainer import resolve_trainer_class

    return resolve_trainer_class(config.trainer)


def train(config) -> tuple[object, dict]:
    """Builds and fits the Trainer ``config`` names (TFDS mocked); returns it and fit()."""
    is_tfds = config.trainer.startswith(("models.mnist:", "models.cifar10:"))
    with mock_tfds() if is_tfds else contextlib.nullcontext():
        t = _trainer_class(config)(config)
        return t, t.fit()


def run_replicas(replicas: int, out: str) -> None:
    results = {}
    weights = {}

    def config_for(name, **overrides):
        config = tiny_config(name, **overrides)
        if replicas > 1:
            config.distribute.strategy = "mirrored"
            config.distribute.virtual_devices = replicas
        return config

    runs = {name: config_for(name) for name in MODELS}
    runs["cifar10_sync_bn"] = config_for("cifar10", **{"model.sync_bn": True})
    for run, config in runs.items():
        t, fit = train(config)
        assert t.strategy.num_replicas_in_sync == replicas, t.strategy
        results[run] = {"fit": fit, "replicas": t.strategy.num_replicas_in_sync,
                        "strategy": type(t.strategy).__name__, "step": t.step}
        if run.startswith("cifar10"):
            for i, w in enumerate(t.model.get_weights()):
                weights[f"{run}/{i}"] = w
        # Freed now, not at a later collection of several at once (tests/conftest.py,
        # collect_garbage_after_each_test): 42 s instead of 122 s for the five runs.
        del t
        gc.collect()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f)
    np.savez(os.path.join(out, "weights.npz"), **weights)


def write_fake_tfds(data_dir: str, train_examples: int = 64, test_examples: int = 32) -> str:
    """Prepares ``mnist`` and ``cifar10`` of random images in ``data_dir``; returns it.

    Uses the registered builders' versions and features, so the result is what
    ``tfds build NAME --data_dir=data_dir`` would leave (with other pixels), offline.
    """
    import tensorflow as tf
    import tensorflow_datasets as tfds

    tfds.disable_progress_bar()
    rng = np.random.default_rng(0)
    for name in TFDS_MODELS:
        builder = tfds.builder(name)
        features = builder.info.features
        shape = features["image"].shape

        def split(n, features=features, shape=shape):
            example = {"image": rng.integers(0, 256, (n, *shape), dtype=np.uint8),
                       "label": rng.integers(0, 10, n)}
            if "id" in features:
                example["id"] = np.array([f"fake_{i}" for i in range(n)])
            return tf.data.Dataset.from_tensor_slices(example)

        tfds.dataset_builders.store_as_tfds_dataset(
            name=name, version=str(builder.version), features=features, data_dir=data_dir,
            split_datasets={"train": split(train_examples), "test": split(test_examples)})
    return data_dir


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("replicas")
    rep.add_argument("--replicas", type=int, required=True)
    rep.add_argument("--out", required=True)
    args = parser.parse_args()
    run_replicas(args.replicas, args.out)


if __name__ == "__main__":
    from trainer.runtime.fast_exit import exit_now

    main()
    exit_now(0)  # no teardown of distributed iterators (up to 60 s each)
