"""The TensorFlow side of ``python -m trainer.main``: build the Trainer, fit, report.

Loaded by :func:`trainer.main.load_fit_command` once the flags, config and workdir
passed their checks. User errors raised here (configuration, checkpoint, input,
workdir) end in one message through :func:`trainer.errors.call`. On a multi-worker
run every task first checks that it sees the chief's workdir
(:mod:`trainer.checkpoint.guards.shared_workdir`), and a peer task lost during ``fit()`` ends
every survivor with one ``Lost peer`` line and exit status 170 (:mod:`trainer.distribution.lost_peer`).

The result of a run is one plain line on stdout, written by the chief, for scripts::

    result: step=1000 eval/accuracy=0.9611 eval/loss=0.1317 train/loss=0.0412 \
        checkpoint=/tmp/digits/checkpoints/1000 time_s=14.2

(``key=value`` pairs separated by spaces; ``checkpoint=none`` when nothing was saved;
``time_s``: the process's wall time). A run that checks its updates for overflow
(``precision.policy=mixed_float16``, or ``train.on_nonfinite`` other than "auto") adds
``skipped_steps=N`` before ``checkpoint=``: the updates skipped as non-finite, which
is where float16 runs on different replica counts part (docs/numerics.md).
The ``final: {json}`` log line on stderr carries the same metrics.
"""

from __future__ import annotations

import json
import os
import sys
import time

import ml_collections
import psutil
import tensorflow as tf
from absl import logging

from trainer import errors
from trainer.checkpoint import inventory
from trainer.checkpoint.guards import shared_workdir
from trainer.checkpoint.guards.preemption import EXIT_PREEMPTED, Preempted
from trainer.checkpoint.storage.reader import LATEST_DIR
from trainer.commands import continuous_eval
from trainer.distribution import strategies, lost_peer
from trainer.trainer import resolve_trainer_class


def summary_line(results: dict[str, float], step: int, checkpoint: str | None,
                 seconds: float, skipped_steps: int | None = None) -> str:
    """The ``result:`` line (see the module docstring); metrics sorted by name;
    ``skipped_steps``: None when the run does not check its updates."""
    metrics = " ".join(f"{k}={v:.6g}" for k, v in sorted(results.items()))
    skipped = "" if skipped_steps is None else f" skipped_steps={skipped_steps}"
    return (f"result: step={step} {metrics}{skipped} checkpoint={checkpoint or 'none'} "
            f"time_s={seconds:.1f}").replace("  ", " ")


def _write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    path = os.path.join(workdir, "config.json")
    try:
        tf.io.gfile.makedirs(workdir)  # a remote workdir (gs://...) is not made earlier
        with tf.io.gfile.GFile(path, "w") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    except OSError as error:
        raise (errors.write_error(error, f"--workdir={workdir}") or error) from error


def _last_checkpoint(workdir: str) -> int | None:
    """The newest checkpoint step in ``workdir`` whose files verify (None: none, or
    unreadable): the one a restart resumes from."""
    try:
        good = inventory.last_good(workdir)
    except Exception:  # noqa: BLE001 - only a hint in a message about another failure
        return None
    return good.step if good else None


def run(config: ml_collections.ConfigDict, workdir: str, mode: str = "train",
        step: int | None = None,
        eval_timeout_s: float = continuous_eval.DEFAULT_TIMEOUT_S) -> int:
    """Builds ``config.trainer`` and fits it in ``workdir`` (``mode="train"``) or evaluates
    its checkpoints (:mod:`trainer.commands.continuous_eval`); returns the exit status."""
    continuous_eval.check_mode(mode, step)
    if mode != "train":  # never trains, never writes checkpoints
        results = continuous_eval.run(config, workdir, mode, step, eval_timeout_s)
        logging.info("final: %s", json.dumps(results, sort_keys=True))
        return 0
    trainer = resolve_trainer_class(config.trainer)(config, workdir)
    shared_workdir.check(trainer.strategy, workdir, config.checkpoint.shared_workdir_timeout_s)
    if strategies.is_chief(trainer.strategy):
        _write_config(config, workdir)
    tf_logger = logging.logging.getLogger("tensorflow")
    tf_logger.setLevel(logging.logging.WARNING)  # TF's per-call INFO lines drown progress
    try:
        results = trainer.fit()
    except Preempted as preempted:
        logging.warning("%s Exit code %d.", preempted, EXIT_PREEMPTED)
        return EXIT_PREEMPTED
    except Exception as error:  # a lost peer task becomes one line and exit 170
        lost = lost_peer.translate(error, trainer.step, _last_checkpoint(workdir))
        if lost is None:
            raise
        raise lost from error
    logging.info("final: %s", json.dumps(results, sort_keys=True))
    # read on every worker alike (a distributed variable)
    skipped = trainer.precision.counters()[0] if trainer.gradients.checks_finite else None
    if trainer.is_chief:
        checkpoint = os.path.join(workdir, LATEST_DIR, str(trainer.step))
        sys.stdout.write(summary_line(results, trainer.step,
                                      checkpoint if tf.io.gfile.isdir(checkpoint) else None,
                                      time.time() - psutil.Process().create_time(),
                                      skipped) + "\n")
        sys.stdout.flush()
    return 0
