"""The notebook pattern: many Trainers in one process. A fit() releases what it holds
(summary writers, probes, threads) when it ends, returned or raised; it keeps its train
iterator for the Trainer's next fit() only when it returned (released when it raised);
``close()``, ``with Trainer(...)`` and a Trainer that is garbage collected release the
rest (iterators are destroyed on a background thread: the counts wait for it), so no
iterator outlives its Trainer; no TensorFlow retracing warning for a second Trainer."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading

import pytest

from tests.support import toy
from tests.support.helpers import REPO, live_iterators, max_abs_diff, subprocess_env
from trainer import Callback
from trainer.data import iterator_release

@pytest.fixture(scope="module")
def four_trainers(tmp_path_factory) -> tuple[list[dict], str]:
    """tests/run_many_trainers.py: four 2-replica ToyEvalTrainers in one process, closed,
    and a fifth dropped without close, the garbage collector off; (its JSON lines, its
    stderr)."""
    workdir = tmp_path_factory.mktemp("many")
    done = subprocess.run(
        [sys.executable, "-m", "tests.run_many_trainers", "--trainers", "4",
         "--workdir", str(workdir)],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "done", done.stdout
    return [json.loads(line) for line in lines[:-1]], done.stderr


def test_after_a_fit_only_its_own_kept_iterator_is_alive(four_trainers):
    # The same count after every Trainer's fit(): its own kept train iterator (the
    # distributed one and its per-device parts), nothing left by an earlier Trainer.
    reports, _ = four_trainers
    fits = [r["iterators"] for r in reports if r["when"] == "fit"]
    assert len(fits) == 5
    assert fits[0] > 0 and fits == [fits[0]] * 5


def test_a_trainer_dropped_without_close_leaves_no_iterator(four_trainers):
    reports, _ = four_trainers
    dropped = [r for r in reports if r["when"] == "dropped"]
    assert [(r["iterators"], r["datasets"]) for r in dropped] == [(0, 0)]


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


@pytest.fixture(scope="module")
def one_fit_of_20_steps() -> list:
    """The weights of one ToyTrainer fit() of 20 steps: what split fits must reach."""
    with toy.ToyTrainer(toy.toy_config(**{"train.steps": 20})) as whole:
        whole.fit()
        return whole.model.get_weights()


def assert_trained_like_one_fit(trainer, reference: list) -> None:
    """``trainer`` is at step 20 with the weights of one fit() to it (``reference``)."""
    assert trainer.step == 20
    assert max_abs_diff(reference, trainer.model.get_weights()) <= 1e-6


def test_a_closed_trainer_fits_on_from_its_step(one_fit_of_20_steps):
    # close() releases; the Trainer stays usable: it continues where it stopped, as a
    # single fit() to the same step would.
    with toy.ToyTrainer(toy.toy_config(**{"train.steps": 10})) as split:
        split.fit()
    split.config.train.steps = 20
    split.fit()
    split.close()
    assert_trained_like_one_fit(split, one_fit_of_20_steps)


def test_a_second_fit_continues_the_iterator_the_first_kept(one_fit_of_20_steps):
    # The notebook cell run again with more steps: no new dataset, no skip; the batches
    # go on where the first fit() stopped, as one fit() to the same step would.
    t = toy.CountingToyTrainer(toy.toy_config(**{"train.steps": 10}))
    t.fit()
    built = t.train_datasets_built
    t.config.train.steps = 20
    t.fit()
    assert t.train_datasets_built == built
    assert_trained_like_one_fit(t, one_fit_of_20_steps)
    t.close()


def test_a_fit_with_a_changed_config_builds_the_input_again(one_fit_of_20_steps):
    # Any config change but train.steps may change the input: the kept iterator is
    # released and the dataset built again, skipping the consumed batches.
    t = toy.CountingToyTrainer(toy.toy_config(**{"train.steps": 10}))
    t.fit()
    built = t.train_datasets_built
    t.config.train.steps = 20
    t.config.train.log_every_steps = 5
    t.fit()
    assert t.train_datasets_built > built
    assert_trained_like_one_fit(t, one_fit_of_20_steps)
    t.close()


def test_a_fit_from_a_restored_step_builds_the_input_again(tmp_path, one_fit_of_20_steps):
    # restore() moves the step back: the kept iterator (at step 20) cannot continue.
    config = toy.toy_config(**{"checkpoint.every_steps": 10, "checkpoint.max_to_keep": 5})
    t = toy.CountingToyTrainer(config, str(tmp_path))
    t.fit()
    assert t.restore(step=10) == 10
    built = t.train_datasets_built
    t.fit()
    assert t.train_datasets_built > built
    assert_trained_like_one_fit(t, one_fit_of_20_steps)
    t.close()
