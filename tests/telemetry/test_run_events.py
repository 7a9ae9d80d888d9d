"""The framework's own events (restore, stop and its reason, rollback, preemption,
nothing to train) reach the console of a plain script calling ``Trainer.fit()`` and
``metrics.jsonl``; the setup report lists the training controls that are on."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import tensorflow as tf

from tests.support import toy
from tests.conftest import REPO, subprocess_env
from trainer import Callback
from trainer.checkpoint.guards.preemption import Preempted
from trainer.telemetry.service import controls

# A user's own script: no trainer.main, no absl flags, default telemetry.progress.
SCRIPT = textwrap.dedent("""
    import sys
    import trainer
    from tests.support import toy

    class StopAtTwenty(trainer.Callback):
        def on_log(self, t, logs):
            if t.step >= 20:
                t.request_stop("the loss is low enough (StopAtTwenty)")

    mode, workdir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = toy.toy_config(**{"train.steps": steps, "train.log_every_steps": 10,
                               "eval.every_steps": 10, "checkpoint.async_save": False})
    if mode == "early":
        config.train.early_stopping.metric = "eval/loss"
        config.train.early_stopping.patience = 0
        config.train.early_stopping.min_delta = 100.0  # never improves: stops at once
    callbacks = [StopAtTwenty()] if mode == "callback" else []
    toy.ToyEvalTrainer(config, workdir, callbacks=callbacks).fit()
""")


def _run(script, *args) -> str:
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _events(workdir, kinds: tuple[str, ...] = ("restore", "stop", "rollback")) -> list[dict]:
    with open(workdir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r["kind"] in kinds]


def test_a_plain_script_shows_restore_and_stop_reasons_and_records_them(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    workdir = tmp_path / "run"

    first = _run(script, "early", workdir, 40)
    assert "controls: early stopping on eval/loss (min, patience 0, min_delta 100)" in first
    assert ("stopped at step 10: early stopping: eval/loss did not improve by more than 100 "
            "for 1 evaluation(s); best ") in first, first[-3000:]
    assert "at step 10" in first.split("stopped at step 10: ")[1].splitlines()[0]

    second = _run(script, "callback", workdir, 40)
    assert f"restored from checkpoint step 10 ({workdir})" in second, second[-3000:]
    assert "stopped at step 20: the loss is low enough (StopAtTwenty)" in second

    third = _run(script, "plain", workdir, 20)
    assert "stopped at step 20: workdir already at step 20 >= train.steps=20: nothing to " \
           "train" in third, third[-3000:]

    records = [{k: v for k, v in r.items() if k != "time"} for r in _events(workdir)]
    reasons = [r.pop("reason", None) for r in records]
    assert records == [{"kind": "stop", "step": 10},
                       {"kind": "restore", "step": 10, "workdir": str(workdir)},
                       {"kind": "stop", "step": 20},
                       {"kind": "restore", "step": 20, "workdir": str(workdir)},
                       {"kind": "stop", "step": 20}]
    assert reasons[0].startswith("early stopping: eval/loss") and "at step 10" in reasons[0]
    assert reasons[2] == "the loss is low enough (StopAtTwenty)"
    assert reasons[4].endswith("nothing to train")
    # Each process's fit() ends with the run's goodput over the attempts so far.
    goodput = _events(workdir, ("goodput",))
    assert [(r["step"], r["goodput/attempts"]) for r in goodput] == [(10, 1), (20, 2), (20, 3)]
    assert "goodput " in third and "over 3 attempts" in third, third[-3000:]


class Poisoned(toy.ToyTrainer):
    """Step 6's batch holds an inf feature."""

    def build_train_dataset(self, ctx):
        def poison(i, batch):
            x, y = batch
            return tf.where(tf.equal(i, 5), x * float("inf"), x), y

        return super().build_train_dataset(ctx).enumerate().map(poison)


def test_rollback_with_a_window_as_long_as_the_loop_goes_on_and_is_recorded(tmp_path):
    """The rollback moves the step back; the next window (same end step as the one rolled
    back) still counts its loop call."""
    t = Poisoned(toy.toy_config(**{
        "train.steps": 12, "train.steps_per_loop": 2, "train.log_every_steps": 2,
        "checkpoint.every_steps": 4, "checkpoint.async_save": False,
        "train.on_nonfinite": "rollback"}), str(tmp_path))
    t.fit()
    assert t.step == 12
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [(r["kind"], r["step"]) for r in records] == [
        ("train", 2), ("train", 4), ("train", 6), ("rollback", 4), ("train", 6),
        ("train", 8), ("train", 10), ("train", 12), ("goodput", 12)]
    assert all(r["perf/loop_calls"] == 1 for r in records if r["kind"] == "train")
    rollback = records[3]
    assert rollback["from_step"] == 6 and "non-finite" in rollback["reason"]
    assert [r["kind"] for r in t.events.records] == ["rollback", "goodput"]


def test_a_preemption_is_an_event_too(tmp_path, capsys):
    class PreemptAtTen(Callback):
        def on_loop_end(self, trainer):
            if trainer.step == 10:
                trainer.driver.request_preemption()  # what the SIGTERM handler does

    t = toy.ToyTrainer(toy.toy_config(**{"checkpoint.async_save": False}), str(tmp_path),
                       callbacks=[PreemptAtTen()])
    try:
        t.fit()
        raise AssertionError("fit() must raise Preempted")
    except Preempted:
        pass
    assert "preempted at step 10: stop signal (SIGTERM/SIGINT); the checkpoint of step 10 is saved" in (
        capsys.readouterr().err)
    with open(tmp_path / "metrics.jsonl") as f:
        assert [r for r in map(json.loads, f) if r["kind"] == "preemption"][0]["step"] == 10


def test_the_setup_report_lists_the_controls_that_are_on():
    config = toy.toy_config(**{"train.on_nonfinite": "rollback"})
    assert controls(toy.toy_config()) == "none"
    config.optimizer.ema_decay = 0.99
    config.perf.grad_accum_steps = 2
    config.train.early_stopping.metric = "eval/accuracy"
    config.train.early_stopping.mode = "max"
    assert controls(config) == (
        "EMA of the weights (decay 0.99); early stopping on eval/accuracy (max, patience "
        f"{config.train.early_stopping.patience}, min_delta "
        f"{config.train.early_stopping.min_delta:g}); rollback after "
        f"{config.train.rollback_after} non-finite step(s), at most "
        f"{config.train.max_rollbacks} time(s); gradient accumulation over 2 steps")
