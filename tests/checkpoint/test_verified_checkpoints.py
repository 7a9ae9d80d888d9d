"""Verified checkpoints: every file of a step is covered by a CRC32C written with it; a
damaged file (one byte flipped, removed, truncated) is named with its step and the
restore falls back to the newest step that verifies; the inspect command lists each
step's state. Faults of a real file system during a save are in test_storage_faults.py.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf

import trainer
from tests.support import toy
from trainer import errors
from trainer.checkpoint.storage import checksums
from trainer.checkpoint import inventory
from trainer.checkpoint import show as checkpoint_show
from trainer.checkpoint.state import CheckpointError
from trainer.precision import NonFiniteError


def config(fast_io: bool):
    return toy.toy_config(**{"checkpoint.every_steps": 10, "checkpoint.fast_io": fast_io})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``{fast_io: workdir}``: the toy trained 20 steps, checkpoints at 10 and 20, with
    orbax's stock arrays (False) and the ``.npy`` arrays (True)."""
    out = {}
    for fast_io in (False, True):
        workdir = str(tmp_path_factory.mktemp(f"fast_io_{fast_io}"))
        toy.ToyTrainer(config(fast_io), workdir).fit()
        out[fast_io] = workdir
    return out


@pytest.fixture
def copy_of(trained, tmp_path):
    def copy(fast_io: bool) -> str:
        workdir = str(tmp_path / f"w{int(fast_io)}")
        shutil.copytree(trained[fast_io], workdir)
        return workdir
    return copy


