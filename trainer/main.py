"""Command-line entry point, intentionally kept short and free of TensorFlow.

    python -m trainer.main --config=models/configs/digits.py --workdir=/tmp/digits \
        [--config.train.steps=500 ...] [--check_only [--check_replicas=N]] [--traceback]

First, without importing TensorFlow (about a second): the flags and ``--config.``
overrides are parsed, the config file is loaded and validated, ``config.trainer``'s
module is found and the workdir is checked (created, and writable). A mistake there
ends in one message (:mod:`trainer.cli`). ``--check_only`` stops after these checks
(the launchers run it once before starting their tasks, with ``--check_replicas=N``: the
global batch sizes must divide over the N training tasks they will start). Then :mod:`trainer.commands.fit`
(TensorFlow) builds the Trainer subclass named by ``config.trainer``, writes
``workdir/config.json`` (chief only) and calls ``fit()``, which resumes from the latest
checkpoint in ``workdir``; the run ends with one plain ``result:`` line on stdout.

``--mode=eval [--step=S]`` evaluates the latest (or step S's) checkpoint of ``workdir``
once; ``--mode=continuous_eval [--eval_timeout_s=T]`` evaluates each new checkpoint as
the trainer writes it, until the final step (see :mod:`trainer.commands.continuous_eval`). The
process TF_CONFIG names the ``evaluator`` task refuses ``--mode=train``.

Exit codes: 0 done (also when a callback requested the stop); 2 for a usage error (a
flag, an override key, a missing config file); 1 with a message for any other user
error (config value, config file, workdir, checkpoint, data vs model, port, device)
and, with a traceback, for an internal error; 143
(``trainer.checkpoint.guards.preemption.EXIT_PREEMPTED``, 128 + SIGTERM) after SIGTERM or SIGINT
during training, once the current step is checkpointed: run the same command again to
resume; 128 + the signal (143, 130) after a signal in another phase (nothing new to
save) or a second signal (:mod:`trainer.runtime.signals`); 170
(``trainer.errors.EXIT_PEER_LOST``, retryable) when a peer task of a multi-worker run
was lost (:mod:`trainer.distribution.lost_peer`). ``--traceback`` (or
``TF_TRAINER_TRACEBACK=1``) shows the Python traceback of a user error too.

The one deferred import of this package: :func:`load_fit_command` loads the TensorFlow
side with ``importlib`` once the checks passed (``tests/test_architecture.py`` accepts
``importlib.import_module`` of a project module only here and in ``trainer.doctor.cli``).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from tf_cluster.storage_schemes import is_bucket
from trainer import cli, errors
from trainer import config as config_lib
from trainer.runtime import fast_exit, signals

PROGRAM = "python -m trainer.main"
_CONFIG = config_flags.DEFINE_config_file("config", None, cli.config_help(), lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory the run writes to (created if missing); a run resumes from "
                     "its latest checkpoint.")
_MODE = flags.DEFINE_enum("mode", "train", cli.MODES,
                          "train; eval: evaluate one checkpoint; continuous_eval: evaluate "
                          "each new checkpoint of --workdir until the final step.")
_STEP = flags.DEFINE_integer("step", None, "--mode=eval: the checkpoint's step (default: "
                             "the latest).")
_EVAL_TIMEOUT_S = flags.DEFINE_float(
    "eval_timeout_s", cli.DEFAULT_EVAL_TIMEOUT_S,
    "--mode=continuous_eval: stop when no new checkpoint appeared for this many seconds.")
_CHECK_ONLY = flags.DEFINE_bool(
    "check_only", False, "Check the flags, config file and workdir without importing "
                         "TensorFlow, print 'ok' and exit 0 (or the error).")
_CHECK_REPLICAS = flags.DEFINE_integer(
    "check_replicas", 0, "With --check_only: also check that train.global_batch_size and "
                         "eval.global_batch_size divide over this many replicas (a launcher "
                         "passes the number of training tasks it will start; 0: no check).",
    lower_bound=0)
flags.DEFINE_bool("traceback", False, "Also print the Python traceback of a user error "
                                      "(or set TF_TRAINER_TRACEBACK=1).")
flags.mark_flags_as_required(["config", "workdir"])
OWN_FLAGS = ("config", "workdir", "mode", "step", "eval_timeout_s", "check_only",
             "check_replicas", "traceback")


def load_fit_command() -> ModuleType:
    """The TensorFlow side of this command (:mod:`trainer.commands.fit`), imported only
    here, after every check that does not need TensorFlow has passed."""
    return importlib.import_module("trainer.commands.fit")


def check(argv: list[str]) -> ml_collections.ConfigDict:
    """The TensorFlow-free checks; returns the validated config or raises a UserError."""
    if len(argv) > 1:
        raise errors.UsageError(f"unexpected arguments: {' '.join(argv[1:])}; flags take the "
                                f"form --name=value ({PROGRAM} --help lists them).")
    config = cli.loaded_config(_CONFIG, sys.argv, OWN_FLAGS, PROGRAM)
    config_lib.validate(config)
    if _CHECK_REPLICAS.value:
        config_lib.check_batches_divisible(config, _CHECK_REPLICAS.value)
    cli.check_trainer_path(config.trainer)
    # --check_only runs where a job is submitted, which may not reach the job's bucket
    # nor hold its credentials: a gs:// workdir or data_dir is checked when the job starts.
    cli.check_workdir(_WORKDIR.value, contact_bucket=not _CHECK_ONLY.value)
    if not _CHECK_ONLY.value:
        cli.check_data_dir(config)
    return config


def main(argv: list[str]) -> int:
    """Checks, then fits (see the module docstring); returns the exit status."""
    config = check(argv)
    if _CHECK_ONLY.value:
        print(f"ok: --config={config_flags.get_config_filename(flags.FLAGS['config'])} and "
              f"--workdir={_WORKDIR.value} pass the checks"
              f"{' (a bucket is checked when the job starts)' if is_bucket(_WORKDIR.value) else ''}.")
        return 0
    workdir = cli.resolve_paths(config, _WORKDIR.value)
    return load_fit_command().run(config, workdir, _MODE.value, _STEP.value,
                                  _EVAL_TIMEOUT_S.value)


def run() -> None:
    """Console-script entry point (``tf-trainer``). Errors end as the module docstring
    says (:mod:`trainer.errors`); the process ends without destroying TensorFlow's
    objects one by one (see :mod:`trainer.runtime.fast_exit`). SIGTERM/SIGINT are answered from
    here on, in every phase (:mod:`trainer.runtime.signals`)."""
    signals.install()
    app.run(fast_exit.then_exit(lambda argv: errors.call(main, argv)),
            flags_parser=lambda argv: cli.parse_flags(argv, OWN_FLAGS, PROGRAM))


if __name__ == "__main__":
    run()
