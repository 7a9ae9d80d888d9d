"""A sweep in MLflow: one parent run for the study, each trial's run a child of it.

When ``config.telemetry.loggers`` has ``"mlflow"``, the sweep talks to the tracking
store the trials' own MLflow logger uses (``MLFLOW_TRACKING_URI``, MLflow's default when
unset; the experiment ``MLFLOW_EXPERIMENT_ID`` / ``MLFLOW_EXPERIMENT_NAME``, else
MLflow's Default):

* the *parent run*, named after the study, created once (its id kept as the study's user
  attribute ``mlflow_run``; a later run of the sweep reopens it): the ``sweep`` section's
  settings and the space as params (``sweep.metric``, ``space.optimizer.learning_rate =
  log(0.0001, 0.03)``...); at the end of each run of the sweep, the best value as the
  metric ``config.sweep.metric`` (at step = the trials completed), the tags
  ``best_trial`` and ``best_run_id``, and its status: FINISHED, KILLED when trials are
  left to resume (RUNNING again when the sweep resumes), FAILED after an error;
* a *child run* per trial, ``trial NNNN`` (tags ``mlflow.parentRunId`` and
  ``sweep.trial``), created when the trial first starts (its id kept as the trial's
  user attribute ``mlflow_run``); the trial's process gets ``MLFLOW_RUN_ID`` (and the
  tracking URI), so its ``trainer.main`` logs into that run, resumed, as MLflow's
  ``start_run`` does with that variable: its config as params (the swept values among
  them), its records as metrics, its status. A resumed trial gets the same run again.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from tf_cluster.exit_codes import EXIT_PREEMPTED
from trainer.sweep.status import best
from trainer.sweep.study import Study

RUN_ATTR = "mlflow_run"
SETTINGS = ("metric", "direction", "pruner", "max_retries")


def study_params(sweep_section: Any, signature: list[str]) -> dict[str, str]:
    """The parent run's params: ``sweep.SETTING`` for :data:`SETTINGS`, and the space
    (``space.KEY`` = ``DIST(ARGS)`` per string of ``sweep.space``, or ``space`` = where
    its ``search_space(trial)`` is)."""
    params = {f"sweep.{name}": str(sweep_section[name]) for name in SETTINGS}
    for text in signature:
        key, equals, dist = text.partition("=")
        if equals and "(" not in key:
            params[f"space.{key.strip()}"] = dist.strip()
        else:
            params["space"] = text
    return params


def _experiment_id(client) -> str:
    """MLflow's own choice of experiment for a new run, from its environment variables."""
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if not name:
        return "0"  # MLflow's Default experiment
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found is not None else client.create_experiment(name)


class MlflowRuns:
    """The study's parent run and its trials' child runs (see the module docstring).

    Args:
      study: the sweep's study (where the run ids are kept).
      params: the parent run's params (:func:`study_params`), logged when it is created.
      tracking_uri: the tracking store (default: MLflow's, ``MLFLOW_TRACKING_URI``).
    """

    def __init__(self, study: Study, params: dict[str, str], tracking_uri: str | None = None):
        import mlflow  # optional dependency (pip install 'tf-trainer[mlflow]')
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.study, self.uri = study, tracking_uri or mlflow.get_tracking_uri()
        self.client = MlflowClient(tracking_uri=self.uri)
        self.lock = threading.Lock()
        self.parent = study.optuna.user_attrs.get(RUN_ATTR)
        if self.parent is None:
            self.experiment = _experiment_id(self.client)
            run = self.client.create_run(self.experiment, run_name=study.name,
                                         tags={"sweep.study": study.name})
            self.parent = run.info.run_id
            self.client.log_batch(self.parent, params=[
                Param(k, v) for k, v in params.items()])
            study.optuna.set_user_attr(RUN_ATTR, self.parent)
        else:
            self.experiment = self.client.get_run(self.parent).info.experiment_id
            self.client.update_run(self.parent, status="RUNNING")

    def trial_starts(self, number: int, values: dict[str, Any], workdir: str,
                     resumed: bool) -> dict[str, str]:
        """The trial's child run (created the first time): its environment variables."""
        with self.lock:
            run_id = self.study.trial(number).user_attrs.get(RUN_ATTR)
            if run_id is None:
                run = self.client.create_run(
                    self.experiment, run_name=f"trial {number:04d}",
                    tags={"mlflow.parentRunId": self.parent, "sweep.trial": f"{number:04d}"})
                run_id = run.info.run_id
                self.study.set(number, mlflow_run=run_id)
        return {"MLFLOW_RUN_ID": run_id, "MLFLOW_TRACKING_URI": self.uri}

    def trial_completed(self, number: int, results: dict[str, float]) -> None:
        """Nothing: the trial's own run logged its values and its end."""

    def sweep_ends(self, code: int) -> None:
        """The best value and trial on the parent run, and its status for ``code`` (0:
        FINISHED; 143: KILLED, trials left to resume; else FAILED)."""
        top = best(self.study)
        if top is not None:
            done = sum(1 for t in self.study.trials() if t.state.name == "COMPLETE")
            metric = self.study.optuna.user_attrs.get("metric", "value")
            self.client.log_metric(self.parent, metric, top.value, step=done)
            self.client.set_tag(self.parent, "best_trial", f"{top.number:04d}")
            self.client.set_tag(self.parent, "best_run_id", top.user_attrs.get(RUN_ATTR, ""))
        status = {0: "FINISHED", EXIT_PREEMPTED: "KILLED"}.get(code, "FAILED")
        self.client.set_terminated(self.parent, status=status)
