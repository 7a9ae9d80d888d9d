"""The ``sweep`` section's values, checked before a trial starts (one ConfigError each).

``trainer.config.validate`` checks that the section holds only its keys; its values are
read only by ``python -m trainer.sweep``, so they are checked here:

* ``sweep.metric``: required, a value a run reports (``eval/NAME`` or ``train/NAME``);
* ``sweep.direction``: ``maximize`` or ``minimize``;
* ``sweep.pruner``: ``none``, ``median``, ``halving``, ``hyperband``
  (:mod:`trainer.services.pruning`); a pruner judges the evaluations during training, so
  it needs ``eval.every_steps > 0`` and an ``eval/`` metric;
  ``sweep.pruner_startup_trials`` and ``sweep.pruner_warmup_steps``: integers >= 0;
* ``sweep.seed``: the sampler's seed (an integer: the ConfigDict holds its type);
* ``sweep.max_retries``: an integer >= 0;
* ``sweep.trial``, ``sweep.storage``, ``sweep.study``: left unset (-1, ""): the sweep
  sets them on each trial's command itself;
* a space: ``sweep.space`` or the config file's ``search_space(trial)``, not both.
"""

from __future__ import annotations

from typing import Callable

import ml_collections

from trainer.config import ConfigError
from trainer.errors import check_choice, check_positive
from trainer.services.pruning import PRUNERS

DIRECTIONS = ("maximize", "minimize")


def check_section(config: ml_collections.ConfigDict, search_space: Callable | None,
                  config_path: str) -> None:
    """Raises ConfigError for the first wrong value of ``config.sweep``."""
    sweep = config.sweep
    metric = sweep.metric
    if not metric:
        raise ConfigError("config.sweep.metric is empty: name the value to optimize, e.g. "
                          "--config.sweep.metric=eval/accuracy (a value the run reports).")
    if not (isinstance(metric, str) and metric.partition("/")[0] in ("train", "eval")
            and metric.partition("/")[2]):
        raise ConfigError(f"config.sweep.metric={metric!r} must name a value a run reports: "
                          f"'eval/NAME' or 'train/NAME', e.g. 'eval/accuracy'.")
    check_choice("sweep.direction", sweep.direction, DIRECTIONS)
    check_choice("sweep.pruner", sweep.pruner, PRUNERS)
    _check_pruner(config)
    check_positive("sweep.max_retries", sweep.max_retries, allow_zero=True)
    if (sweep.trial, sweep.storage, sweep.study) != (-1, "", ""):
        raise ConfigError("config.sweep.trial, storage and study are set by the sweep on "
                          "each trial's command; leave them unset (-1, '').")
    if search_space is not None and sweep.space:
        raise ConfigError(f"{config_path} defines search_space(trial) and config.sweep.space "
                          f"is set too: keep one of them.")
    if search_space is None and not sweep.space:
        raise ConfigError(f"nothing to sweep: set config.sweep.space, e.g. "
                          f"--config.sweep.space='(\"optimizer.learning_rate=log(1e-4, "
                          f"3e-2)\",)', or define search_space(trial) in {config_path}.")


def _check_pruner(config: ml_collections.ConfigDict) -> None:
    sweep = config.sweep
    check_positive("sweep.pruner_startup_trials", sweep.pruner_startup_trials, allow_zero=True)
    check_positive("sweep.pruner_warmup_steps", sweep.pruner_warmup_steps, allow_zero=True)
    if sweep.pruner == "none":
        return
    field = f"config.sweep.pruner={sweep.pruner!r}"
    if config.eval.every_steps <= 0:
        raise ConfigError(f"{field} judges the evaluations during training, but "
                          f"eval.every_steps={config.eval.every_steps} evaluates only at "
                          f"the end; set --config.eval.every_steps=N (N < train.steps), or "
                          f"sweep.pruner='none'.")
    if not sweep.metric.startswith("eval/"):
        raise ConfigError(f"{field} judges the evaluations: config.sweep.metric="
                          f"{sweep.metric!r} must be an 'eval/NAME' value.")
