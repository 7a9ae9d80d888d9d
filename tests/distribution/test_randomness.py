"""Random draws on N replicas and across a resume (trainer/step/random_streams.py): a
Dropout draws other masks on each replica, and a run resumed at step 4 ends bit-equal to
an uninterrupted one with dropout, a Trainer's SeedGenerator, an int-seeded
keras.random op and a layer's tf.random.Generator in the step (1 and 2 replicas, one
process each)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.support.helpers import run_in_parallel, saved_run


@pytest.fixture(scope="module")
def random_runs(tmp_path_factory) -> dict:
    """{replicas: npz of tests/distribution/run_randomness.py}."""
    out = tmp_path_factory.mktemp("randomness")
    run_in_parallel({n: [sys.executable, "-m", "tests.distribution.run_randomness",
                         "--replicas", str(n), "--workdir", str(out / f"work{n}"),
                         "--out", str(out / f"{n}.npz")] for n in (1, 2)})
    return {n: dict(np.load(out / f"{n}.npz")) for n in (1, 2)}


@pytest.mark.parametrize("replicas", [1, 2])
def test_dropout_masks_are_independent_across_the_global_batch(random_runs, replicas):
    # 2 replicas: replica 0's rows against replica 1's (1.0 when every replica drew the
    # same mask); 1 replica: the two halves of its one batch. 512 entries: 0.5 +- 0.022.
    assert 0.4 <= float(random_runs[replicas]["equal_share"]) <= 0.6


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_resumed_run_ends_bit_equal_to_an_uninterrupted_one(random_runs, replicas):
    straight = saved_run(random_runs[replicas], "straight")
    resumed = saved_run(random_runs[replicas], "resumed")
    assert len(straight) == len(resumed)
    for i, (a, b) in enumerate(zip(straight, resumed)):
        np.testing.assert_array_equal(a, b, err_msg=f"array {i}")
