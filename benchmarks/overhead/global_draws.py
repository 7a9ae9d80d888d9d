"""What ``distribute.random_draws="global"`` costs against the default ``"per_replica"``
on a dropout-heavy MLP, on 1 and 2 Mirrored replicas, in one process; prints
examples/s and each global mode's ratio to the per-replica mode of its replica count.

    python -m benchmarks.overhead.global_draws [--rounds 5] [--steps 200]

Modes (each its own Trainer, Adam, ``steps_per_loop=50``, virtual CPU devices, no
workdir): ``per_replica_1``, ``global_1`` (one replica: the same draws, one key less),
``per_replica_2``, ``global_2`` (2 replicas: each draws the dropout masks of the whole
global batch and keeps its half). The model, where the masks are a large share of the
step: 1024 inputs -> Dropout -> 64 -> Dropout -> 10, global batch 256 (a [b, 1024] and a
[b, 64] mask per replica and step, against a 1024x64 matmul). Every round
runs one ``fit()`` of ``--steps`` more steps per mode in a rotating order; the table
shows the median examples/s and the median of the per-round ratios (min-max) to the
``per_replica`` mode of the same replica count.
"""

from __future__ import annotations

import argparse
import os

from benchmarks.common import rounds as rounds_lib
from benchmarks.common.table import format_table, from_rounds

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

BATCH, WIDTH = 256, 1024
MODES = ("per_replica_1", "global_1", "per_replica_2", "global_2")


def dropout_trainer(mode: str):
    """A Trainer of the dropout-heavy MLP in ``mode`` (``<random_draws>_<replicas>``)."""
    import keras
    import numpy as np

    from benchmarks.common.arrays_trainer import ArraysTrainer
    from trainer import config as config_lib

    class DropoutMLP(ArraysTrainer):
        def build_model(self):
            return keras.Sequential([
                keras.Input((WIDTH,)), keras.layers.Dropout(0.5),
                keras.layers.Dense(64, activation="relu"), keras.layers.Dropout(0.5),
                keras.layers.Dense(10)])

        def arrays(self):
            x = np.random.default_rng(0).normal(size=(4 * BATCH, WIDTH)).astype(np.float32)
            return x, (x[:, 0] > 0).astype(np.int32)

    draws, replicas = mode.rsplit("_", 1)
    config = config_lib.get_config()
    config.update_from_flattened_dict({
        "train.global_batch_size": BATCH, "train.steps": 50, "train.steps_per_loop": 50,
        "train.log_every_steps": 10**6, "eval.every_steps": 0, "perf.plan": "fixed",
        "telemetry.progress": "off", "distribute.virtual_devices": 2,
        "distribute.strategy": "mirrored" if replicas == "2" else "one_device",
        "distribute.random_draws": draws})
    return DropoutMLP(config)


def fit_more(trainer, steps: int) -> None:
    """One ``fit()`` of ``steps`` more steps."""
    trainer.config.train.steps = trainer.step + steps
    trainer.fit()


def measure(rounds: int, steps: int) -> list:
    """The table's rows: examples/s per mode, ratios to per_replica of its replicas."""
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    trainers = {mode: dropout_trainer(mode) for mode in MODES}
    fits = {mode: (lambda t=t: fit_more(t, steps)) for mode, t in trainers.items()}
    for fit in fits.values():
        fit()  # trace and warm up
    rates = {mode: [BATCH * 1e6 / us for us in per_step]
             for mode, per_step in rounds_lib.interleaved(fits, rounds, steps).items()}
    return [from_rounds(mode, rates[mode], "ex/s", rates["per_replica_" + mode[-1]])
            for mode in MODES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(format_table(f"global_draws: dropout MLP, batch {BATCH}, {args.rounds} rounds x "
                       f"{args.steps} steps", measure(args.rounds, args.steps),
                       "per_replica (same replicas)"), flush=True)


if __name__ == "__main__":
    main()
