"""Checkpointing (trainer.checkpoint.state / checkpoint_store / checkpointing) in one process: state round trip, keep-N and best-N policy,
clear errors for missing / incompatible / corrupt checkpoints, export.

Multi-process behaviour (kill, preemption, crash mid-write, replica changes, multiple
workers) is in test_checkpoint_resume.py.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support import toy
from tests.support.checkpoint_service import HeldStore, ServiceRun, set_step, weights_of
from tests.conftest import subprocess_env
from trainer.checkpoint import state as checkpoint_state
from trainer.checkpoint.service import Checkpointer
from trainer.checkpoint.state import CheckpointError
from trainer.checkpoint.storage.reader import LATEST_DIR
from trainer.checkpoint.storage.writer import CheckpointWriter
from trainer.config import ConfigError, validate
from trainer.step.random_streams import GLOBAL_NAME


def adam_config(**overrides):
    return toy.toy_config(**{"optimizer.name": "adam", "optimizer.learning_rate": 0.01,
                             "checkpoint.every_steps": 10, **overrides})


class WideToyTrainer(toy.ToyTrainer):
    """The toy model with 32 hidden units instead of 16 (an incompatible change)."""

    def build_model(self):
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="tanh"),
                                 keras.layers.Dense(3)])


class DeeperToyTrainer(toy.ToyTrainer):
    """The toy model with one more layer at the end (variables the checkpoint lacks)."""

    def build_model(self):
        model = super().build_model()
        model.add(keras.layers.Dense(3))
        return model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A ToyTrainer (Adam) trained 20 steps with checkpoints at 10 and 20 (.npy arrays)."""
    workdir = str(tmp_path_factory.mktemp("trained"))
    trainer = toy.ToyTrainer(adam_config(**{"checkpoint.fast_io": True}), workdir)
    trainer.fit()
    return trainer


def all_values(trainer) -> dict:
    return {f"{g}/{name}": np.asarray(v.numpy())
            for g, entries in checkpoint_state.state_variables(trainer.context).items()
            for name, v in entries}


def assert_same_state(got_trainer, want_trainer) -> None:
    """Every checkpointed variable of the two trainers is bitwise equal."""
    got, want = all_values(got_trainer), all_values(want_trainer)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def fresh_run(steps: int) -> toy.ToyTrainer:
    """A ToyTrainer (Adam, no workdir) trained ``steps`` steps from scratch."""
    trainer = toy.ToyTrainer(adam_config(**{"train.steps": steps}))
    trainer.fit()
    return trainer


def test_restore_sets_every_variable_and_the_step(trained):
    fresh = toy.ToyTrainer(adam_config(), trained.workdir)
    assert fresh.restore() == 20
    assert fresh.step == 20
    assert {k.split("/")[0] for k in all_values(trained)} == {"model", "optimizer", "trainer"}
    assert_same_state(fresh, trained)
    assert int(fresh.optimizer.iterations.numpy()) == 20
    assert int(fresh.step_counter.numpy()) == 20


def test_restore_of_an_earlier_step(trained):
    fresh = toy.ToyTrainer(adam_config(), trained.workdir)
    assert fresh.restore(step=10) == 10
    assert_same_state(fresh, fresh_run(10))
    assert not np.array_equal(fresh.model.get_weights()[0], trained.model.get_weights()[0])


def test_async_saves_reuse_host_buffers_only_after_the_previous_write(tmp_path):
    """The race, forced: the store holds the async write of step 5 in flight until it is
    waited for, and then writes the arrays it was handed, the service's snapshot buffers.
    The save of step 10 reuses those buffers: had it refilled them before waiting for
    step 5's write, step 5's checkpoint would hold step 10's values."""
    config = adam_config(**{"train.steps": 10, "checkpoint.every_steps": 5,
                            "checkpoint.fast_io": True})
    workdir = str(tmp_path)
    trainer = toy.ToyTrainer(config, workdir)
    trainer.context.ensure_built()
    store = HeldStore(workdir, config.checkpoint, "")
    store.slow = True
    service = Checkpointer(config, workdir, True, writer=store)
    run = ServiceRun(trainer, workdir)
    service.on_fit_start(run)
    set_step(trainer, 5)
    service.on_loop_end(run)
    assert store.in_flight(LATEST_DIR) == 5 and store.written == []  # held: the race is on
    set_step(trainer, 10)
    service.on_loop_end(run)
    assert store.written == [5]  # step 10's save waited for step 5's write (10's is held)
    service.on_fit_end(run, {})
    assert store.written == [5, 10] and run.announced == [5, 10]
    for step in (5, 10):
        restored = toy.ToyTrainer(config, workdir)
        assert restored.restore(step=step) == step
        assert weights_of(restored) == step


