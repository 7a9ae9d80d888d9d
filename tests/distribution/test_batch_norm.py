"""BatchNormalization across replicas, on a model nobody here wrote (keras.applications'
MobileNetV3Small): unsynchronized layers are named in one warning at start when replicas
> 1, and ``distribute.sync_batch_norm=True`` makes every one normalise by the global
batch's statistics, so 2 replicas train to the weights of 1."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.support.helpers import max_abs_diff, run_in_parallel, saved_run

TOL = 1e-5


@pytest.fixture(scope="module")
def bn_runs(tmp_path_factory) -> dict[int, dict]:
    root = tmp_path_factory.mktemp("batch_norm")
    run_in_parallel({n: [sys.executable, "-m", "tests.distribution.run_batch_norm",
                         "--replicas", str(n), "--out", str(root / f"bn{n}.npz")]
                     for n in (1, 2)})
    return {n: dict(np.load(root / f"bn{n}.npz", allow_pickle=True)) for n in (1, 2)}


def test_sync_batch_norm_trains_2_replicas_to_the_weights_of_1(bn_runs):
    assert max_abs_diff(saved_run(bn_runs[1], "sync"), saved_run(bn_runs[2], "sync")) <= TOL


def test_negative_control_unsynchronized_batch_norm_differs(bn_runs):
    assert max_abs_diff(saved_run(bn_runs[1], "plain"), saved_run(bn_runs[2], "plain")) > 100 * TOL


def test_one_warning_names_the_unsynchronized_layers_on_2_replicas(bn_runs):
    lines = [w for w in bn_runs[2]["plain_warnings"] if "BatchNormalization" in w]
    assert len(lines) == 1, lines
    assert lines[0].startswith("34 BatchNormalization layer(s) (conv_bn, ")
    assert "set distribute.sync_batch_norm=True" in lines[0]


@pytest.mark.parametrize("case", [(1, "plain"), (2, "sync")])
def test_no_warning_on_one_replica_or_when_synchronized(bn_runs, case):
    replicas, name = case
    assert not [w for w in bn_runs[replicas][f"{name}_warnings"] if "BatchNormalization" in w]
