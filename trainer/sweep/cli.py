"""``python -m trainer.sweep``: the command line of a sweep, free of TensorFlow.

    python -m trainer.sweep --config=CFG --workdir=DIR --trials=N [--parallel=P] \
        [--storage=URL] [--study=NAME] [--config.KEY=VALUE ...]
    python -m trainer.sweep --status --workdir=DIR [--storage=URL] [--study=NAME]

Before any trial starts, in about a second: the flags, the config file (loaded and
validated as ``trainer.main`` does; the sweep's ``--config.`` overrides apply to it and
are passed to every trial), its ``sweep`` section (:mod:`trainer.sweep.settings`), the
search space against the config's fields (:mod:`trainer.sweep.space`), the storage and
the study (:mod:`trainer.sweep.study`). A mistake is one line: exit 2 for a usage error,
1 for the others. Then :mod:`trainer.sweep.runner` runs the trials, each an ordinary
``trainer.main`` run in ``DIR/trials/NNNN`` (:mod:`trainer.sweep.trials`), and the
status table (:mod:`trainer.sweep.status`) is printed on stdout with the best trial,
written to ``DIR/best_config.json``. Exit status 0 when no trial is left to resume, 143
when some are (preempted: run the same command again), 1 or 2 after an error line.
"""

from __future__ import annotations

import os
import runpy
import sys

from absl import app, flags
from ml_collections import config_flags

from tf_cluster.storage_schemes import is_local
from trainer import cli, errors
from trainer import config as config_lib
from trainer.sweep import hparams, mlflow_runs, settings, slurm, space, status, study, trials
from trainer.sweep.runner import Plan, Sweep, View, say

PROGRAM = "python -m trainer.sweep"
OWN_FLAGS = ("config", "workdir", "trials", "parallel", "workers", "one", "emit", "storage",
             "study", "status", "traceback")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise errors.UsageError(f"{message} ({PROGRAM} --help lists the flags).")


def _check_flags(argv: list[str]) -> flags.FlagValues:
    values = flags.FLAGS
    _require(len(argv) <= 1, f"unexpected arguments: {' '.join(argv[1:])}; flags take the "
                             f"form --name=value")
    _require(bool(values.workdir), "--workdir is required, e.g. --workdir=/tmp/sweep: the "
                                   "sweep's directory (trials/, study.db, best_config.json)")
    _require(is_local(values.workdir), f"--workdir={values.workdir} must be a local directory "
                                       f"(it holds the trials' logs and the default study)")
    if not values.status:
        _require(values.config is not None, "--config is required, e.g. "
                                             "--config=models/configs/digits_sweep.py")
        _require(values.trials is not None and values.trials >= 1,
                 "--trials=N is required: how many trials the study runs to the end")
        _require(values.parallel >= 1, f"--parallel={values.parallel} must be >= 1")
        _require(values.workers >= 1, f"--workers={values.workers} must be >= 1")
        _require(not (values.one and values.parallel > 1),
                 f"--one runs a single trial: drop --parallel={values.parallel}")
        _require(values.emit in ("", "slurm"), f"--emit={values.emit}: the sweep emits only "
                                               f"'slurm'")
        _require(not (values.one and values.emit), "--one is what each task of --emit=slurm "
                                                   "runs: drop one of them")
    return values


def _open(values: flags.FlagValues, must_exist: bool):
    url = values.storage or study.default_storage(values.workdir)
    if must_exist and not values.storage and not os.path.exists(study.sqlite_path(url)):
        raise errors.UsageError(f"--workdir={values.workdir} holds no sweep (no study.db); "
                                f"start one with {PROGRAM} --config=CFG --workdir=DIR "
                                f"--trials=N, or pass --storage=URL.")
    return study.open_storage(url), values.study or study.default_name(values.workdir)


def show_status(values: flags.FlagValues) -> int:
    """``--status``: the table and the best config (written anew)."""
    storage, name = _open(values, must_exist=True)
    print(status.report(study.Study.load(storage, name), values.workdir), flush=True)
    return 0


def _search_space(config_path: str):
    """The config file's ``search_space(trial)``, or None."""
    found = runpy.run_path(config_path).get("search_space")
    if found is not None and not callable(found):
        raise config_lib.ConfigError(f"{config_path}: search_space must be a function "
                                     f"search_space(trial) -> {{KEY: value}}.")
    return found


def views(config, opened: study.Study, root: str, dims: list[space.Dimension] | None,
          signature: list[str]) -> list[View]:
    """The views ``config.telemetry.loggers`` asks for: TensorBoard's HParams dashboard
    (:mod:`trainer.sweep.hparams`), MLflow's parent and child runs
    (:mod:`trainer.sweep.mlflow_runs`); an MLflow store it cannot use is one line."""
    found: list[View] = []
    if "tensorboard" in config.telemetry.loggers:
        if hparams.available():
            found.append(hparams.HParamsView(root, dims, config.sweep.metric))
        else:
            say("tensorboard is not installed: no HParams dashboard for this sweep "
                "(pip install 'tf-trainer[tensorboard]').")
    if "mlflow" in config.telemetry.loggers:
        try:
            found.append(mlflow_runs.MlflowRuns(
                opened, mlflow_runs.study_params(config.sweep, signature)))
        except Exception as error:  # noqa: BLE001 - the store's and drivers' errors: one line
            raise errors.UserError(
                f"MLflow cannot record the sweep: {type(error).__name__}: "
                f"{errors.first_line(error)}. Set "
                f"MLFLOW_TRACKING_URI to a store this machine reaches, or leave 'mlflow' "
                f"out of config.telemetry.loggers.") from error
    return found