@pytest.mark.parametrize("fast_io", [False, True])
def test_both_array_formats_restore_bitwise_under_either_setting(tmp_path, fast_io):
    """Default: orbax's stock tensorstore (OCDBT) handler, readable by any orbax user;
    checkpoint.fast_io: O_DIRECT .npy files. A run restores either, whatever it uses."""
    written = toy.ToyTrainer(adam_config(**{"train.steps": 10, "checkpoint.fast_io": fast_io}),
                             str(tmp_path))
    written.fit()
    state_dir = tmp_path / "checkpoints" / "10" / "state"
    assert bool(list(state_dir.glob("*.npy"))) == fast_io
    assert (state_dir / "manifest.ocdbt").exists() != fast_io
    restored = toy.ToyTrainer(adam_config(**{"checkpoint.fast_io": not fast_io}), str(tmp_path))
    assert restored.restore() == 10
    assert_same_state(restored, written)


def test_stock_checkpoints_read_with_plain_orbax(tmp_path):
    """Without checkpoint.fast_io any orbax user reads the arrays (no trainer code)."""
    import orbax.checkpoint as ocp

    written = toy.ToyTrainer(adam_config(**{"train.steps": 10}), str(tmp_path))
    written.fit()
    restored = ocp.PyTreeCheckpointer().restore(str(tmp_path / "checkpoints" / "10" / "state"))
    np.testing.assert_array_equal(restored["model"][0], written.model.get_weights()[0])


def test_restore_matches_variables_by_name_not_by_creation_count(tmp_path):
    """Models built earlier in the process (dense, dense_1, ...) do not shift the names
    a Trainer's variables get, so its checkpoint still matches."""
    written = toy.ToyTrainer(adam_config(**{"train.steps": 10}), str(tmp_path))
    written.fit()
    keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(3)])
    restored = toy.ToyTrainer(adam_config(), str(tmp_path))
    assert restored.restore() == 10
    assert_same_state(restored, written)
    names = [name for name, _ in checkpoint_state.state_variables(restored.context)["model"]]
    assert names == [name for name, _ in checkpoint_state.state_variables(written.context)["model"]]


def test_snapshot_is_a_copy_and_refills_the_buffers_it_is_given():
    trainer = fresh_run(5)
    first, manifest = checkpoint_state.snapshot(trainer.context)
    assert manifest["step"] == 5
    kernel = first["model"][0].copy()
    trainer.config.train.steps = 10
    trainer.fit()
    np.testing.assert_array_equal(first["model"][0], kernel)  # training did not touch it
    second, _ = checkpoint_state.snapshot(trainer.context, reuse=first)
    assert second["model"][0] is first["model"][0]  # the same host memory, refilled
    np.testing.assert_array_equal(second["model"][0], trainer.model.get_weights()[0])
    assert not np.array_equal(second["model"][0], kernel)
    assert all(isinstance(a, np.ndarray) for g in second.values() for a in g)


def test_no_workdir_or_empty_workdir_restores_nothing(tmp_path):
    assert toy.ToyTrainer(adam_config()).restore() is None
    assert toy.ToyTrainer(adam_config(), str(tmp_path)).restore() is None


def test_missing_step_lists_the_available_ones(trained):
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 99 .*\[10, 20\]"):
        toy.ToyTrainer(adam_config(), trained.workdir).restore(step=99)


