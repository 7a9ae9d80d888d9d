"""The public Callback API: order, cadence, logs, request_stop and errors, on 1 replica,
2 Mirrored replicas and 2 real local workers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.support import toy
from tests.conftest import REPO, early_main, run_main, subprocess_env
from tests.support.run_callbacks import CallbackTrainer, Recorder, get_config
from trainer import Callback

# 20 steps, loops of 5, logs and evals and checkpoints every 10: the sequence every
# replica count and every worker must see.
EXPECTED = [("on_fit_start", 0), ("on_loop_end", 5),
            ("on_log", 10), ("on_eval_end", 10), ("on_checkpoint", 10), ("on_loop_end", 10),
            ("on_loop_end", 15),
            ("on_log", 20), ("on_eval_end", 20), ("on_checkpoint", 20), ("on_loop_end", 20),
            ("on_fit_end", 20)]


mirrored_main = early_main("mirrored_main", "test_two_mirrored_replicas_see_the_same_sequence",
                           "--config.distribute.strategy=mirrored",
                           "--config.distribute.virtual_devices=2",
                           config="tests/support/run_callbacks.py")


def hooks(calls) -> list[tuple[str, int]]:
    return [(name, step) for name, step, _ in calls]


def one_device_config(**overrides):
    config = get_config()
    config.distribute.strategy = "one_device"
    config.update_from_flattened_dict(overrides)
    return config


def test_hooks_run_in_order_at_their_steps_with_float_logs(tmp_path):
    recorder = Recorder()
    trainer = CallbackTrainer(one_device_config(), str(tmp_path), callbacks=[recorder])
    results = trainer.fit()
    assert hooks(recorder.calls) == EXPECTED
    logs = {name + str(step): values for name, step, values in recorder.calls if values}
    assert set(logs["on_log10"]) >= {"train/loss", "train/accuracy", "perf/examples_per_s"}
    assert set(logs["on_eval_end20"]) == {"eval/loss", "eval/accuracy"}
    assert all(type(v) is float and math.isfinite(v)
               for values in logs.values() for k, v in values.items() if k != "step")
    assert logs["on_fit_end20"] == results
    assert results["train/loss"] == logs["on_log20"]["train/loss"]
    assert results["eval/accuracy"] == logs["on_eval_end20"]["eval/accuracy"]


class Order(Callback):
    def __init__(self, name, seen):
        self.name, self.seen = name, seen

    def on_loop_end(self, trainer):
        self.seen.append(self.name)


def test_constructor_callbacks_run_before_build_callbacks_in_the_order_given():
    seen = []

    class Built(toy.ToyTrainer):
        def build_callbacks(self):
            return [Order("built", seen)]

    Built(toy.toy_config(**{"train.steps": 5}), callbacks=[Order("a", seen), Order("b", seen)]).fit()
    assert seen == ["a", "b", "built"]


class StopAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_loop_end(self, trainer):
        if trainer.step >= self.step:
            trainer.request_stop("enough")


def test_request_stop_saves_a_final_checkpoint_and_a_new_run_resumes_there(tmp_path):
    config = one_device_config(**{"checkpoint.every_steps": 0})
    stopped = CallbackTrainer(config, str(tmp_path), callbacks=[StopAt(15)])
    results = stopped.fit()
    assert stopped.step == 15 and stopped.driver.stopped_by == "enough"
    assert os.listdir(tmp_path / "checkpoints") == ["15"]
    assert "eval/loss" in results  # the last step is evaluated also when stopped early
    resumed = CallbackTrainer(config, str(tmp_path))
    resumed.fit()
    assert resumed.step == 20
    calls = json.loads((tmp_path / "hooks-local-0.json").read_text())
    assert hooks(calls)[0] == ("on_fit_start", 15)


class Boom(Callback):
    def on_log(self, trainer, logs):
        raise ValueError("boom")


def test_a_raising_callback_stops_the_run_naming_itself_and_leaves_checkpoints_whole(tmp_path):
    config = one_device_config(**{"train.log_every_steps": 20, "checkpoint.every_steps": 5})
    with pytest.raises(ValueError, match=r"boom \(raised in callback Boom.on_log\)"):
        CallbackTrainer(config, str(tmp_path), callbacks=[Boom()]).fit()
    # The async save of step 20 was finished (or not started): every step restores.
    steps = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints"))
    assert steps and all(s % 5 == 0 for s in steps)
    for step in steps:
        assert CallbackTrainer(config, str(tmp_path)).restore(step) == step


def test_two_mirrored_replicas_see_the_same_sequence(mirrored_main):
    run, tmp_path = mirrored_main.result(), mirrored_main.workdir
    assert run.returncode == 0, run.stderr[-3000:]
    assert hooks(json.loads((tmp_path / "hooks-local-0.json").read_text())) == EXPECTED


def test_stop_requested_on_worker_1_stops_both_workers_at_that_step(tmp_path):
    env = dict(subprocess_env(), STOP_AT="worker:1:10")
    run = subprocess.run(
        [sys.executable, "-m", "launch.multiworker", "--workers", "2",
         f"--config={REPO / 'tests' / 'support' / 'run_callbacks.py'}", f"--workdir={tmp_path}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    sequences = {task: json.loads((tmp_path / f"hooks-{task}.json").read_text())
                 for task in ("worker-0", "worker-1")}
    expected = EXPECTED[:6] + [("on_fit_end", 10)]
    for task, calls in sequences.items():
        assert hooks(calls) == expected, task
    assert sequences["worker-0"] == sequences["worker-1"]  # logs identical across workers
    assert os.listdir(tmp_path / "checkpoints") == ["10"]
    resumed = run_main(tmp_path, "--config.distribute.strategy=one_device",
                       config="tests/support/run_callbacks.py")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 10" in resumed.stderr


def test_a_callback_failing_in_on_fit_start_ends_the_ones_that_started():
    """The second callback raises in on_fit_start: the first one (and every service)
    gets on_fit_end, the failing one does not, the error names it and nothing trains;
    the Trainer's SIGTERM handler is released (the preemption service's on_fit_end)."""
    import signal

    calls = []

    class Seen(Callback):
        def on_fit_start(self, trainer):
            calls.append("start")

        def on_fit_end(self, trainer, logs):
            calls.append(("end", dict(logs)))

    class Fails(Callback):
        def on_fit_start(self, trainer):
            raise KeyError("no such table")

        def on_fit_end(self, trainer, logs):
            calls.append("never")

    before = signal.getsignal(signal.SIGTERM)
    t = toy.ToyTrainer(toy.toy_config(**{"train.steps": 10}), None,
                       callbacks=[Seen(), Fails()])
    with pytest.raises(KeyError, match=r"Fails\.on_fit_start"):
        t.fit()
    assert calls == ["start", ("end", {})] and t.step == 0
    assert signal.getsignal(signal.SIGTERM) == before
