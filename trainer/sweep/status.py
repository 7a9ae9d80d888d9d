"""Looking at a sweep: the status table and ``DIR/best_config.json``.

The table has one row per trial: its number, state (COMPLETE, PRUNED, FAIL, RUNNING,
and PREEMPTED for a trial waiting to be resumed), the value of each swept key, the
metric (of a PRUNED trial: the last value its run reported), the step its run reached,
the seconds its runs took, and how often it was resumed; the failed trials' last lines
follow it. ``best_config.json`` holds the best COMPLETE trial:
its number, the metric and value, the values it set, the command that reproduces it,
and its run's whole config (``WORKDIR/config.json``, as ``trainer.main`` wrote it).
"""

from __future__ import annotations

import json
import os
from typing import Any

from trainer.sweep.study import Study, overrides_of, state_of
from trainer.sweep.trials import last_step

BEST_CONFIG = "best_config.json"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def rows(study: Study) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of the status table."""
    trials = study.trials()
    keys: list[str] = []
    for trial in trials:
        keys += [k for k in overrides_of(trial) if k not in keys]
    metric = study.optuna.user_attrs.get("metric", "value")
    header = ["trial", "state", *keys, metric, "step", "time_s", "resumed"]
    table = []
    for trial in trials:
        values = overrides_of(trial)
        attrs = trial.user_attrs
        state = state_of(trial)
        step = (attrs.get("step") if trial.state.is_finished()  # else: as far as it got
                else last_step(attrs.get("workdir") or "") or attrs.get("step"))
        table.append([f"{trial.number:04d}", state, *(_cell(values.get(k)) for k in keys),
                      _cell(trial.value), _cell(step), _cell(attrs.get("seconds")),
                      _cell(attrs.get("resumed", 0))])
    return header, table


def table(study: Study) -> str:
    """The status table as aligned text, then the failed trials' last lines."""
    header, body = rows(study)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
             for r in [header, *body]]
    failed = [t for t in study.trials() if state_of(t) == "FAIL"]
    lines += [f"trial {t.number:04d} failed: {t.user_attrs.get('error', '')}" for t in failed]
    if not body:
        lines.append("(no trials yet)")
    return "\n".join(lines)


def best(study: Study):
    """The best COMPLETE trial (None when none completed)."""
    done = [t for t in study.trials() if t.value is not None and state_of(t) == "COMPLETE"]
    if not done:
        return None
    pick = max if study.optuna.direction.name == "MAXIMIZE" else min
    return pick(done, key=lambda t: t.value)


def write_best(study: Study, root: str) -> str | None:
    """Writes ``ROOT/best_config.json`` (see the module docstring); returns its path, or
    None when no trial completed."""
    trial = best(study)
    if trial is None:
        return None
    attrs = trial.user_attrs
    config_json = os.path.join(attrs.get("workdir", ""), "config.json")
    try:
        with open(config_json) as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = None
    record = {"study": study.name, "trial": trial.number,
              "metric": study.optuna.user_attrs.get("metric"), "value": trial.value,
              "overrides": overrides_of(trial), "command": attrs.get("command"),
              "workdir": attrs.get("workdir"), "config": config}
    path = os.path.join(os.path.abspath(root), BEST_CONFIG)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
    os.replace(tmp, path)
    return path


def report(study: Study, root: str) -> str:
    """The table, and where the best config is (written now)."""
    path = write_best(study, root)
    top = best(study)
    tail = (f"\nbest: trial {top.number:04d} ({study.optuna.user_attrs.get('metric')}="
            f"{top.value:.6g}) -> {path}\n  {top.user_attrs.get('command')}"
            if top is not None else "\nbest: none yet (no trial completed)")
    return table(study) + tail
