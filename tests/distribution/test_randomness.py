"""Random draws on N replicas and across a resume (trainer/step/random_streams.py): a
Dropout draws other masks on each replica, and a run resumed at step 4 ends bit-equal to
an uninterrupted one with dropout, a Trainer's SeedGenerator, an int-seeded
keras.random op and a layer's tf.random.Generator in the step
(tests/distribution/random_trainers.py): on 1 and 2 Mirrored replicas, under manual data
parallelism over 2 devices (one process each) and on 2 workers (launch.multiworker)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.support.helpers import run_in_parallel, saved_run

RUNS = {"1": ["--replicas", "1"], "2": ["--replicas", "2"], "manual2": ["--manual", "2"]}


@pytest.fixture(scope="module")
def random_runs(tmp_path_factory) -> dict:
    """{run: npz of tests/distribution/run_randomness.py}; the two workers' as
    ``workers-worker-0`` and ``workers-worker-1``."""
    out = tmp_path_factory.mktemp("randomness")
    commands = {name: [sys.executable, "-m", "tests.distribution.run_randomness", *argv,
                       "--workdir", str(out / f"work{name}"), "--out", str(out / f"{name}.npz")]
                for name, argv in RUNS.items()}
    commands["workers"] = [sys.executable, "-m", "launch.multiworker", "--workers", "2",
                           "--module", "tests.distribution.run_randomness", "--replicas", "2",
                           "--workdir", str(out / "workworkers"),
                           "--out", str(out / "workers.npz")]
    run_in_parallel(commands)
    names = [*RUNS, "workers-worker-0", "workers-worker-1"]
    return {name: dict(np.load(out / f"{name}.npz")) for name in names}


@pytest.mark.parametrize("run", ["1", "2"])
def test_dropout_masks_are_independent_across_the_global_batch(random_runs, run):
    # 2 replicas: replica 0's rows against replica 1's (1.0 when every replica drew the
    # same mask); 1 replica: the two halves of its one batch. 512 entries: 0.5 +- 0.022.
    assert 0.4 <= float(random_runs[run]["equal_share"]) <= 0.6


@pytest.mark.parametrize("run", list(RUNS))
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
