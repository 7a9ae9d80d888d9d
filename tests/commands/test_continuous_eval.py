"""``--mode=eval`` / ``--mode=continuous_eval`` (trainer.commands.continuous_eval).

In one process: a ToyEvalTrainer run's checkpoints, hidden and committed by hand the way
orbax writes them (``<step>.orbax-checkpoint-tmp-*``, renamed when complete), watched by a
ContinuousEvaluator whose ``sleep`` commits the next one. Then one real group:
``launch.multiworker --workers 2 --evaluator`` training digits, the evaluator beside it.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import tensorflow as tf

from tests.support import toy
from tests.conftest import run_main
from tests.launch_helpers.running import Launch, wait_until_dead
from trainer.checkpoint.storage.reader import LATEST_DIR
from trainer.commands import continuous_eval
from trainer.config import ConfigError

STEPS = [5, 10, 15, 20]


def eval_config(**overrides):
    return toy.toy_config(**{"train.steps": 20, "checkpoint.every_steps": 5,
                             "checkpoint.max_to_keep": 10, "eval.every_steps": 0,
                             "train.log_every_steps": 5, **overrides})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A ToyEvalTrainer workdir with committed checkpoints at 5, 10, 15 and 20."""
    workdir = tmp_path_factory.mktemp("trained")
    trainer = toy.ToyEvalTrainer(eval_config(), str(workdir))
    trainer.fit()
    assert sorted(int(s) for s in os.listdir(workdir / LATEST_DIR)) == STEPS
    return workdir


def copy_run(trained, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(trained, workdir)
    shutil.rmtree(workdir / "eval", ignore_errors=True)  # the trainer's own event files
    return workdir


def evaluator_for(workdir, **overrides):
    config = eval_config(**overrides)
    config.trainer = "tests.support.toy:ToyEvalTrainer"
    return continuous_eval.build_trainer(config, str(workdir))


class FakeTime:
    """``clock`` and ``sleep`` for a ContinuousEvaluator; ``on_sleep`` runs at each sleep."""

    def __init__(self, on_sleep=None):
        self.now, self.sleeps, self.on_sleep = 0.0, 0, on_sleep

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        if self.on_sleep:
            self.on_sleep()


def records(workdir):
    with open(workdir / "eval" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_each_checkpoint_is_evaluated_once_committed_and_never_while_being_written(
        trained, tmp_path):
    workdir = copy_run(trained, tmp_path)
    checkpoints = workdir / LATEST_DIR
    complete = tmp_path / "complete"
    complete.mkdir()
    # Steps 10, 15, 20 are "being written": a tmp directory holding only the manifest (the
    # arrays are not there yet, so reading it would fail); step 5 is committed.
    for step in STEPS[1:]:
        shutil.move(checkpoints / str(step), complete / str(step))
        partial = checkpoints / f"{step}.orbax-checkpoint-tmp-{1000 + step}"
        shutil.copytree(complete / str(step) / "manifest", partial / "manifest")
    trainer = evaluator_for(workdir, **{"checkpoint.best_metric": "eval/accuracy"})
    seen_at_sleep = []

    def commit_next():
        """The trainer's side: finish the oldest pending write and rename it (orbax's commit)."""
        seen_at_sleep.append(list(evaluator.evaluated))
        pending = sorted(int(p.name.split(".")[0]) for p in checkpoints.glob("*.orbax-*"))
        if pending:
            step = pending[0]
            shutil.rmtree(next(checkpoints.glob(f"{step}.orbax-*")))
            shutil.move(complete / str(step), checkpoints / str(step))

    fake = FakeTime(commit_next)
    evaluator = continuous_eval.ContinuousEvaluator(trainer, timeout_s=60, poll_s=1,
                                                    sleep=fake.sleep, clock=fake.clock)
    assert evaluator.run() == STEPS
    # It waited at each uncommitted step: each sleep saw only the steps committed before.
    assert seen_at_sleep == [[5], [5, 10], [5, 10, 15]]
    got = records(workdir)
    assert [r["step"] for r in got] == STEPS and all(r["kind"] == "eval" for r in got)
    # The same numbers as a one-off evaluation of the step (what --mode=eval does).
    step, logs = continuous_eval.evaluate_checkpoint(evaluator_for(workdir), 15)
    assert step == 15 and logs == {k: v for k, v in got[2].items() if k.startswith("eval/")}
    # It wrote no checkpoint and kept the best by its own eval.
    assert sorted(int(s) for s in os.listdir(checkpoints)) == STEPS
    best = max(got, key=lambda r: (r["eval/accuracy"], -r["step"]))
    with open(workdir / continuous_eval.BEST_EXPORT_DIR / "best.json") as f:
        assert json.load(f) == {"step": best["step"], "accuracy": best["eval/accuracy"]}
    served = tf.saved_model.load(str(workdir / continuous_eval.BEST_EXPORT_DIR))
    x, _ = toy.toy_data(4)
    trainer.restore(best["step"])
    tf.debugging.assert_near(served.serve(x), trainer.model(x), atol=1e-6)


def test_superseded_steps_are_skipped_a_timeout_ends_it_and_a_restart_repeats_nothing(
        trained, tmp_path):
    workdir = copy_run(trained, tmp_path)
    shutil.rmtree(workdir / LATEST_DIR / "20")  # the final step never comes
    fake = FakeTime()
    evaluator = continuous_eval.ContinuousEvaluator(evaluator_for(workdir), timeout_s=30,
                                                    poll_s=1, sleep=fake.sleep, clock=fake.clock)
    assert evaluator.run() == [15]  # the newest; 5 and 10 were superseded before it looked
    assert fake.sleeps == 31  # then it polled until the timeout
    later = FakeTime()
    restarted = continuous_eval.ContinuousEvaluator(
        evaluator_for(workdir), timeout_s=3, poll_s=1, sleep=later.sleep, clock=later.clock)
    assert restarted.run() == []
    assert [r["step"] for r in records(workdir)] == [15]


def test_an_evaluator_task_refuses_to_train_and_evaluates_on_one_device(monkeypatch):
    config = eval_config(**{"distribute.strategy": "mirrored"})
    assert continuous_eval.evaluation_config(config) is config  # no cluster: as configured
    tiered = eval_config(**{"checkpoint.local_every_steps": 5})  # reads the workdir only
    assert continuous_eval.evaluation_config(tiered).checkpoint.local_every_steps == 0
    assert tiered.checkpoint.local_every_steps == 5
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["127.0.0.1:1"], "evaluator": ["127.0.0.1:2"]},
        "task": {"type": "evaluator", "index": 0}}))
    with pytest.raises(ConfigError, match="--mode=continuous_eval"):
        continuous_eval.check_mode("train")
    continuous_eval.check_mode("continuous_eval")
    for strategy in ("auto", "multi_worker", "mirrored"):
        config = eval_config(**{"distribute.strategy": strategy})
        assert continuous_eval.evaluation_config(config).distribute.strategy == "one_device"
        assert config.distribute.strategy == strategy  # the caller's config is not changed


