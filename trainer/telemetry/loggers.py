"""Experiment loggers beyond the run's own files: MLflow.

``config.telemetry.loggers`` names where the telemetry records go: ``"jsonl"``
(``workdir/metrics.jsonl``) and ``"tensorboard"`` (``workdir/train``, ``workdir/eval``)
are written by :mod:`trainer.telemetry.summaries`; ``"mlflow"`` by :class:`MlflowLogger`
(``pip install 'tf-trainer[mlflow]'``). A logger is a service
(:class:`trainer.run_context.Service`, for the run's lifecycle) and a *sink* of
:class:`trainer.telemetry.service.Telemetry`: it gets every train and eval record
Telemetry builds, the same one metrics.jsonl holds.

MLflow, as MLflow users expect: the tracking store is ``MLFLOW_TRACKING_URI`` (MLflow's
default when unset), the experiment ``MLFLOW_EXPERIMENT_NAME`` / ``MLFLOW_EXPERIMENT_ID``;
a run already active in the process (``with mlflow.start_run(): run.fit()``) is
used and left open, otherwise the logger starts one (named after the workdir; or
resumes, with its name, the run ``MLFLOW_RUN_ID`` names: ``python -m trainer.sweep``
gives each trial its child run so) at the first ``fit()``, resumes it at a later
``fit()`` of the same Trainer and ends it at the end of each ``fit()`` (FINISHED;
FAILED when ``fit()`` raised; KILLED on preemption).
Only the chief logs. What is logged:

* params: the whole config, flattened (``train.steps``, ``optimizer.name``...), once
  per run;
* metrics: every numeric value of every record at its step (``train/loss``,
  ``perf/examples_per_s``, ``train/mfu``, ``eval/accuracy``...); nulls and text (the
  alert message) are left out, booleans are logged as 0/1;
* tags: ``workdir``, and ``final_checkpoint_step``, the step of the last checkpoint the
  run wrote (set when ``fit()`` ends).
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections
from absl import logging

from tf_cluster.storage_schemes import is_local
from trainer.run_context import RunContext, Service

_NOT_METRICS = ("kind", "step", "time")


def flatten_config(config: ml_collections.ConfigDict) -> dict[str, str]:
    """``{"section.field": str(value)}`` of a config, nested sections joined by dots."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, (ml_collections.ConfigDict, dict)):
            for key in value:
                walk(f"{prefix}.{key}" if prefix else str(key), value[key])
        else:
            flat[prefix] = str(value)

    walk("", config)
    return flat


def record_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a telemetry record, as floats (booleans as 0/1)."""
    return {k: float(v) for k, v in record.items()
            if k not in _NOT_METRICS and isinstance(v, (int, float))}


class MlflowLogger(Service):
    """Logs the run's config, telemetry records and final checkpoint step to MLflow.

    See the module docstring. Hooks run on every worker; only the chief talks to MLflow.

    Args:
      config: the run's config (logged as params).
    """

    def __init__(self, config: ml_collections.ConfigDict):
        self.config = config
        self.run_id: str | None = None  # the MLflow run this Trainer logs to
        self._mlflow: Any = None  # the module, on the chief during fit()
        self._own_run = False  # started here (so ended here)
        self._trained = False
        self._checkpoint_step: int | None = None
        self._write_failed = False

    def on_fit_start(self, run: RunContext) -> None:
        if not run.is_chief:
            return
        import mlflow  # optional dependency (pip install 'tf-trainer[mlflow]')

        self._mlflow, self._trained = mlflow, False
        active = mlflow.active_run()
        if active is not None:
            self._own_run, new = False, active.info.run_id != self.run_id
            self.run_id = active.info.run_id
        else:
            # MLFLOW_RUN_ID names a run to resume (a sweep's child run): it keeps its name.
            name = (os.path.basename(os.path.normpath(run.workdir))
                    if run.workdir and not self.run_id and not os.environ.get("MLFLOW_RUN_ID")
                    else None)
            started = mlflow.start_run(run_id=self.run_id, run_name=name)
            self._own_run, new = True, self.run_id is None
            self.run_id = started.info.run_id
        if new:
            mlflow.log_params(flatten_config(self.config))
            if run.workdir:
                mlflow.set_tag("workdir", run.workdir if not is_local(run.workdir)
                               else os.path.abspath(run.workdir))
        logging.info("MLflow: logging to run %s at %s", self.run_id, mlflow.get_tracking_uri())

    def write(self, record: dict[str, Any]) -> None:
        """Telemetry sink: logs the record's numeric values at its step (chief only). A
        write that fails warns once and the run goes on without MLflow records."""
        if self._mlflow is not None and not self._write_failed:
            try:
                self._mlflow.log_metrics(record_metrics(record), step=int(record["step"]),
                                         run_id=self.run_id)
            except Exception as error:  # noqa: BLE001 - telemetry never ends a run
                self._write_failed = True
                logging.warning("Cannot log to MLflow run %s (%s: %s); the run goes on "
                                "without MLflow records.", self.run_id,
                                type(error).__name__, str(error)[:300])

    def on_checkpoint(self, run: RunContext, step: int) -> None:
        self._checkpoint_step = step

    def on_train_end(self, run: RunContext) -> None:
        self._trained = True

    def on_fit_end(self, run: RunContext, logs: dict[str, float]) -> None:
        mlflow, self._mlflow = self._mlflow, None
        if mlflow is None:
            return
        if self._checkpoint_step is not None:
            mlflow.set_tag("final_checkpoint_step", str(self._checkpoint_step))
        if self._own_run:
            status = ("KILLED" if run.stopped_by == "preemption"
                      else "FINISHED" if self._trained else "FAILED")
            mlflow.end_run(status=status)


def build_loggers(config: ml_collections.ConfigDict) -> list[Service]:
    """The logger callbacks ``telemetry.loggers`` asks for beyond jsonl/tensorboard."""
    return [MlflowLogger(config)] if "mlflow" in config.telemetry.loggers else []
