"""Experiment loggers (telemetry.loggers): jsonl / tensorboard selection and MLflow
against a real local tracking store (SQLite)."""

from __future__ import annotations

import json
import sys
import types

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from tests.support import toy
from trainer import config as config_lib
from trainer.telemetry import loggers


def _config(**overrides):
    return toy.toy_config(**{"train.steps": 20, "eval.every_steps": 10,
                             "checkpoint.every_steps": 10, "telemetry.progress": "off",
                             "telemetry.probe_every_windows": 0, **overrides})


@pytest.fixture(scope="module")
def mlflow_run(tmp_path_factory):
    """ToyEvalTrainer, 20 steps, with MLFLOW_TRACKING_URI at a fresh SQLite store."""
    tmp = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        patch.setenv("MLFLOW_EXPERIMENT_NAME", "tf-trainer-test")
        config = _config(**{"telemetry.loggers": ("jsonl", "tensorboard", "mlflow")})
        toy.ToyEvalTrainer(config, str(tmp / "workdir")).fit()
        assert mlflow.active_run() is None  # the logger ended the run it started
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("tf-trainer-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    lines = (tmp / "workdir" / "metrics.jsonl").read_text().splitlines()
    return client, runs[0], [json.loads(line) for line in lines]


def test_mlflow_holds_the_config_as_params(mlflow_run):
    _, run, _ = mlflow_run
    params = run.data.params
    assert params["train.steps"] == "20"
    assert params["optimizer.name"] == "sgd"
    assert params["telemetry.loggers"] == "('jsonl', 'tensorboard', 'mlflow')"
    assert {"trainer", "seed", "train.global_batch_size", "checkpoint.every_steps",
            "telemetry.peak_tflops"} <= set(params)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "workdir"


def test_mlflow_metrics_by_step_equal_metrics_jsonl(mlflow_run):
    client, run, records = mlflow_run
    for kind, key in (("train", "train/loss"), ("train", "perf/examples_per_s"),
                      ("train", "train/flops_per_example"), ("eval", "eval/accuracy")):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        expected = {r["step"]: r[key] for r in records if r["kind"] == kind}
        assert sorted(history) == [10, 20], key
        for step, value in expected.items():
            assert history[step] == pytest.approx(value, rel=1e-6), (key, step)
    assert "alert" not in run.data.metrics  # text, not a metric


def test_mlflow_tags_the_final_checkpoint_step(mlflow_run):
    _, run, _ = mlflow_run
    assert run.data.tags["final_checkpoint_step"] == "20"
    assert run.data.tags["workdir"].endswith("workdir")


@pytest.mark.parametrize("names, present, absent", [
    (("jsonl",), ["metrics.jsonl"], ["train", "eval"]),
    (("tensorboard",), ["train"], ["metrics.jsonl"]),
])
def test_loggers_choose_the_files(tmp_path, names, present, absent):
    config = _config(**{"train.steps": 10, "eval.every_steps": 0,
                        "telemetry.loggers": names})
    toy.ToyTrainer(config, str(tmp_path)).fit()
    for name in present:
        assert (tmp_path / name).exists(), name
    for name in absent:
        assert not (tmp_path / name).exists(), name


def test_unknown_logger_is_a_config_error_naming_the_valid_ones():
    with pytest.raises(config_lib.ConfigError, match="'jsonl', 'tensorboard', 'mlflow'"):
        config_lib.validate(_config(**{"telemetry.loggers": ("jsonl", "mlflwo")}))


def test_mlflow_requested_but_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what an absent package looks like
    with pytest.raises(config_lib.ConfigError, match=r"pip install 'tf-trainer\[mlflow\]'"):
        config_lib.validate(_config(**{"telemetry.loggers": ("jsonl", "mlflow")}))


def test_only_the_chief_logs_to_mlflow(tmp_path, monkeypatch):
    """A non-chief worker's logger never opens a run nor logs (its hooks are no-ops)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    config = _config(**{"telemetry.loggers": ("mlflow",)})
    worker = types.SimpleNamespace(is_chief=False, workdir=str(tmp_path), stopped_by=None)
    logger = loggers.MlflowLogger(config)
    logger.on_fit_start(worker)
    logger.write({"kind": "train", "step": 10, "time": 0.0, "train/loss": 1.0})
    logger.on_checkpoint(worker, 10)
    logger.on_train_end(worker)
    logger.on_fit_end(worker, {})
    assert logger.run_id is None and mlflow.active_run() is None
    assert MlflowClient(tracking_uri=uri).search_runs(
        [e.experiment_id for e in MlflowClient(tracking_uri=uri).search_experiments()]) == []


def test_a_fit_whose_start_fails_ends_the_mlflow_run_it_opened(tmp_path, monkeypatch):
    """Early stopping's check fails in on_fit_start AFTER the MLflow logger opened its
    run: the run is ended (FAILED), not left RUNNING, and the ConfigError propagates."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "failed-start")
    config = _config(**{"telemetry.loggers": ("jsonl", "mlflow"),
                        "train.early_stopping.metric": "eval/nope"})
    with pytest.raises(config_lib.ConfigError, match="eval/nope"):
        toy.ToyEvalTrainer(config, str(tmp_path / "workdir")).fit()
    assert mlflow.active_run() is None
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("failed-start").experiment_id])
    assert run.info.status == "FAILED"