# ------------------------------------------------------------ a real 2-worker group
CONFIG = "tests/launch_helpers/weights_config.py"  # digits, 30 steps of 5-step loops
GROUP_FLAGS = ["--config.checkpoint.every_steps=5", "--config.checkpoint.max_to_keep=10"]
RUN_S = 300


def trainer_step_at(train_records, when: float) -> int:
    """The chief's step at time ``when`` (its last log window before it)."""
    return max([r["step"] for r in train_records if r["time"] <= when], default=0)


def test_continuous_eval_beside_a_two_worker_run(tmp_path):
    run = Launch("launch.multiworker",
                 ["--workers", "2", "--evaluator", f"--config={CONFIG}",
                  f"--workdir={tmp_path}", *GROUP_FLAGS],
                 env_extra={"LAUNCH_TEST_SLOW_FROM": "0:0.3"})  # 0.3 s per step
    assert run.finish(RUN_S) == 0, run.output[-6000:]
    assert wait_until_dead(run.all_task_pids(), 5) == []
    evaluator_lines = [line for line in run.lines if line.startswith("[evaluator:0]")]
    assert any("evaluating on one device" in line for line in evaluator_lines)
    assert not any("MultiWorkerMirroredStrategy" in line for line in evaluator_lines)

    evaluated = records(tmp_path)
    steps = [r["step"] for r in evaluated]
    assert steps[-1] == 30 and steps == sorted(set(steps)), steps
    # The training workdir holds exactly the checkpoints the chief (worker:0) wrote.
    written = {int(m.group(1)) for line in run.lines if line.startswith("[worker:0]")
               for m in [re.search(r"checkpoint of step (\d+) ->", line)] if m}
    assert written == {5, 10, 15, 20, 25, 30}
    assert {int(s) for s in os.listdir(tmp_path / LATEST_DIR)} == written
    assert set(steps) <= written
    # The trainer's stream holds only the trainer's lines: a train record per 5-step
    # window, its one end-of-run evaluation (eval.every_steps=0) and its goodput, none of
    # the evaluator's.
    with open(tmp_path / "metrics.jsonl") as f:
        trainer_records = [json.loads(line) for line in f]
    assert [(r["kind"], r["step"]) for r in trainer_records] == \
        [("train", s) for s in (5, 10, 15, 20, 25, 30)] + [("eval", 30), ("goodput", 30)]

    # --mode=eval of the final checkpoint gives the evaluator's numbers.
    proc = run_main(tmp_path, "--mode=eval", config=CONFIG)
    assert proc.returncode == 0, proc.stderr[-3000:]
    once = json.loads(proc.stdout.strip().splitlines()[-1])
    final = {k: v for k, v in evaluated[-1].items() if k.startswith("eval/")}
    assert once == {"step": 30, **final}

    train_records = [r for r in trainer_records if r["kind"] == "train"]
    lags = [trainer_step_at(train_records, r["time"]) - r["step"] for r in evaluated]
    print(f"\nevaluator: evaluated steps {steps}; lag behind the chief when each result "
          f"was recorded (steps): {lags}; skipped {sorted(written - set(steps))}")

