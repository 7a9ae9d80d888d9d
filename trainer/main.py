"""Command-line entry point, intentionally kept short.

    python -m trainer.main --config=models/configs/digits.py --workdir=/tmp/digits \
        [--config.train.steps=500 ...]

Builds the Trainer subclass named by ``config.trainer``, writes the resolved config to
``workdir/config.json`` (chief only) and calls ``fit()``, which resumes from the latest
checkpoint in ``workdir``.

``--mode=eval [--step=S]`` evaluates the latest (or step S's) checkpoint of ``workdir``
once; ``--mode=continuous_eval [--eval_timeout_s=T]`` evaluates each new checkpoint as
the trainer writes it, until the final step (see :mod:`trainer.continuous_eval`). The
process TF_CONFIG names the ``evaluator`` task refuses ``--mode=train``.

Exit codes: 0 done (also when a callback requested the stop); 1 with a one-line message
for a configuration or checkpoint error; 143 (``trainer.preemption.EXIT_PREEMPTED``,
128 + SIGTERM) after SIGTERM, once the current step is checkpointed: run the same
command again to resume.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from trainer import config as config_lib
from trainer import continuous_eval, distribute, fast_exit
from trainer.checkpoint_state import CheckpointError
from trainer.preemption import EXIT_PREEMPTED, Preempted
from trainer.trainer import resolve_trainer_class

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory the run writes to.")
_MODE = flags.DEFINE_enum("mode", "train", continuous_eval.MODES,
                          "train; eval: evaluate one checkpoint; continuous_eval: evaluate "
                          "each new checkpoint of --workdir until the final step.")
_STEP = flags.DEFINE_integer("step", None, "--mode=eval: the checkpoint's step (default: "
                             "the latest).")
_EVAL_TIMEOUT_S = flags.DEFINE_float(
    "eval_timeout_s", continuous_eval.DEFAULT_TIMEOUT_S,
    "--mode=continuous_eval: stop when no new checkpoint appeared for this many seconds.")
flags.mark_flags_as_required(["config", "workdir"])


def evaluate(config) -> None:
    """--mode=eval / continuous_eval: never trains, never writes checkpoints."""
    try:
        results = continuous_eval.run(config, _WORKDIR.value, _MODE.value, _STEP.value,
                                      _EVAL_TIMEOUT_S.value)
    except config_lib.ConfigError as error:
        sys.exit(f"Configuration error: {error}")
    except CheckpointError as error:
        sys.exit(f"Checkpoint error: {error}")
    logging.info("final: %s", json.dumps(results, sort_keys=True))


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    config = _CONFIG.value
    if _MODE.value != "train":
        return evaluate(config)
    try:
        continuous_eval.check_mode(_MODE.value, _STEP.value)
        config_lib.validate(config)
        trainer_cls = resolve_trainer_class(config.trainer)
        trainer = trainer_cls(config, _WORKDIR.value)
    except config_lib.ConfigError as error:
        sys.exit(f"Configuration error: {error}")
    if distribute.is_chief(trainer.strategy):
        os.makedirs(_WORKDIR.value, exist_ok=True)
        with open(os.path.join(_WORKDIR.value, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    tf_logger = logging.logging.getLogger("tensorflow")
    tf_logger.setLevel(logging.logging.WARNING)  # TF's per-call INFO lines drown progress
    try:
        results = trainer.fit()
    except Preempted as preempted:
        logging.warning("%s Exit code %d.", preempted, EXIT_PREEMPTED)
        sys.exit(EXIT_PREEMPTED)
    except CheckpointError as error:
        sys.exit(f"Checkpoint error: {error}")
    except config_lib.ConfigError as error:
        sys.exit(f"Configuration error: {error}")
    logging.info("final: %s", json.dumps(results, sort_keys=True))


def run() -> None:
    """Console-script entry point (``tf-trainer``). The process ends without destroying
    TensorFlow's objects one by one (see :mod:`trainer.fast_exit`)."""
    app.run(fast_exit.then_exit(main))


if __name__ == "__main__":
    run()