def test_shape_change_names_the_variable_and_both_shapes(trained):
    with pytest.raises(CheckpointError) as error:
        WideToyTrainer(adam_config(), trained.workdir).restore()
    message = str(error.value)
    assert "dense" in message and "/kernel' has shape [8, 32]" in message
    assert "shape [8, 16]" in message and "fresh --workdir" in message


def test_missing_variable_is_named(trained):
    with pytest.raises(CheckpointError,
                       match=r"Variable '.*dense_\d+/kernel' \(model, shape \[3, 3\]\) is "
                             r"missing from checkpoint"):
        DeeperToyTrainer(adam_config(), trained.workdir).restore()


class UnseededDropoutTrainer(toy.ToyTrainer):
    """The toy whose loss sees its logits through ``keras.random.dropout`` without a seed
    (Keras' global generator); with ``hold_noise``, a SeedGenerator of its own too."""

    hold_noise = False

    def build_model(self):
        if self.hold_noise:
            self.noise = keras.random.SeedGenerator(3)
        return super().build_model()

    def compute_loss(self, batch, outputs):
        return super().compute_loss(batch, keras.random.dropout(outputs, 0.25))


def global_state(trainer) -> np.ndarray:
    return np.asarray(dict(trainer.context.random_states())[GLOBAL_NAME].numpy())


@pytest.mark.parametrize("hold_noise", [False, True])
def test_a_checkpoint_without_the_global_generator_restores_it_as_it_is(tmp_path, hold_noise):
    """A checkpoint of an earlier version (or written before the step drew) has no
    entry for the Keras global generator's state: the restore keeps its initial
    state. One written after the step drew from it restores it."""
    config = adam_config(**{"train.steps": 4, "checkpoint.every_steps": 4})
    trainer_class = type("Trainer", (UnseededDropoutTrainer,), {"hold_noise": hold_noise})
    written = trainer_class(config, str(tmp_path / "new"))
    initial = global_state(written)
    written.fit()
    assert not np.array_equal(global_state(written), initial)  # the step drew from it
    state, manifest = checkpoint_state.snapshot(written.context)
    assert manifest["groups"]["random"][-1][0] == GLOBAL_NAME
    state["random"].pop()  # as an earlier version wrote it
    manifest["groups"]["random"].pop()
    if not manifest["groups"]["random"]:
        del state["random"], manifest["groups"]["random"]
    old = CheckpointWriter(str(tmp_path / "old"), config.checkpoint, "")
    old.save(LATEST_DIR, 4, state, manifest, wait=True)
    old.close()
    restored = trainer_class(config, str(tmp_path / "old"))
    assert restored.restore() == 4
    np.testing.assert_array_equal(global_state(restored), initial)
    for got, want in zip(restored.model.get_weights(), written.model.get_weights()):
        np.testing.assert_array_equal(got, want)
    resumed = trainer_class(config, str(tmp_path / "new"))
    assert resumed.restore() == 4
    np.testing.assert_array_equal(global_state(resumed), global_state(written))


@pytest.mark.parametrize("damage", ["garbage", "one_missing"])
def test_corrupt_latest_step_is_skipped_with_a_warning_and_named_when_asked_for(
        trained, tmp_path, caplog, damage):
    workdir = tmp_path / "w"
    os.makedirs(workdir)
    subprocess.run(["cp", "-r", os.path.join(trained.workdir, "checkpoints"), str(workdir)],
                   check=True)
    files = sorted(glob.glob(str(workdir / "checkpoints" / "20" / "state" / "*.npy")))
    assert len(files) == len(all_values(trained))
    if damage == "one_missing":
        os.remove(files[-1])
    else:
        for path in files:
            with open(path, "wb") as f:
                f.write(b"garbage")
    fresh = toy.ToyTrainer(adam_config(), str(workdir))
    with caplog.at_level(logging.WARNING):
        assert fresh.restore() == 10
    assert any("Skipping checkpoint" in r.getMessage() and "/20" in r.getMessage()
               for r in caplog.records), caplog.text
    with pytest.raises(CheckpointError,
                       match=r"checkpoints/20: cannot read variable '[^']+'"):
        fresh.restore(step=20)


