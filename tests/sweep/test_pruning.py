"""Pruning: a trial's chief reports each evaluation to the study, the pruner's decision
stops every worker at one step, and the sweep marks the trial PRUNED with its last value
and step; the seeded sampler draws the same values for the same seed."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import optuna
import pytest

from models.configs import digits_sweep
from tests.support import toy
from tests.support.helpers import REPO, subprocess_env
from tests.sweep.runs import CONFIG, checkpoint_steps, status, sweep
from trainer.errors import EXIT_USAGE
from trainer.services.pruning import PruningError
from trainer.sweep import space
from trainer.sweep.study import Study, default_storage, open_storage

PRUNED_SWEEP = REPO / "tests" / "sweep" / "pruned_sweep.py"
#: The digits demo: 100 steps, an evaluation every 20, the median pruner from the first
#: completed trial on.
EVERY_20 = ("--config.train.steps=100", "--config.train.log_every_steps=50",
            "--config.eval.every_steps=20", "--config.sweep.pruner=median",
            "--config.sweep.pruner_startup_trials=1")


def eval_records(workdir) -> dict[int, float]:
    """``{step: eval/accuracy}`` of a run's metrics.jsonl."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
    return {r["step"]: r["eval/accuracy"] for r in records if r["kind"] == "eval"}


def test_a_trial_worse_than_the_median_is_pruned_at_its_first_evaluation(tmp_path):
    root = tmp_path / "pruned"
    run = sweep(f"--workdir={root}", "--trials=2", config=PRUNED_SWEEP)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = status(root)
    assert (rows["0000"]["state"], rows["0000"]["step"]) == ("COMPLETE", "100")
    assert (rows["0001"]["state"], rows["0001"]["step"]) == ("PRUNED", "20")
    pruned_dir = root / "trials" / "0001"
    first = eval_records(pruned_dir)
    assert sorted(first) == [20]  # stopped at its first evaluation
    assert float(rows["0001"]["eval/accuracy"]) == pytest.approx(first[20], rel=1e-3)
    assert f"trial 0001 pruned at step 20: eval/accuracy={first[20]:.6g}" in run.stderr
    assert checkpoint_steps(pruned_dir) == [20]  # the stop's final checkpoint
    # The trial's run reported to the study; its printed command does not, so it
    # reproduces the trial alone (to train.steps).
    assert "--config.sweep.trial=1 " in (root / "trials" / "0001.log").read_text()
    assert "--config.sweep.trial" not in run.stderr
    assert json.loads((root / "best_config.json").read_text())["trial"] == 0


def test_a_pruned_two_worker_trial_stops_every_worker_at_one_step(tmp_path):
    """Trial 1 of a study whose trial 0 scored 1.0 at every step is run as a local group
    of two workers: the chief's first evaluation is worse, so both stop there; the sweep
    then finds the trial pruned and marks it PRUNED without running it again."""
    root = tmp_path / "group"
    root.mkdir()
    config = digits_sweep.get_config()
    study = Study.open(open_storage(default_storage(root)), "group", "maximize",
                       list(config.sweep.space), "eval/accuracy")
    study.optuna.add_trial(optuna.trial.create_trial(
        state=optuna.trial.TrialState.COMPLETE, value=1.0,
        intermediate_values={step: 1.0 for step in range(20, 101, 20)}))
    number = study.optuna.ask().number
    workdir = root / "trials" / f"{number:04d}"
    command = [sys.executable, "-m", "launch.multiworker", "--workers", "2",
               f"--config={CONFIG}", f"--workdir={workdir}", *EVERY_20]
    study.set(number, workdir=str(workdir), command=shlex.join(command), overrides="{}",
              owner="")  # released, as a sweep that ended leaves it
    group = subprocess.run(
        [*command, f"--config.sweep.trial={number}",
         f"--config.sweep.storage={default_storage(root)}", "--config.sweep.study=group"],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=400)
    assert group.returncode == 0, group.stderr[-4000:]
    stops = dict(re.findall(r"\[(worker:\d)\][^\n]*training stopped at step (\d+): ", group.stderr))
    assert sorted(stops) == ["worker:0", "worker:1"], group.stderr[-4000:]
    assert len(set(stops.values())) == 1 and int(stops["worker:0"]) < 100
    assert "requested on another worker" in group.stderr  # worker 1 never judged
    step = int(stops["worker:0"])
    reported = study.trial(number).intermediate_values
    assert list(reported) == [step]  # one report per evaluation: the chief's
    ended = sweep(f"--workdir={root}", "--trials=2", *EVERY_20)
    assert ended.returncode == 0, ended.stderr[-3000:]
    assert f"trial 0001 pruned at step {step}" in ended.stderr
    assert "trial 0001 resumed" not in ended.stderr
    row = status(root)["0001"]
    assert (row["state"], row["step"], row["resumed"]) == ("PRUNED", str(step), "0")
    assert float(row["eval/accuracy"]) == pytest.approx(reported[step], rel=1e-3)


def test_the_seed_draws_the_same_values_whichever_sweep_process_asks(tmp_path):
    config = digits_sweep.get_config()
    sample = space.sampler(space.parse_space(config.sweep.space, config), None, config,
                           str(CONFIG))

    def asked(name: str, seed: int, reopen_after: int = 3) -> list[dict]:
        (tmp_path / name).mkdir()
        storage = open_storage(default_storage(tmp_path / name))
        values = []
        for i in range(3):
            if i == 0 or i == reopen_after:  # a sweep started again on the same study
                study = Study.open(storage, name, "maximize", list(config.sweep.space),
                                   "eval/accuracy")
            values.append(sample(study.ask(seed)))
        return values

    once = asked("a", seed=7)
    assert asked("b", seed=7) == once
    assert asked("c", seed=7, reopen_after=2) == once  # trial 2 is not trial 0 again
    assert len({json.dumps(v, sort_keys=True) for v in once}) == 3
    assert asked("d", seed=8) != once


@pytest.mark.parametrize("trainer_class, metric, says", [
    (toy.ToyTrainer, "eval/loss", "ToyTrainer has no eval dataset"),
    (toy.ToyEvalTrainer, "eval/precision",
     "config.sweep.metric='eval/precision' is not among the evaluation's values "
     "(eval/accuracy, eval/loss)"),
])
def test_a_trial_its_pruner_cannot_judge_ends_the_sweep_before_any_step(
        trainer_class, metric, says):
    config = toy.toy_config(**{"eval.every_steps": 5, "sweep.pruner": "median",
                               "sweep.metric": metric, "sweep.trial": 0})
    run = trainer_class(config)
    with pytest.raises(PruningError, match=re.escape(says)) as raised:
        run.fit()
    assert raised.value.exit_code == EXIT_USAGE and run.step == 0
