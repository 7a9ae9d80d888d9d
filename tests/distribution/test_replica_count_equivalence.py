"""Correctness under distribution: 1, 2 and 4 replicas, same global batch, same weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.helpers import max_abs_diff, saved_run

TOL = 1e-5


@pytest.mark.parametrize("run", ["sgd", "adam", "tape_step", "stateful"])
@pytest.mark.parametrize("replicas", [2, 4])
def test_same_weights_as_one_replica_after_20_steps(replica_runs, run, replicas):
    assert max_abs_diff(saved_run(replica_runs[1], run), saved_run(replica_runs[replicas], run)) <= TOL


@pytest.mark.parametrize("replicas", [2, 4])
def test_negative_control_per_replica_mean_averaging_diverges(replica_runs, replicas):
    # The same comparison must fail for the classic mistake (mean over the LOCAL batch,
    # gradients summed over replicas): this is what makes the test above able to fail.
    assert max_abs_diff(saved_run(replica_runs[1], "per_replica_mean"), saved_run(replica_runs[replicas], "per_replica_mean")) > 100 * TOL


@pytest.mark.parametrize("replicas", [2, 4])
def test_the_docs_manual_optimization_recipe_logs_the_loss_of_one_replica(replica_runs,
                                                                           replicas):
    # docs/training.md: return the per-example loss, differentiate its global-batch share.
    one, many = (float(replica_runs[n]["loss/manual_recipe"]) for n in (1, replicas))
    assert many == pytest.approx(one, rel=TOL)
    # NEGATIVE CONTROL: the share itself is averaged over replicas like every output.
    share = float(replica_runs[replicas]["loss/manual_global_share"])
    assert share == pytest.approx(one / replicas, rel=TOL)


def test_runs_actually_trained(replica_runs):
    # Guards the comparison against a run that never updated: SGD moved the weights.
    sgd = [replica_runs[1][k] for k in sorted(replica_runs[1]) if k.startswith("sgd/")]
    adam = [replica_runs[1][k] for k in sorted(replica_runs[1]) if k.startswith("adam/")]
    assert max(float(np.max(np.abs(s - a))) for s, a in zip(sgd, adam)) > 1e-3


@pytest.mark.parametrize("replicas", [2, 4])
def test_evaluate_same_on_every_replica_count_with_short_last_batch(replica_runs, replicas):
    # 100 eval examples in batches of 16: the last global batch has 4 examples, so with
    # 4 replicas some replicas see 1 example and the mean must still be exact.
    one = json.loads(str(replica_runs[1]["eval_result"]))
    many = json.loads(str(replica_runs[replicas]["eval_result"]))
    np.testing.assert_allclose(replica_runs[1]["eval_weights"],
                               replica_runs[replicas]["eval_weights"])
    assert one.keys() == many.keys() == {"loss", "accuracy"}
    for key in one:
        assert abs(one[key] - many[key]) <= TOL


@pytest.mark.parametrize("replicas", [2, 4])
def test_state_updated_in_the_forward_pass_is_the_same_on_every_replica(replica_runs, replicas):
    # A running mean (float, Keras' default aggregation) and a call counter (int64): every
    # replica's copy equals the one-replica run's value.
    one, many = replica_runs[1], replica_runs[replicas]
    names = sorted({k.rsplit("/", 1)[0] for k in one if k.startswith("state/")})
    assert len(names) == 2, names
    for name in names:
        for r in range(replicas):
            assert np.max(np.abs(one[f"{name}/0"] - many[f"{name}/{r}"])) <= TOL, (name, r)
    counter = next(n for n in names if n.endswith("calls"))
    assert int(one[f"{counter}/0"]) == 20
