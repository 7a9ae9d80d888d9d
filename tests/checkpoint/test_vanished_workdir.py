"""A workdir (or its ``checkpoints/``) deleted during training, as ``rm -rf`` by a user
or a cleaner: training goes on, the next save makes ``checkpoints/`` again with one
warning, nothing crashes, and the run's later checkpoints are committed and restore.

The directory is really removed, from a callback run once the checkpoint of step 10 is
announced (an async save of step 10 may still be writing into it).
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import pytest

import trainer
from tests.support import toy
from trainer import errors
from trainer.checkpoint import inventory

STEPS = 40


class RemoveAfterCheckpoint(trainer.Callback):
    """Deletes ``workdir/<target>`` (``""``: the workdir) once step 10's checkpoint is
    announced, as ``rm -rf`` does (a file a save creates meanwhile may stay). With
    ``committed``, first waits until step 10 is committed (an async save may still be
    writing when it is announced): the directory then vanishes between two saves."""

    def __init__(self, target: str, committed: bool):
        self.target, self.committed = target, committed
        self.removed = False

    def on_checkpoint(self, t, step: int) -> None:
        if step != 10:
            return
        for _ in range(600):  # a bounded wait, not a timing
            if not self.committed or os.path.isdir(os.path.join(t.workdir, "checkpoints", "10")):
                break
            time.sleep(0.1)
        shutil.rmtree(os.path.join(t.workdir, self.target), ignore_errors=True)
        self.removed = True


def config(async_save: bool, fast_io: bool):
    return toy.toy_config(**{"train.steps": STEPS, "checkpoint.every_steps": 10,
                             "checkpoint.async_save": async_save,
                             "checkpoint.fast_io": fast_io})


def fit_removing(workdir: str, cfg, remove: RemoveAfterCheckpoint, caplog) -> list[str]:
    """Fits to the end (no error may escape); returns the ``Storage error`` warnings
    and checks that nothing was logged as an error, with or without a traceback."""
    with caplog.at_level(logging.WARNING):
        run = toy.ToyTrainer(cfg, workdir, callbacks=[remove])
        run.fit()
    assert remove.removed and run.step == STEPS
    logged = [r.getMessage()[:300] for r in caplog.records if r.levelno >= logging.ERROR]
    assert not logged and "Traceback" not in caplog.text, logged
    return [r.getMessage() for r in caplog.records if "Storage error" in r.getMessage()]


def assert_later_checkpoints_restore(workdir: str, cfg) -> None:
    good = inventory.last_good(workdir)
    assert good is not None and good.step == STEPS
    assert good.path == os.path.join(workdir, "checkpoints", str(STEPS))
    assert toy.ToyTrainer(cfg, workdir).restore() == STEPS


@pytest.mark.parametrize("target,async_save,fast_io", [
    ("", True, True),               # the workdir
    ("", False, False),
    ("checkpoints", False, True),   # only checkpoints/
    ("checkpoints", True, False),
])
def test_a_directory_deleted_between_saves_is_made_again_by_the_next_with_one_warning(
        tmp_path, caplog, target, async_save, fast_io):
    workdir = str(tmp_path / "run")
    cfg = config(async_save, fast_io)
    storage = fit_removing(workdir, cfg, RemoveAfterCheckpoint(target, committed=True),
                           caplog)
    assert len(storage) == 1, storage
    assert f"checkpoint directory {workdir}/checkpoints vanished" in storage[0], storage
    assert "the checkpoint of step 20 makes it again" in storage[0], storage
    assert_later_checkpoints_restore(workdir, cfg)


@pytest.mark.parametrize("fast_io", [True, False])
def test_a_workdir_deleted_during_an_async_save_costs_that_save_and_nothing_else(
        tmp_path, caplog, fast_io):
    """The deletion cuts step 10's write short or not (a race): at most one warning,
    which says a directory vanished; the run ends normally."""
    workdir = str(tmp_path / "run")
    cfg = config(True, fast_io)
    storage = fit_removing(workdir, cfg, RemoveAfterCheckpoint("", committed=False), caplog)
    assert len(storage) <= 1 and all("vanished" in line for line in storage), storage
    assert_later_checkpoints_restore(workdir, cfg)


def test_a_write_tensorstore_finds_vanished_is_a_storage_fault_not_a_bug():
    """tensorstore (orbax's writer) keeps only its status code for a missing file."""
    error = ValueError('NOT_FOUND: Error opening "zarr" driver: Error reading "model.4/'
                       '.zarray" in OCDBT database at local file "/w/checkpoints/10.orbax-'
                       'checkpoint-tmp/state/ocdbt.process_0/"')
    assert errors.storage_fault(error) == "a directory vanished [No such file or directory]"
    assert errors.storage_fault(ValueError("INVALID_ARGUMENT: NOT_FOUND: x")) is None


def test_files_orbax_finds_gone_when_it_finalizes_a_write_are_a_vanished_directory():
    """The deletion may land between tensorstore's writes and orbax's check of them."""
    error = ValueError("Save failed: 1/15 params are missing .zarray in checkpoint:\n"
                       "/w/checkpoints/10.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp")
    assert errors.storage_fault(error) == "a directory vanished [No such file or directory]"
    assert errors.storage_fault(ValueError("Save failed: params are fine")) is None
