"""Collectives for custom steps (``Trainer.all_gather`` / ``all_reduce``): a contrastive
loss over the whole global batch (models/contrastive.py) gives the same step-1 loss on 1
and 2 Mirrored replicas and on 2 workers, and the same loss after 20 steps (the gathered
embeddings' gradients reach the replica that made them), also with a learnable
temperature the Trainer holds (on 2 workers); manual data parallelism over 2
devices refuses with one line, for ``self.all_gather`` as for TensorFlow's own replica
context collectives (tests/support/user_patterns.py). Real ``trainer.main`` processes,
all started at once."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import tensorflow as tf

from tests.support import toy
from tests.support.helpers import REPO, run_at_once
from trainer.distribution import collectives
from trainer.errors import ConfigError

CONFIG = f"--config={REPO / 'models' / 'configs' / 'contrastive.py'}"
ONE_STEP = ["--config.train.steps=1", "--config.train.steps_per_loop=1",
            "--config.train.log_every_steps=1"]
MIRRORED = ["--config.distribute.strategy=mirrored", "--config.distribute.virtual_devices=2"]
STEPS_20 = ["--config.train.steps=20", "--config.train.steps_per_loop=5",
            "--config.train.log_every_steps=20"]
LEARNED = "--config.trainer=tests.support.user_patterns:LearnedTemperatureContrastiveTrainer"
CASES = {
    "one_replica": ["-m", "trainer.main", CONFIG, *ONE_STEP],
    "two_replicas": ["-m", "trainer.main", CONFIG, *ONE_STEP, *MIRRORED],
    "two_workers": ["-m", "launch.multiworker", "--workers", "2", CONFIG, *ONE_STEP],
    "manual_two_devices": ["-m", "trainer.main", CONFIG, *ONE_STEP,
                           "--config.distribute.strategy=manual",
                           "--config.distribute.virtual_devices=2"],
    # TensorFlow's own all_gather, as its guides write it (it returned the local half)
    "raw_manual_two_devices": ["-m", "trainer.main", CONFIG, *ONE_STEP,
                               "--config.distribute.strategy=manual",
                               "--config.distribute.virtual_devices=2",
                               "--config.trainer=tests.support.user_patterns:"
                               "RawGatherContrastiveTrainer"],
    "one_replica_20_steps": ["-m", "trainer.main", CONFIG, *STEPS_20],
    "two_replicas_20_steps": ["-m", "trainer.main", CONFIG, *STEPS_20, *MIRRORED],
    # a learnable temperature the Trainer holds (tests/support/user_patterns.py)
    "owned_one_replica_20_steps": ["-m", "trainer.main", CONFIG, *STEPS_20, LEARNED],
    "owned_two_workers_20_steps": ["-m", "launch.multiworker", "--workers", "2", CONFIG,
                                   *STEPS_20, LEARNED],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("collectives")
    return run_at_once({name: [sys.executable, *argv, f"--workdir={root / name}"]
                        for name, argv in CASES.items()})


def train_loss(run: subprocess.CompletedProcess) -> float:
    assert run.returncode == 0, run.stdout[-3000:]
    found = re.findall(r"result: step=\d+ train/loss=([0-9.e+-]+)", run.stdout)
    assert found, run.stdout[-2000:]
    return float(found[-1])


@pytest.mark.parametrize("case", ["two_replicas", "two_workers"])
def test_the_step_1_contrastive_loss_is_the_same_as_on_one_replica(runs, case):
    assert train_loss(runs[case]) == pytest.approx(train_loss(runs["one_replica"]), abs=1e-5)


def test_training_through_the_gathered_embeddings_is_the_same_on_2_replicas(runs):
    one, two = train_loss(runs["one_replica_20_steps"]), train_loss(runs["two_replicas_20_steps"])
    assert two == pytest.approx(one, abs=1e-5)
    assert one < train_loss(runs["one_replica"])  # it trained


def test_a_temperature_the_trainer_holds_trains_the_same_on_two_workers(runs):
    one = train_loss(runs["owned_one_replica_20_steps"])
    assert train_loss(runs["owned_two_workers_20_steps"]) == pytest.approx(one, abs=1e-5)
    assert abs(one - train_loss(runs["one_replica_20_steps"])) > 1e-3  # it was trained


@pytest.mark.parametrize("case, called", [
    ("manual_two_devices", "all_gather"),
    ("raw_manual_two_devices", "tf.distribute.get_replica_context().all_gather")])
def test_manual_data_parallelism_refuses_with_one_line(runs, case, called):
    run = runs[case]
    assert run.returncode == 1, run.stdout[-3000:]
    last = [line for line in run.stdout.splitlines() if line.strip()][-1]
    assert last.startswith(f"Configuration error: {called} under distribute.strategy='manual' "
                           f"with several devices: the device slices run one after "
                           f"another"), last
    assert "use distribute.strategy='mirrored' over the same devices" in last


@pytest.mark.parametrize("call, named", [
    (lambda ctx, v: ctx.all_reduce(tf.distribute.ReduceOp.SUM, v), "all_reduce"),
    (lambda ctx, v: ctx.merge_call(lambda strategy: v), "merge_call"),
    (lambda ctx, v: ctx.all_gather(v, axis=0), "all_gather")],
    ids=["all_reduce", "merge_call", "all_gather"])
def test_a_manual_slice_refuses_tensorflows_collectives_when_traced(call, named):
    # The replica context a device slice's step is traced in under manual data
    # parallelism over several devices (trainer/distribution/data_parallel.py).
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")

    def step():
        return call(tf.distribute.get_replica_context(), tf.constant([1.0]))

    with collectives.refusing_replica_context(strategy):
        with pytest.raises(ConfigError, match=rf"^tf\.distribute\.get_replica_context\(\)"
                                              rf"\.{named}.* under distribute\.strategy="
                                              rf"'manual' with several devices: "):
            tf.function(step, autograph=False)()


def test_one_replica_returns_the_value_and_bad_calls_say_why():
    trainer = toy.ToyTrainer(toy.toy_config())
    value = tf.constant([[1.0, 2.0]])

    def step():
        return trainer.all_gather(value), trainer.all_reduce(value, "mean")

    gathered, reduced = trainer.strategy.run(tf.function(step))
    assert gathered.numpy().tolist() == reduced.numpy().tolist() == [[1.0, 2.0]]
    with pytest.raises(ValueError, match=r"all_reduce op='max' is not one of 'sum', 'mean'"):
        trainer.strategy.run(tf.function(lambda: trainer.all_reduce(value, "max")))
    with pytest.raises(RuntimeError, match="all_gather runs in replica context"):
        with trainer.strategy.scope():
            trainer.all_gather(value)
