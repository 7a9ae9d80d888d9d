"""Random draws on N replicas and across a resume (trainer/step/random_streams.py): a
Dropout draws other masks on each replica, and a run resumed at step 4 ends bit-equal to
an uninterrupted one with dropout, a Trainer's SeedGenerator, an int-seeded
keras.random op and a layer's tf.random.Generator in the step
(tests/distribution/random_trainers.py): on 1 and 2 Mirrored replicas, under manual data
parallelism over 2 devices (one process each) and on 2 workers (launch.multiworker).
With distribute.random_draws="global" (the same processes, and one of 4 replicas) 2 and
4 Mirrored replicas, 2 manual device slices and 2 workers end with the weights of 1
replica."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.support.helpers import max_abs_diff, run_in_parallel, saved_run

BOTH = ["--draws", "per_replica,global"]
RUNS = {"1": ["--replicas", "1", *BOTH], "2": ["--replicas", "2", *BOTH],
        "manual2": ["--manual", "2", *BOTH], "4": ["--replicas", "4", "--draws", "global"]}
PER_REPLICA_RUNS = ["1", "2", "manual2"]


@pytest.fixture(scope="module")
def random_runs(tmp_path_factory) -> dict:
    """{run: npz of tests/distribution/run_randomness.py}; the two workers' as
    ``workers-worker-0`` and ``workers-worker-1`` (``workers-global-worker-<i>``: with
    ``distribute.random_draws="global"``)."""
    out = tmp_path_factory.mktemp("randomness")
    commands = {name: [sys.executable, "-m", "tests.distribution.run_randomness", *argv,
                       "--workdir", str(out / f"work{name}"), "--out", str(out / f"{name}.npz")]
                for name, argv in RUNS.items()}
    for name, draws in [("workers", "per_replica"), ("workers-global", "global")]:
        commands[name] = [sys.executable, "-m", "launch.multiworker", "--workers", "2",
                          "--module", "tests.distribution.run_randomness", "--replicas", "2",
                          "--draws", draws, "--workdir", str(out / f"work{name}"),
                          "--out", str(out / f"{name}.npz")]
    run_in_parallel(commands)
    names = [*RUNS, *(f"{run}-worker-{i}" for run in ("workers", "workers-global")
                      for i in range(2))]
    return {name: dict(np.load(out / f"{name}.npz")) for name in names}


@pytest.mark.parametrize("run", ["1", "2"])
def test_dropout_masks_are_independent_across_the_global_batch(random_runs, run):
    # 2 replicas: replica 0's rows against replica 1's (1.0 when every replica drew the
    # same mask); 1 replica: the two halves of its one batch. 512 entries: 0.5 +- 0.022.
    assert 0.4 <= float(random_runs[run]["equal_share"]) <= 0.6


@pytest.mark.parametrize("run", PER_REPLICA_RUNS)
def test_a_resumed_run_ends_bit_equal_to_an_uninterrupted_one(random_runs, run):
    straight = saved_run(random_runs[run], "straight")
    resumed = saved_run(random_runs[run], "resumed")
    assert len(straight) == len(resumed)
    for i, (a, b) in enumerate(zip(straight, resumed)):
        np.testing.assert_array_equal(a, b, err_msg=f"array {i}")


def test_the_compute_probe_of_an_unseeded_random_op_on_2_replicas_leaves_the_run_as_is(
        random_runs):
    """The probe draws the loss's unseeded numbers from the Trainer's global generator,
    as the step does, and puts its state back (before: Keras made its own global
    generator inside the probe's trace, which failed the run on 2 replicas)."""
    probed = saved_run(random_runs["2"], "probed")
    unprobed = saved_run(random_runs["2"], "unprobed")
    assert probed and len(probed) == len(unprobed)
    for i, (a, b) in enumerate(zip(probed, unprobed)):
        np.testing.assert_array_equal(a, b, err_msg=f"array {i}")


def test_two_workers_draw_apart_and_resume_bit_equal(random_runs):
    worker0, worker1 = random_runs["workers-worker-0"], random_runs["workers-worker-1"]
    assert 0.4 <= float(worker0["equal_share"]) <= 0.6  # worker 0's rows against worker 1's
    straight = saved_run(worker0, "straight")
    for run, worker in [("resumed", worker0), ("straight", worker1), ("resumed", worker1)]:
        for i, (a, b) in enumerate(zip(straight, saved_run(worker, run))):
            np.testing.assert_array_equal(a, b, err_msg=f"{run} array {i}")


@pytest.mark.parametrize("run", ["2", "4", "manual2"])
def test_global_draws_on_n_replicas_end_as_on_one(random_runs, run):
    # Each replica (device slice) draws its rows of one draw for the global batch, keyed
    # without the replica: the weights and random states of 1 replica, within rounding
    # (per_replica: other masks, as different as two seeds).
    one, many = saved_run(random_runs["1"], "global"), saved_run(random_runs[run], "global")
    if run == "manual2":  # the probe's state, before the global generator's (the last):
        one, many = one[:-2] + one[-1:], many[:-2] + many[-1:]  # manual steps skip the probe
    assert max_abs_diff(one, many) <= 1e-5


@pytest.mark.parametrize("run", ["1", "2"])
def test_global_draws_are_independent_across_the_global_batch(random_runs, run):
    assert 0.4 <= float(random_runs[run]["global_equal_share"]) <= 0.6


def test_two_workers_with_global_draws_end_as_one_replica(random_runs):
    one = saved_run(random_runs["1"], "global")
    for i in range(2):
        worker = random_runs[f"workers-global-worker-{i}"]
        assert max_abs_diff(one, saved_run(worker, "global")) <= 1e-5, f"worker {i}"
        assert 0.4 <= float(worker["global_equal_share"]) <= 0.6
