"""``python -m trainer.manual``: choose ``distribute.device_weights`` for manual data
parallelism (:mod:`trainer.distribution.data_parallel`).

    python -m trainer.manual --config=path/to/config.py --measure [--repeats 20]

``--measure`` times one forward/backward of an equal share of a training batch on each
device and suggests weights proportional to speed; without it the command prints the
split the config gives.
"""

from __future__ import annotations

import statistics
import sys
import time

import tensorflow as tf
from absl import app, flags
from ml_collections import config_flags

from trainer import cli, errors
from trainer import config as config_lib
from trainer import data
from trainer.config import ConfigError
from trainer.distribution.data_parallel import ManualDataParallel
from trainer.errors import UsageError
from trainer.trainer import Trainer, resolve_trainer_class


def measure(trainer: Trainer, repeats: int = 20) -> list[dict[str, float]]:
    """Times the training forward/backward of an equal share of a batch on each device.

    Host, eager. Takes the first training batch, keeps ``global_batch // n_devices``
    examples, and times ``trainer.train_step`` on them under each device (updates
    deferred and discarded, so the variables do not change). Returns one dict per
    device: ``device``, ``seconds`` (median), ``examples_per_s`` and ``suggested_weight``
    (speed relative to the slowest device, 2 decimals).
    """
    manual = trainer.gradients.reducer
    if not isinstance(manual, ManualDataParallel):
        raise ConfigError("measure() needs distribute.strategy='manual' (set "
                          "--config.distribute.strategy=manual).")
    dataset = data.distribute(trainer.strategy, trainer.build_train_dataset, trainer.batch,
                              deterministic=True)
    trainer.context.ensure_built(dataset)
    share = max(1, trainer.batch.global_size // len(manual.devices))
    batch = tf.nest.map_structure(lambda t: t[:share], next(iter(dataset)))
    results = []
    for device in manual.devices:
        def forward_backward(part, device=device):
            _, calls = manual.run_slice(trainer.train_step, part, device)
            return [g for call in calls for g in call.grads if g is not None]

        fn = tf.function(forward_backward)
        tf.nest.map_structure(lambda t: t.numpy(), fn(batch))  # trace and warm up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            tf.nest.map_structure(lambda t: t.numpy(), fn(batch))
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        results.append({"device": device, "seconds": seconds,
                        "examples_per_s": share / seconds})
    slowest = min(r["examples_per_s"] for r in results)
    for r in results:
        r["suggested_weight"] = round(r["examples_per_s"] / slowest, 2)
    return results


PROGRAM = "python -m trainer.manual"
OWN_FLAGS = ("config", "measure", "repeats", "traceback")


def _main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}; flags take the form "
                         f"--name=value ({PROGRAM} --help lists them).")
    config = cli.loaded_config(flags.FLAGS["config"], sys.argv, OWN_FLAGS, PROGRAM)
    config_lib.validate(config)
    if config.distribute.strategy != "manual":
        raise ConfigError("trainer.manual needs --config.distribute.strategy=manual "
                          "(and distribute.devices / distribute.virtual_devices).")
    trainer = resolve_trainer_class(config.trainer)(config)
    print(trainer.gradients.reducer.describe())
    if not flags.FLAGS["measure"].value:
        return
    results = measure(trainer, flags.FLAGS["repeats"].value)
    print(f"{'device':<28}{'ms/step':>10}{'examples/s':>14}{'weight':>9}")
    for r in results:
        print(f"{r['device']:<28}{r['seconds'] * 1e3:>10.2f}{r['examples_per_s']:>14.0f}"
              f"{r['suggested_weight']:>9.2f}")
    weights = ",".join(f"{r['suggested_weight']:g}" for r in results)
    print(f"suggested: --config.distribute.device_weights=\"({weights})\"")


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", None, "Experiment config file.")
    flags.DEFINE_bool("measure", False, "Time each device and suggest device_weights.")
    flags.DEFINE_integer("repeats", 20, "Timed forward/backward passes per device.")
    flags.DEFINE_bool("traceback", False, "Also print the Python traceback of a user error.")
    flags.mark_flags_as_required(["config"])
    app.run(lambda argv: errors.call(_main, argv),
            flags_parser=lambda argv: cli.parse_flags(argv, OWN_FLAGS, PROGRAM))
