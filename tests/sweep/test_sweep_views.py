"""A sweep as TensorBoard's HParams dashboard and MLflow show it: one real two-trial sweep
of the digits demo with every logger on, read back by TensorBoard's own HParams plugin
(over its event multiplexer) and from a real MLflow tracking store (SQLite); run again,
it reopens the same parent run. A resumed trial gets its own child run again."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from tests.sweep.runs import TINY, sweep
from trainer.sweep import mlflow_runs, study

LOGGERS = '--config.telemetry.loggers=("jsonl", "tensorboard", "mlflow")'
EXPERIMENT = "sweep-views"


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """``(root, MLflow client, {trial: its run's config}, {trial: its last eval record})``
    of a finished two-trial sweep that was then run once more (its store's experiment
    EXPERIMENT; the Default experiment is left to other tests)."""
    tmp = tmp_path_factory.mktemp("views")
    root = tmp / "digits"
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
           "MLFLOW_EXPERIMENT_NAME": EXPERIMENT}
    flags = (f"--workdir={root}", "--trials=2", "--parallel=2", *TINY, LOGGERS)
    for _ in range(2):  # the second run finds every trial done: it only reopens the parent
        run = sweep(*flags, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
    configs, evals = {}, {}
    for number in ("0000", "0001"):
        trial = root / "trials" / number
        configs[number] = json.loads((trial / "config.json").read_text())
        records = [json.loads(line) for line in (trial / "metrics.jsonl").open()]
        evals[number] = [r for r in records if r["kind"] == "eval"][-1]
    return root, MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"]), configs, evals


def hparams_dashboard(root):
    """What TensorBoard's HParams plugin serves for ``tensorboard --logdir ROOT``: the
    experiment and the session groups (its own handlers over its event multiplexer)."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import (api_pb2, backend_context, get_experiment,
                                             list_session_groups)

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(root))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(root))
    backend = backend_context.Context(base_plugin.TBContext(data_provider=provider,
                                                            logdir=str(root)))
    request = context.RequestContext()
    experiment = get_experiment.Handler(request, backend, "",
                                        api_pb2.GetExperimentRequest()).run()
    groups = list_session_groups.Handler(request, backend, "", api_pb2.ListSessionGroupsRequest(
        start_index=0, slice_size=100, allowed_statuses=[api_pb2.STATUS_UNKNOWN])).run()
    return experiment, groups.session_groups


def test_tensorboard_shows_every_trial_in_the_hparams_dashboard(swept):
    root, _, configs, evals = swept
    experiment, groups = hparams_dashboard(root)
    infos = {h.name: h for h in experiment.hparam_infos}
    assert sorted(infos) == ["model.hidden", "optimizer.learning_rate",
                             "train.global_batch_size"]
    interval = infos["optimizer.learning_rate"].domain_interval
    assert (interval.min_value, interval.max_value) == (1e-4, 3e-2)
    assert [v.number_value for v in infos["model.hidden"].domain_discrete.values] == [32, 64, 128]
    metrics = [f"{m.name.group}/{m.name.tag}" for m in experiment.metric_infos]
    assert metrics[0] == "eval/accuracy" and {"eval/loss", "train/loss"} <= set(metrics)
    assert sorted(g.name for g in groups) == ["0000", "0001"]
    for group in groups:
        config = configs[group.name]
        assert [s.name for s in group.sessions] == [f"trials/{group.name}"]
        hparams = {k: v.number_value for k, v in group.hparams.items()}
        assert hparams == {"optimizer.learning_rate": config["optimizer"]["learning_rate"],
                           "model.hidden": config["model"]["hidden"],
                           "train.global_batch_size": config["train"]["global_batch_size"]}
        values = {f"{m.name.group}/{m.name.tag}": m for m in group.metric_values}
        assert values["eval/accuracy"].value == pytest.approx(
            evals[group.name]["eval/accuracy"], rel=1e-6)
        assert values["eval/accuracy"].training_step == 100


def _runs(client):
    experiment = client.get_experiment_by_name(EXPERIMENT)
    return client.search_runs([experiment.experiment_id])


def test_mlflow_holds_one_parent_run_and_a_child_run_per_trial(swept):
    root, client, configs, evals = swept
    runs = _runs(client)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(runs) == 3 and len(parents) == 1  # the second sweep reopened the same parent
    parent = parents[0]
    assert (parent.info.run_name, parent.info.status) == (root.name, "FINISHED")
    assert parent.data.params["sweep.metric"] == "eval/accuracy"
    assert parent.data.params["space.model.hidden"] == "choice(32, 64, 128)"
    children = {r.info.run_name: r for r in runs if r is not parent}
    assert sorted(children) == ["trial 0000", "trial 0001"]
    for name, child in children.items():
        number = name.split()[1]
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.info.status == "FINISHED"
        assert child.data.params["optimizer.learning_rate"] == str(
            configs[number]["optimizer"]["learning_rate"])
        assert child.data.params["model.hidden"] == str(configs[number]["model"]["hidden"])
        assert child.data.metrics["eval/accuracy"] == pytest.approx(
            evals[number]["eval/accuracy"], rel=1e-6)
    accuracy = {n.split()[1]: c.data.metrics["eval/accuracy"] for n, c in children.items()}
    best = max(accuracy, key=accuracy.get)
    assert parent.data.metrics["eval/accuracy"] == accuracy[best]
    assert parent.data.tags["best_trial"] == best
    assert parent.data.tags["best_run_id"] == children[f"trial {best}"].info.run_id


def test_a_resumed_trial_and_a_resumed_sweep_log_to_the_same_runs(swept, tmp_path):
    """Each start of a trial (a resume too), and each new sweep process on the study, get
    the same child run and parent run back: nothing new is created in the store."""
    client = swept[1]
    uri = client.tracking_uri
    storage = study.open_storage(study.default_storage(str(tmp_path)))
    opened = study.Study.open(storage, "resumed", "maximize", ["model.hidden=choice(1, 2)"],
                              "eval/accuracy")
    number = opened.optuna.ask().number
    first = mlflow_runs.MlflowRuns(opened, {"sweep.metric": "eval/accuracy"}, uri)
    env = first.trial_starts(number, {"model.hidden": 1}, str(tmp_path / "0000"), False)
    assert env == first.trial_starts(number, {"model.hidden": 1}, str(tmp_path / "0000"), True)
    first.sweep_ends(143)  # preempted: the parent waits, KILLED
    assert client.get_run(first.parent).info.status == "KILLED"
    again = mlflow_runs.MlflowRuns(study.Study.load(storage, "resumed"), {}, uri)
    assert again.parent == first.parent
    assert client.get_run(first.parent).info.status == "RUNNING"
    assert again.trial_starts(number, {"model.hidden": 1}, "", True) == env
    child = client.get_run(env["MLFLOW_RUN_ID"])
    assert child.data.tags["mlflow.parentRunId"] == first.parent
    assert len(client.search_runs([child.info.experiment_id])) == 2