def flip_one_byte(path: str) -> None:
    """Flips one bit of the byte in the middle of the data (the file keeps its size)."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        at = len(data) // 2 if len(data) < 8192 else 4096 + (len(data) - 4096) // 2
        data[at] ^= 0x01
        f.seek(0)
        f.write(data)


def restore_warnings(workdir: str, fast_io: bool, caplog) -> tuple[int, str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        step = toy.ToyTrainer(config(fast_io), workdir).restore()
    return step, caplog.text


# (format, file of step 20 relative to the step directory, how it is damaged)
DAMAGES = [
    (True, "state/model.0.npy", "flip"),          # an array file of ours
    (True, "state/optimizer.2.npy", "remove"),
    (False, "state/d/*", "flip"),                  # an OCDBT data file of orbax's
    (False, "state/manifest.ocdbt", "flip"),
    (False, "state/_METADATA", "flip"),            # orbax's pytree metadata
    (True, "state/_METADATA", "truncate"),
    (False, "manifest/metadata", "flip"),          # our JSON manifest
    (True, "manifest/metadata", "truncate"),
    (False, "state/" + checksums.FILE, "remove"),  # the checksums themselves
]


@pytest.mark.parametrize("fast_io,pattern,damage", DAMAGES)
def test_a_damaged_file_is_named_and_the_restore_falls_back_to_the_newest_good_step(
        copy_of, caplog, fast_io, pattern, damage):
    workdir = copy_of(fast_io)
    path = sorted(glob.glob(os.path.join(workdir, "checkpoints", "20", pattern)))[0]
    rel = os.path.relpath(path, os.path.join(workdir, "checkpoints", "20"))
    if damage == "flip":
        flip_one_byte(path)
    elif damage == "remove":
        os.remove(path)
    else:
        os.truncate(path, os.path.getsize(path) // 2)
    step, warnings = restore_warnings(workdir, fast_io, caplog)
    assert step == 10
    skipped = [line for line in warnings.splitlines() if "Skipping checkpoint" in line]
    assert len(skipped) == 1 and f"{workdir}/checkpoints/20: " in skipped[0]
    # the file, then what is wrong with it (after the reader's own error, if it failed)
    assert f"{rel} " in skipped[0], skipped
    if rel.endswith(".npy"):  # an array file of ours: its variable too
        assert re.search(r"cannot read variable '(sequential/dense/kernel|sgd/\w+)'",
                         skipped[0]), skipped
    with pytest.raises(CheckpointError, match=f"checkpoints/20: .*{rel} "):
        toy.ToyTrainer(config(fast_io), workdir).restore(step=20)
    states = {e.step: e.state for e in inventory.survey(workdir)}
    assert states == {20: inventory.CORRUPT, 10: inventory.COMPLETE}


@pytest.mark.parametrize("fast_io", [False, True])
def test_a_corrupt_step_is_replaced_when_training_saves_that_step_again(copy_of, caplog,
                                                                        fast_io):
    """Resumed from 10 (20 is damaged), the run trains to 20 again: its save of 20
    replaces the damaged copy (one warning), so the next resume takes 20, not 10 again."""
    workdir = copy_of(fast_io)
    flip_one_byte(os.path.join(workdir, "checkpoints", "20", "manifest", "metadata"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        rerun = toy.ToyTrainer(config(fast_io), workdir)
        rerun.fit()
    replaced = [line for line in caplog.text.splitlines() if "is corrupt" in line]
    assert len(replaced) == 1 and "replaced by this run's save of that step" in replaced[0]
    states = {e.step: e.state for e in inventory.survey(workdir)}
    assert states == {20: inventory.COMPLETE, 10: inventory.COMPLETE}
    assert restore_warnings(workdir, fast_io, caplog) == (20, "")


@pytest.mark.parametrize("fast_io", [False, True])
def test_every_file_of_both_items_is_covered(trained, fast_io):
    step_dir = os.path.join(trained[fast_io], "checkpoints", "20")
    for item in checksums.ITEMS:
        directory = os.path.join(step_dir, item)
        with open(os.path.join(directory, checksums.FILE)) as f:
            table = json.load(f)["files"]
        on_disk = {os.path.relpath(os.path.join(root, n), directory)
                   for root, _, names in os.walk(directory) for n in names
                   if n not in checksums.NOT_COVERED}
        assert set(table) == on_disk and on_disk
        for rel, (size, crc) in table.items():
            assert checksums.file_crc(os.path.join(directory, rel)) == (size, crc)


@pytest.mark.parametrize("rows", [1000, 100_000], ids=["inline", "in_a_thread"])
def test_the_npy_checksums_computed_while_writing_and_reading_are_those_of_the_files(
        tmp_path, rows):
    from trainer.checkpoint.storage import array_files

    array = array_files.aligned_empty((rows, 3), np.float32)
    array[:] = np.arange(3 * rows, dtype=np.float32).reshape(rows, 3)
    assert (array.nbytes >= array_files.BACKGROUND_CRC_BYTES) == (rows > 1000)
    path = str(tmp_path / "a.npy")
    assert array_files.write_npy(path, array) == checksums.file_crc(path)
    assert array_files.read_npy(path)[1] == checksums.file_crc(path)


def test_a_restore_hands_the_checksums_of_the_npy_bytes_it_read_to_the_check(trained):
    from trainer.checkpoint.storage import reader

    step_dir = os.path.join(trained[True], "checkpoints", "20")
    _, known = reader.read_state(step_dir, reader.read_manifest(step_dir))
    with open(os.path.join(step_dir, "state", checksums.FILE)) as f:
        table = json.load(f)["files"]
    arrays = [rel for rel in table if rel.endswith(".npy")]
    assert arrays
    for rel in arrays:  # by the path the check looks them up with, as written
        assert known(os.path.join(step_dir, "state", rel)) == tuple(table[rel]), rel
    assert known(os.path.join(step_dir, "state", "_METADATA")) is None  # read by the check


def test_a_checkpoint_without_checksums_restores_and_says_so_once(copy_of, caplog):
    workdir = copy_of(True)
    for path in glob.glob(os.path.join(workdir, "checkpoints", "*", "*", checksums.FILE)):
        os.remove(path)
    step, warnings = restore_warnings(workdir, True, caplog)
    assert step == 20 and warnings.count("have no checksums") == 1, warnings
    assert {e.detail for e in inventory.survey(workdir)} == {
        "no checksums (an earlier version)"}


def damage_every_step(workdir: str) -> None:
    for path in glob.glob(os.path.join(workdir, "checkpoints", "*", "state", "model.0.npy")):
        flip_one_byte(path)


def assert_one_line(error, capsys) -> str:
    capsys.readouterr()
    assert errors.report(error) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_workdir_whose_every_checkpoint_is_corrupt_is_one_line_naming_no_last_good(
        copy_of, capsys):
    workdir = copy_of(True)
    damage_every_step(workdir)
    with pytest.raises(CheckpointError) as raised:
        toy.ToyTrainer(config(True), workdir).restore()
    line = assert_one_line(raised.value, capsys)
    assert line.startswith("Checkpoint error: No readable checkpoint: the last good checkpoint "
                           f"is none (no complete checkpoint in {workdir}). "), line
    for step in (20, 10):
        assert f"{workdir}/checkpoints/{step}: cannot read variable" in line, line


def test_a_step_asked_for_that_is_corrupt_names_the_last_good_one(copy_of, capsys):
    workdir = copy_of(True)
    flip_one_byte(os.path.join(workdir, "checkpoints", "20", "state", "model.0.npy"))
    with pytest.raises(CheckpointError) as raised:
        toy.ToyTrainer(config(True), workdir).restore(step=20)
    line = assert_one_line(raised.value, capsys)
    assert ("No readable checkpoint of step 20: the last good checkpoint is step 10 "
            f"({workdir}/checkpoints/10). ") in line, line


class DamageEveryStepAt(trainer.Callback):
    """Damages every checkpoint on disk once the checkpoint of ``step`` is announced."""

    def __init__(self, step: int):
        self.step = step

    def on_checkpoint(self, t, step: int) -> None:
        if step == self.step:
            damage_every_step(t.workdir)


def test_a_rollback_with_every_checkpoint_corrupt_is_one_line_naming_no_last_good(
        tmp_path, capsys):
    """Step 12's batch holds an inf; checkpoints 5 and 10 are damaged before the
    rollback at the end of the loop of steps 11-15 tries them."""
    from tests.support.run_controls import poisoned_trainer

    workdir = str(tmp_path / "run")
    cfg = toy.toy_config(**{"train.steps": 20, "checkpoint.every_steps": 5,
                            "checkpoint.async_save": False, "checkpoint.fast_io": True,
                            "train.on_nonfinite": "rollback"})
    run = poisoned_trainer(toy, tf)(cfg, workdir, callbacks=[DamageEveryStepAt(10)])
    with pytest.raises(NonFiniteError) as raised:
        run.fit()
    line = assert_one_line(raised.value, capsys)
    assert line.startswith("Non-finite error: Step 15: "), line
    assert ("the rollback could not restore a checkpoint: No readable checkpoint: the last "
            f"good checkpoint is none (no complete checkpoint in {workdir}). ") in line, line


def test_a_rollback_before_any_checkpoint_names_no_last_good(tmp_path, capsys):
    from tests.support.run_controls import poisoned_trainer

    workdir = str(tmp_path / "run")
    cfg = toy.toy_config(**{"train.steps": 20, "checkpoint.every_steps": 20,
                            "train.on_nonfinite": "rollback"})
    with pytest.raises(NonFiniteError) as raised:
        poisoned_trainer(toy, tf)(cfg, workdir).fit()
    line = assert_one_line(raised.value, capsys)
    assert ("and there is no checkpoint to roll back to (the last good checkpoint is none "
            f"(no complete checkpoint in {workdir})). ") in line, line


def test_inspect_lists_complete_incomplete_and_corrupt_steps(copy_of, capsys):
    workdir = copy_of(True)
    checkpoints = os.path.join(workdir, "checkpoints")
    shutil.copytree(os.path.join(checkpoints, "20"),
                    os.path.join(checkpoints, "30.orbax-checkpoint-tmp-1234"))
    flip_one_byte(os.path.join(checkpoints, "20", "state", "model.1.npy"))
    assert checkpoint_show.main([f"--workdir={workdir}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "state", "path", "detail"]
    assert [line.split()[:2] for line in lines[1:4]] == [
        ["30", "incomplete"], ["20", "corrupt"], ["10", "complete"]]
    assert "state/model.1.npy does not match its CRC32C" in lines[2]
    assert lines[-1] == f"resume: step 10 ({checkpoints}/10)"


def test_inspect_of_a_missing_workdir_is_one_line(tmp_path, capsys):
    assert checkpoint_show.main([f"--workdir={tmp_path}/nope"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("Workdir error: --workdir=") and "Traceback" not in "".join(err)