def emit(values: flags.FlagValues, config_path: str, name: str) -> str:
    """``--emit=slurm``: the job array's sbatch script (:mod:`trainer.sweep.slurm`)."""
    own = [f"--config={os.path.abspath(config_path)}",
           f"--workdir={os.path.abspath(values.workdir)}", f"--trials={values.trials}",
           *([f"--workers={values.workers}"] if values.workers > 1 else []),
           *([f"--storage={values.storage}"] if values.storage else []),
           *([f"--study={values.study}"] if values.study else [])]
    return slurm.emit_slurm([*own, *trials.passed_overrides(sys.argv, set())], values.trials,
                            values.parallel, name, cpus=values.workers)


def main(argv: list[str]) -> int:
    """Checks, then runs the sweep or shows its status; returns the exit status."""
    values = _check_flags(argv)
    if study.optuna is None:
        raise errors.UserError("Optuna is not installed: pip install 'tf-trainer[sweep]'.")
    study.optuna.logging.set_verbosity(study.optuna.logging.WARNING)
    if values.status:
        return show_status(values)
    config = cli.loaded_config(values["config"], sys.argv, OWN_FLAGS, PROGRAM)
    config_lib.validate(config)
    cli.check_trainer_path(config.trainer)
    config_path = config_flags.get_config_filename(values["config"])
    search_space = _search_space(config_path)
    settings.check_section(config, search_space, config_path)
    dims = space.parse_space(config.sweep.space, config)
    cli.check_workdir(values.workdir)
    storage, name = _open(values, must_exist=False)
    url = values.storage or study.default_storage(values.workdir)
    signature = (list(config.sweep.space) if search_space is None
                 else [f"search_space(trial) of {os.path.abspath(config_path)}"])
    opened = study.Study.open(storage, name, config.sweep.direction, signature,
                              config.sweep.metric)
    swept = {d.key for d in dims}
    if values.emit:
        print(emit(values, config_path, name), flush=True)
        return 0
    plan = Plan(config_path=config_path,
                passed=trials.passed_overrides(sys.argv, swept),
                sample=space.sampler(dims, search_space, config, config_path),
                metric=config.sweep.metric, max_retries=config.sweep.max_retries,
                seed=config.sweep.seed,
                report_to=None if config.sweep.pruner == "none" else (url, name),
                views=views(config, opened, values.workdir,
                            dims if search_space is None else None, signature),
                workers=values.workers)
    pruner = "" if config.sweep.pruner == "none" else f", {config.sweep.pruner} pruner"
    say(f"sweep {name}: {values.trials} trial(s), {values.parallel} at a time, "
        f"{config.sweep.direction} {config.sweep.metric}{pruner}; study in {url}")
    code = Sweep(opened, plan, values.workdir, values.trials, values.parallel, say,
                 one=values.one).run()
    print(status.report(opened, values.workdir), flush=True)
    if code:
        say("trials were preempted: run the same command again to resume them from "
            "their checkpoints.")
    return code


def run() -> None:
    """Entry point: defines the flags, parses them (:func:`trainer.cli.parse_flags`: one
    line per mistake) and runs :func:`main` (errors: :func:`trainer.errors.call`)."""
    config_flags.DEFINE_config_file("config", None, cli.config_help(), lock_config=True)
    flags.DEFINE_string("workdir", None, "The sweep's directory: trials/NNNN (each trial's "
                                         "workdir), study.db, best_config.json.")
    flags.DEFINE_integer("trials", None, "How many trials the study runs to the end (a "
                                         "resumed trial counts once).")
    flags.DEFINE_integer("parallel", 1, "Trials run at once on this machine (with --emit="
                                        "slurm: array tasks at once).")
    flags.DEFINE_integer("workers", 1, "Each trial runs as a local worker group of this many "
                                       "processes (python -m launch.multiworker).")
    flags.DEFINE_bool("one", False, "Run a single trial (one to resume first, else a new "
                                    "one) and exit: what each Slurm array task runs.")
    flags.DEFINE_string("emit", "", "'slurm': print the sweep as an sbatch job array (one "
                                    "trial per array task) instead of running it.")
    flags.DEFINE_string("storage", "", "Optuna storage: a SQLAlchemy URL or journal:///PATH "
                                       "(default sqlite:///WORKDIR/study.db).")
    flags.DEFINE_string("study", "", "The study's name (default: WORKDIR's base name).")
    flags.DEFINE_bool("status", False, "Print the status table of --workdir's sweep and "
                                       "write its best_config.json; runs nothing.")
    flags.DEFINE_bool("traceback", False, "Also print the Python traceback of a user error "
                                          "(or set TF_TRAINER_TRACEBACK=1).")
    app.run(lambda argv: errors.call(main, argv),
            flags_parser=lambda argv: cli.parse_flags(argv, OWN_FLAGS, PROGRAM))
