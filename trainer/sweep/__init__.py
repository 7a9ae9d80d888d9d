"""Hyperparameter sweeps: ``python -m trainer.sweep``, an Optuna study whose trials are
ordinary ``trainer.main`` runs (docs/sweeps.md). No TensorFlow: it starts processes.

* :mod:`trainer.sweep.cli` — the command line: flags, config, checks, then the sweep or
  ``--status``.
* :mod:`trainer.sweep.settings` — the ``sweep`` section's values, checked.
* :mod:`trainer.sweep.space` — ``config.sweep.space``'s ``"KEY=DIST(ARGS)"`` strings, or
  the config file's ``search_space(trial)``, checked against the config.
* :mod:`trainer.sweep.study` — the storage, the study and what each trial keeps in it;
  which trials are preempted or stale.
* :mod:`trainer.sweep.trials` — one trial's ``python -m trainer.main`` process and what
  it reported.
* :mod:`trainer.sweep.runner` — trials P at a time (ask/tell), resumes, retries, signals,
  the progress line.
* :mod:`trainer.sweep.status` — the status table and ``best_config.json``.
* :mod:`trainer.sweep.hparams` — the sweep in TensorBoard's HParams dashboard.
* :mod:`trainer.sweep.mlflow_runs` — the sweep in MLflow: a parent run, a child per trial.
"""

__all__ = ["cli", "hparams", "mlflow_runs", "runner", "settings", "space", "status", "study",
           "trials"]
