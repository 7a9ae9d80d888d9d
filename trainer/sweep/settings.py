"""The ``sweep`` section's values, checked before a trial starts (one ConfigError each).

``trainer.config.validate`` checks that the section holds only its keys; its values are
read only by ``python -m trainer.sweep``, so they are checked here:

* ``sweep.metric``: required, a value a run reports (``eval/NAME`` or ``train/NAME``);
* ``sweep.direction``: ``maximize`` or ``minimize``;
* ``sweep.pruner``: the schema names ``none``, ``median``, ``halving``, ``hyperband``;
  pruning is not built yet, so a sweep refuses any but ``none`` (:data:`BUILT_PRUNERS`);
* ``sweep.max_retries``: an integer >= 0;
* a space: ``sweep.space`` or the config file's ``search_space(trial)``, not both.
"""

from __future__ import annotations

from typing import Callable

import ml_collections

from trainer.config import ConfigError
from trainer.errors import check_choice, check_positive

DIRECTIONS = ("maximize", "minimize")
PRUNERS = ("none", "median", "halving", "hyperband")
BUILT_PRUNERS = ("none",)


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
    if sweep.pruner not in BUILT_PRUNERS:
        raise ConfigError(f"config.sweep.pruner={sweep.pruner!r}: pruning is not built yet; "
                          f"use 'none' (trials run to config.train.steps).")
    check_positive("sweep.max_retries", sweep.max_retries, allow_zero=True)
    if search_space is not None and sweep.space:
        raise ConfigError(f"{config_path} defines search_space(trial) and config.sweep.space "
                          f"is set too: keep one of them.")
    if search_space is None and not sweep.space:
        raise ConfigError(f"nothing to sweep: set config.sweep.space, e.g. "
                          f"--config.sweep.space='(\"optimizer.learning_rate=log(1e-4, "
                          f"3e-2)\",)', or define search_space(trial) in {config_path}.")