class ScoreTrainer(toy.ToyEvalTrainer):
    """Reports eval/score from a fixed table by step, so the best steps are known."""

    SCORES = {5: 0.3, 10: 0.9, 15: 0.5, 20: 0.7, 25: 0.2, 30: 0.1}

    def build_metrics(self):
        trainer = self

        class Score(keras.metrics.Metric):
            def update_state(self, *args, **kwargs):
                pass

            def reset_state(self):
                pass

            def result(self):
                return tf.constant(trainer.SCORES.get(trainer.step, 0.0))

        return {"score": Score(name="score")}


def test_best_metric_keeps_the_best_and_the_latest_within_max_to_keep(tmp_path):
    config = adam_config(**{"train.steps": 30, "train.log_every_steps": 5,
                            "eval.every_steps": 5, "checkpoint.every_steps": 5,
                            "checkpoint.max_to_keep": 2, "checkpoint.best_metric": "eval/score"})
    trainer = ScoreTrainer(config, str(tmp_path))
    trainer.fit()
    assert sorted(os.listdir(tmp_path / "checkpoints"), key=int) == ["25", "30"]
    assert sorted(os.listdir(tmp_path / "checkpoints_best"), key=int) == ["10", "20"]
    best = json.loads((tmp_path / "export" / "best" / "best.json").read_text())
    assert best == {"step": 10, "score": pytest.approx(0.9)}
    # The export is the step-10 model; the trainer keeps its step-30 weights.
    step10 = toy.ToyTrainer(adam_config(), str(tmp_path))
    step10.restore(step=10)
    x = toy.toy_data(4)[0]
    loaded = tf.saved_model.load(str(tmp_path / "export" / "best"))
    served = loaded.serve(x).numpy()
    np.testing.assert_allclose(served, step10.model(x).numpy(), rtol=1e-6)
    assert not np.allclose(served, trainer.model(x).numpy())


def test_best_metric_min_mode(tmp_path):
    config = adam_config(**{"train.steps": 30, "train.log_every_steps": 5,
                            "eval.every_steps": 5, "checkpoint.every_steps": 5,
                            "checkpoint.max_to_keep": 1, "checkpoint.best_metric": "eval/score",
                            "checkpoint.best_mode": "min", "checkpoint.async_save": False})
    ScoreTrainer(config, str(tmp_path)).fit()
    assert os.listdir(tmp_path / "checkpoints") == ["30"]
    assert os.listdir(tmp_path / "checkpoints_best") == ["30"]


@pytest.mark.parametrize("metric", ["accuracy", "val/accuracy", "eval/"])
def test_best_metric_must_name_a_train_or_eval_value(metric):
    with pytest.raises(ConfigError, match="checkpoint.best_metric"):
        validate(adam_config(**{"checkpoint.best_metric": metric}))


def test_eval_best_metric_without_eval_dataset_is_a_config_error(tmp_path):
    trainer = toy.ToyTrainer(adam_config(**{"checkpoint.best_metric": "eval/accuracy"}),
                             str(tmp_path))
    with pytest.raises(ConfigError, match="needs an eval dataset"):
        trainer.fit()


def test_export_loads_in_a_fresh_process(trained, tmp_path):
    path = tmp_path / "exported"
    trained.export(str(path))
    x = toy.toy_data(5)[0]
    script = ("import sys, numpy as np, tensorflow as tf\n"
              "m = tf.saved_model.load(sys.argv[1])\n"
              "x = np.load(sys.argv[2])\n"
              "print(list(m.signatures))\n"
              "np.save(sys.argv[3], m.signatures['serving_default'](tf.constant(x))"
              "['output_0'].numpy())\n")
    np.save(tmp_path / "x.npy", x)
    run = subprocess.run([sys.executable, "-c", script, str(path), str(tmp_path / "x.npy"),
                          str(tmp_path / "y.npy")], cwd=tmp_path, env=subprocess_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "serving_default" in run.stdout
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), trained.model(x).numpy(), rtol=1e-6)
