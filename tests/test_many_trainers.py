"""The notebook pattern: many Trainers in one process. A fit() releases what it holds
(iterators, summary writers, probes, threads) when it ends, returned or raised (its
iterators are destroyed on a background thread: the counts wait for it);
``close()`` and ``with Trainer(...)`` release the rest; no TensorFlow retracing
warning for a second Trainer."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading

import pytest
import tensorflow as tf

from tests import toy
from tests.conftest import REPO, subprocess_env
from trainer import Callback, iterator_release

ITERATORS = (tf.data.Iterator, tf.distribute.DistributedIterator)


def live_iterators() -> int:
    """tf.data and distributed iterators alive now, unreachable cycles included."""
    return sum(1 for o in gc.get_objects() if isinstance(o, ITERATORS))


@pytest.fixture(scope="module")
def four_trainers(tmp_path_factory) -> tuple[list[dict], str]:
    """tests/run_many_trainers.py: four 2-replica ToyEvalTrainers in one process, the
    garbage collector off; (its JSON lines, its stderr)."""
    workdir = tmp_path_factory.mktemp("many")
    done = subprocess.run(
        [sys.executable, "-m", "tests.run_many_trainers", "--trainers", "4",
         "--workdir", str(workdir)],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "done", done.stdout
    return [json.loads(line) for line in lines[:-1]], done.stderr


def test_each_fit_frees_its_iterators_by_reference_counting(four_trainers):
    reports, _ = four_trainers
    fits = [r for r in reports if r["when"] == "fit"]
    assert len(fits) == 4
    assert [r["iterators"] for r in fits] == [0, 0, 0, 0]


def test_close_and_with_free_the_datasets_and_leave_no_thread(four_trainers):
    reports, _ = four_trainers
    closed = [r for r in reports if r["when"] == "closed"]
    assert [r["datasets"] for r in closed] == [0, 0, 0, 0]
    assert [r["iterators"] for r in closed] == [0, 0, 0, 0]
    assert all(r["threads"] == r["baseline"] for r in reports), reports


def test_later_trainers_trigger_no_retracing_warning(four_trainers):
    _, stderr = four_trainers
    assert "retracing" not in stderr, stderr[-3000:]


class FailAtFirstLog(Callback):
    def on_log(self, trainer, logs):
        raise RuntimeError("boom")


def test_a_fit_that_raises_releases_its_iterator(tmp_path):
    gc.collect()
    before, threads = live_iterators(), threading.active_count()
    t = toy.ToyEvalTrainer(toy.toy_config(**{"eval.every_steps": 10}), str(tmp_path),
                           callbacks=[FailAtFirstLog()])
    gc.disable()  # freed by reference counting, not by a collection
    try:
        with pytest.raises(RuntimeError, match="boom") as raised:
            t.fit()
        assert iterator_release.wait(timeout=120)
        assert live_iterators() == before
        assert threading.active_count() == threads
    finally:
        gc.enable()
    del raised


def test_a_closed_trainer_fits_on_from_its_step(tmp_path):
    # close() releases; the Trainer stays usable: it continues where it stopped, as a
    # single fit() to the same step would.
    with toy.ToyTrainer(toy.toy_config(**{"train.steps": 10})) as split:
        split.fit()
    split.config.train.steps = 20
    split.fit()
    split.close()
    whole = toy.ToyTrainer(toy.toy_config())
    whole.fit()
    assert split.step == 20
    for ref, got in zip(whole.model.get_weights(), split.model.get_weights()):
        assert abs(ref - got).max() <= 1e-6
