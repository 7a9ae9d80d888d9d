"""Pruning a sweep's trial: ``config.sweep.pruner`` (a service).

``python -m trainer.sweep`` with a pruner adds ``--config.sweep.trial=N``,
``--config.sweep.storage=URL`` and ``--config.sweep.study=NAME`` to the command of each
trial it runs: the run then reports its evaluations to trial N of that Optuna study. Any
other run (``sweep.trial=-1``: a run typed by hand, or the trial's printed command, which
reproduces it without these flags) reports nothing and is never pruned.

After each evaluation before ``train.steps``, the chief, and only the chief (no other
worker opens the storage), reports ``config.sweep.metric`` at the run's step
(``optuna.trial.Trial.report``) and asks the pruner (``should_prune``). When it says
prune, the chief writes the step in the trial's ``pruned`` attribute and asks for a stop
(``run.request_stop``): the flag is all-reduced after the boundary's hooks, so every
worker stops at that step, the final checkpoint is written and the run ends normally,
exit status 0 with its ``result:`` line. The sweep, seeing ``pruned``, tells the trial
PRUNED: Optuna keeps its last reported value. An evaluation after the run stopped (the
final one of a preempted run) is not reported.

The pruners (:func:`make_pruner`), their resource being the global step:

* ``median``: Optuna's ``MedianPruner``: prunes a trial whose value is worse than the
  median of the other trials' at the same step, once ``sweep.pruner_startup_trials``
  trials completed, from step ``sweep.pruner_warmup_steps`` on;
* ``halving``: ``SuccessiveHalvingPruner``: rungs at ``r * 3**k`` steps, ``r`` the
  first evaluation at or after the warmup; a trial goes on past a rung when it is in the
  best third of the trials that reached it;
* ``hyperband``: ``HyperbandPruner``: brackets of successive halving from ``r`` to
  ``train.steps``, reduction factor 3.

Mistakes the same for every trial (no evaluation to judge, a metric the evaluation does
not produce) raise :class:`PruningError` in ``on_fit_start``, before any step, on every
worker: exit status 2, which ends the sweep with that line.
"""

from __future__ import annotations

from typing import Any

from trainer.config import ConfigError
from trainer.errors import EXIT_USAGE, UserError, first_line
from trainer.run_context import RunContext, Service
from trainer.runtime import studies

PRUNERS = ("none", "median", "halving", "hyperband")
REDUCTION_FACTOR = 3


class PruningError(ConfigError):
    """The pruner has nothing to judge (no evaluation, or not of the metric): the same
    for every trial, so exit status 2 (the sweep ends with this line, no retry)."""

    exit_code = EXIT_USAGE


def _optuna():
    """Optuna (the ``[sweep]`` extra, loaded only by a sweep's trials), or one line."""
    try:
        import optuna
    except ImportError as error:
        raise UserError("config.sweep.pruner needs Optuna, which is not installed: "
                        "pip install 'tf-trainer[sweep]'.") from error
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def make_pruner(sweep: Any, eval_every: int, train_steps: int):
    """The Optuna pruner ``sweep.pruner`` names (see the module docstring)."""
    optuna = _optuna()
    first = max(eval_every, -(-sweep.pruner_warmup_steps // eval_every) * eval_every)
    if sweep.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=sweep.pruner_startup_trials,
                                           n_warmup_steps=sweep.pruner_warmup_steps)
    if sweep.pruner == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=first,
                                                      reduction_factor=REDUCTION_FACTOR)
    return optuna.pruners.HyperbandPruner(min_resource=first, max_resource=train_steps,
                                          reduction_factor=REDUCTION_FACTOR)


def open_trial(sweep: Any, pruner) -> tuple[Any, set[int]]:
    """Optuna's ``Trial`` ``sweep.trial`` of ``sweep.study`` in ``sweep.storage``, its study
    holding ``pruner``, and the steps it was given values for (by an earlier run of a
    resumed trial); raises a one-line UserError when it cannot be opened or is finished."""
    optuna = _optuna()
    url = sweep.storage
    try:
        storage = studies.open_storage(url)
        study = optuna.load_study(study_name=sweep.study, storage=storage, pruner=pruner)
        trial_id = storage.get_trial_id_from_study_id_trial_number(
            storage.get_study_id_from_name(sweep.study), sweep.trial)
    except Exception as error:  # noqa: BLE001 - storage, driver, no such study or trial
        first = first_line(error)
        raise UserError(f"config.sweep.trial={sweep.trial} of study {sweep.study!r} in "
                        f"{url} cannot be opened to report to: {first}. These flags are "
                        f"the sweep's; a run by hand leaves sweep.trial at -1.") from error
    frozen = storage.get_trial(trial_id)
    if frozen.state.is_finished():
        raise UserError(f"config.sweep.trial={sweep.trial} of study {sweep.study!r} is "
                        f"{frozen.state.name}: a finished trial takes no reports; run "
                        f"without --config.sweep.trial.")
    return optuna.trial.Trial(study, trial_id), set(frozen.intermediate_values)


class Pruning(Service):
    """Reports each evaluation to the sweep's trial; stops the run when it is pruned."""

    def __init__(self, config):
        self.sweep = config.sweep
        self.active = config.sweep.pruner != "none" and config.sweep.trial >= 0
        self.metric, self.total = config.sweep.metric, config.train.steps
        self.eval_every = config.eval.every_steps
        self.trial = None  # the chief's Optuna Trial, once fit() started
        self.reported: set[int] = set()  # the steps the trial holds a value for

    def on_fit_start(self, run: RunContext) -> None:
        if not self.active:
            return
        field = f"config.sweep.pruner={self.sweep.pruner!r}"
        if not run.has_eval_dataset or self.eval_every <= 0:
            raise PruningError(f"{field} judges the evaluations during training, but "
                               f"{run.trainer_name} has no eval dataset or "
                               f"eval.every_steps={self.eval_every}; give it both, or set "
                               f"sweep.pruner='none'.")
        produced = sorted({"eval/loss", *(f"eval/{name}" for name in run.eval_metric_names)})
        if self.metric not in produced:
            raise PruningError(f"{field}: config.sweep.metric={self.metric!r} is not among "
                               f"the evaluation's values ({', '.join(produced)}); use one "
                               f"of them.")
        if run.is_chief and self.trial is None:
            pruner = make_pruner(self.sweep, self.eval_every, self.total)
            self.trial, self.reported = open_trial(self.sweep, pruner)

    def on_eval_end(self, run: RunContext, logs: dict[str, float]) -> None:
        if self.trial is None or run.step >= self.total or run.stopped_by is not None:
            return
        value, step = float(logs[self.metric]), run.step
        if step not in self.reported:  # a resumed run evaluates some steps again
            self.trial.report(value, step)
            self.reported.add(step)
        if self.trial.should_prune():
            self.trial.set_user_attr("pruned", step)
            run.request_stop(f"pruned by the {self.sweep.pruner} pruner of sweep trial "
                             f"{self.sweep.trial}: {self.metric}={value:.6g} at step {step}")
