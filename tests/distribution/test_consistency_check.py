"""The replica-consistency sentinel (``distribute.consistency_check``): copies of a
variable that differ between replicas or workers end the run with one line naming the
variable, the step, the likely cause and the fix; copies that agree pass, and ``'off'``
turns it off. Real ``trainer.main`` processes on 2 Mirrored replicas and 2 workers
(tests/distribution/divergent.py holds the Trainers), all started at once."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support.helpers import REPO, run_at_once

CONFIG = f"--config={REPO / 'tests' / 'distribution' / 'divergent.py'}"
MIRRORED = ["--config.distribute.strategy=mirrored", "--config.distribute.virtual_devices=2"]
CASES = {
    "int_state_on_2_replicas": ["-m", "trainer.main", CONFIG, *MIRRORED],
    "weight_assigned_on_2_replicas": [
        "-m", "trainer.main", CONFIG, *MIRRORED,
        "--config.trainer=tests.distribution.divergent:NudgesABias"],
    "off": ["-m", "trainer.main", CONFIG, *MIRRORED, "--config.distribute.consistency_check=off"],
    "healthy_on_2_replicas": ["-m", "trainer.main", CONFIG, *MIRRORED,
                              "--config.trainer=tests.support.toy:StatefulTrainer"],
    "int_state_on_2_workers": ["-m", "launch.multiworker", "--workers", "2", CONFIG],
    "healthy_on_2_workers": ["-m", "launch.multiworker", "--workers", "2", CONFIG,
                             "--config.trainer=tests.support.toy:StatefulTrainer"],
    "healthy_on_1_replica": ["-m", "trainer.main", CONFIG,
                             "--config.trainer=tests.support.toy:StatefulTrainer"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("consistency")
    return run_at_once({name: [sys.executable, *argv, f"--workdir={root / name}"]
                        for name, argv in CASES.items()})


def last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def test_integer_state_that_differs_per_replica_ends_the_run_after_the_first_loop(runs):
    run = runs["int_state_on_2_replicas"]
    assert run.returncode == 1, run.stdout[-3000:]
    assert last_line(run.stdout).startswith(
        "Replica divergence: variable 'sequential/positive_count/seen' differs between "
        "replicas at step 5 (replica 1 vs replica 0: max |difference| "), run.stdout[-2000:]
    assert "Likely cause: state the forward pass updates differently" in last_line(run.stdout)
    assert "count steps, not examples" in last_line(run.stdout)
    assert "Traceback" not in run.stdout


def test_a_weight_assigned_in_the_step_names_the_gradient_path(runs):
    line = last_line(runs["weight_assigned_on_2_replicas"].stdout)
    assert line.startswith("Replica divergence: variable 'sequential/dense_1/bias' differs "
                           "between replicas at step 5 (replica 1 vs replica 0: max "
                           "|difference| 0.005)"), line
    assert "Update weights through self.apply_gradients" in line


def test_workers_that_differ_all_stop_with_the_same_line(runs):
    run = runs["int_state_on_2_workers"]
    assert run.returncode == 1, run.stdout[-3000:]
    lines = [line for line in run.stdout.splitlines() if "Replica divergence:" in line]
    assert {line.split("] ", 1)[0] for line in lines} == {"[worker:0", "[worker:1"}, lines
    assert all("variable 'sequential/positive_count/seen' differs between replicas at step "
               "5 (a worker of 2 vs the chief" in line for line in lines), lines


def test_the_check_can_be_turned_off(runs):
    run = runs["off"]
    assert run.returncode == 0, run.stdout[-3000:]
    assert last_line(run.stdout).startswith("result: step=10 ")


def test_copies_that_agree_pass_after_the_first_loop_and_at_each_checkpoint(runs):
    run = runs["healthy_on_2_replicas"]
    assert run.returncode == 0, run.stdout[-3000:]
    checked = [line for line in run.stdout.splitlines() if "replica consistency:" in line]
    steps = [int(line.split(" at step ")[1].split()[0]) for line in checked]
    assert steps == [5, 10], checked
    assert all("agree on 2 replica(s) of 1 worker(s)" in line for line in checked), checked


def test_state_updated_in_the_forward_pass_agrees_across_workers(runs):
    # The running mean (read after its update) is averaged over the workers at each
    # assign: the copies agree at every check and the run trains like one replica.
    run = runs["healthy_on_2_workers"]
    assert run.returncode == 0, run.stdout[-3000:]
    checked = [line for line in run.stdout.splitlines() if "replica consistency:" in line]
    assert checked and all("agree on 2 replica(s) of 2 worker(s)" in line
                           for line in checked), checked
    final = [re.search(r"train/loss=([0-9.]+)", line).group(1)
             for line in run.stdout.splitlines() if "result: step=10 " in line]
    one = re.search(r"train/loss=([0-9.]+)", last_line(runs["healthy_on_1_replica"].stdout))
    assert final and float(final[0]) == pytest.approx(float(one.group(1)), abs=1e-5)
