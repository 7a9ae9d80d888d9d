"""Collectives for custom steps (``Trainer.all_gather`` / ``all_reduce``): a contrastive
loss over the whole global batch (models/contrastive.py) gives the same step-1 loss on 1
and 2 Mirrored replicas and on 2 workers, and the same loss after 20 steps (the gathered
embeddings' gradients reach the replica that made them); manual data parallelism over 2
devices refuses with one line. Real ``trainer.main`` processes, all started at once."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import tensorflow as tf

from tests.support import toy
from tests.support.helpers import REPO, run_at_once

CONFIG = f"--config={REPO / 'models' / 'configs' / 'contrastive.py'}"
ONE_STEP = ["--config.train.steps=1", "--config.train.steps_per_loop=1",
            "--config.train.log_every_steps=1"]
MIRRORED = ["--config.distribute.strategy=mirrored", "--config.distribute.virtual_devices=2"]
STEPS_20 = ["--config.train.steps=20", "--config.train.steps_per_loop=5",
            "--config.train.log_every_steps=20"]
CASES = {
    "one_replica": ["-m", "trainer.main", CONFIG, *ONE_STEP],
    "two_replicas": ["-m", "trainer.main", CONFIG, *ONE_STEP, *MIRRORED],
    "two_workers": ["-m", "launch.multiworker", "--workers", "2", CONFIG, *ONE_STEP],
    "manual_two_devices": ["-m", "trainer.main", CONFIG, *ONE_STEP,
                           "--config.distribute.strategy=manual",
                           "--config.distribute.virtual_devices=2"],
    "one_replica_20_steps": ["-m", "trainer.main", CONFIG, *STEPS_20],
    "two_replicas_20_steps": ["-m", "trainer.main", CONFIG, *STEPS_20, *MIRRORED],
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


def test_manual_data_parallelism_refuses_with_one_line(runs):
    run = runs["manual_two_devices"]
    assert run.returncode == 1, run.stdout[-3000:]
    last = [line for line in run.stdout.splitlines() if line.strip()][-1]
    assert last.startswith("Configuration error: all_gather under distribute.strategy='manual' with "
                           "several devices: the device slices run one after another"), last
    assert "use distribute.strategy='mirrored' over the same devices" in last


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
