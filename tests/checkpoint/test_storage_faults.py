"""Storage faults on a real file system (a small tmpfs, mounted per test): a disk that
fills before or during a save, a read-only remount mid-run. Each ends with nothing
lost: one ``Storage error`` line naming the path, the step not saved and the last good
checkpoint; the telemetry warns once; once the disk is fixed, the same command resumes
from that checkpoint and finishes.

Mounting needs root: without it the tests are skipped, saying so.
"""

from __future__ import annotations

import logging
import os
import subprocess

import pytest

import trainer
from tests.support import toy
from trainer import errors
from trainer.checkpoint import inventory

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="mounting a tmpfs (mount -t tmpfs) needs root")


@pytest.fixture
def mount_tmpfs():
    """``mount_tmpfs(directory)`` mounts a 4 MB tmpfs there (made if need be); every
    mount is undone at teardown."""
    mounted = []

    def mount(directory) -> None:
        os.makedirs(directory, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(directory)],
                       check=True)
        mounted.append(directory)

    yield mount
    for directory in reversed(mounted):
        subprocess.run(["mount", "-o", "remount,rw", str(directory)], check=False)
        subprocess.run(["umount", "-l", str(directory)], check=True)


@pytest.fixture
def small_disk(tmp_path, mount_tmpfs):
    """A 4 MB tmpfs at ``tmp_path/fs``."""
    mount_tmpfs(tmp_path / "fs")
    return tmp_path / "fs"


def fill(mountpoint, leave: int = 0) -> None:
    """Fills the file system at ``mountpoint`` up to ``leave`` free bytes."""
    stat = os.statvfs(mountpoint)
    size = max(stat.f_bavail * stat.f_frsize - leave, 0)
    with open(mountpoint / "filler", "wb") as f:
        try:
            f.write(b"\0" * size)
        except OSError:
            pass  # full before the end of it (leave=0)


class AfterCheckpoint(trainer.Callback):
    """Runs ``fault()`` once the checkpoint of ``step`` is announced."""

    def __init__(self, step: int, fault):
        self.step, self.fault = step, fault

    def on_checkpoint(self, t, step: int) -> None:
        if step == self.step:
            self.fault()


def config(async_save: bool, fast_io: bool = True):
    return toy.toy_config(**{"train.steps": 40, "checkpoint.every_steps": 10,
                             "checkpoint.async_save": async_save,
                             "checkpoint.fast_io": fast_io})


def fit_until_storage_error(workdir: str, cfg, fault: AfterCheckpoint, caplog):
    """Fits; returns the StorageError, the one line it prints, and the warnings."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        with pytest.raises(errors.StorageError) as raised:
            toy.ToyTrainer(cfg, workdir, callbacks=[fault]).fit()
    return raised.value, caplog.text


def assert_one_line(error, capsys) -> str:
    capsys.readouterr()
    assert errors.report(error) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("Storage error: cannot write the checkpoint of step ")
    return err


def assert_resumes(workdir: str, cfg, step: int | None) -> None:
    """The run started again resumes from ``step`` and finishes."""
    resumed = toy.ToyTrainer(cfg, workdir)
    assert resumed.restore() == step
    resumed.fit()
    assert resumed.step == 40
    assert inventory.last_good(workdir).step == 40


@pytest.mark.parametrize("fast_io", [True, False])
def test_a_disk_full_before_a_save_stops_at_the_second_failed_save_naming_the_last_good(
        small_disk, caplog, capsys, fast_io):
    workdir = str(small_disk / "run")
    cfg = config(async_save=False, fast_io=fast_io)
    error, warnings = fit_until_storage_error(
        workdir, cfg, AfterCheckpoint(10, lambda: fill(small_disk)), caplog)
    line = assert_one_line(error, capsys)
    # step 20 failed (one warning, training went on), step 30 failed too: the run stops
    assert "Storage error (training goes on; the next save retries" in warnings
    assert "checkpoint of step 20" in warnings
    assert (f"step 30 to {workdir}/checkpoints: the disk is full [No space left on device]; "
            f"the last good checkpoint is step 10 ({workdir}/checkpoints/10)") in line
    assert warnings.count("Cannot write the run's jsonl records") <= 1
    assert warnings.count("Cannot write the run's tensorboard records") <= 1
    os.remove(small_disk / "filler")
    assert_resumes(workdir, cfg, 10)


def test_a_disk_that_fills_during_an_async_save_loses_nothing(small_disk, caplog, capsys):
    """The disk keeps 16 KB free after step 10: the next save starts and fails midway
    (in orbax's background thread)."""
    workdir = str(small_disk / "run")
    cfg = config(async_save=True)
    error, _ = fit_until_storage_error(
        workdir, cfg, AfterCheckpoint(10, lambda: fill(small_disk, leave=16384)), caplog)
    line = assert_one_line(error, capsys)
    # step 10's own async write may have been cut by the filling too: the last good
    # checkpoint is what is on disk and verifies
    good = inventory.last_good(workdir)
    assert f"the last good checkpoint is {inventory.describe_last_good(workdir)}" in line
    assert good is None or good.step == 10
    os.remove(small_disk / "filler")
    assert_resumes(workdir, cfg, good and good.step)


def test_a_read_only_remount_mid_run_stops_naming_the_last_good_and_resumes(
        tmp_path, mount_tmpfs, caplog, capsys):
    """The checkpoints live on their own tmpfs, remounted read-only once step 10 is
    saved (a file system holding open files, as the run's metrics.jsonl, refuses it)."""
    workdir = str(tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    mount_tmpfs(checkpoints)
    cfg = config(async_save=False)

    def read_only() -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(checkpoints)], check=True)

    error, warnings = fit_until_storage_error(workdir, cfg, AfterCheckpoint(10, read_only),
                                              caplog)
    line = assert_one_line(error, capsys)
    assert "the file system is read-only [Read-only file system]" in line
    assert f"the last good checkpoint is step 10 ({workdir}/checkpoints/10)" in line
    subprocess.run(["mount", "-o", "remount,rw", str(checkpoints)], check=True)
    assert_resumes(workdir, cfg, 10)


def test_telemetry_that_cannot_be_written_warns_once_per_output_and_never_raises(
        small_disk, caplog):
    from trainer.telemetry.summaries import SummaryWriters

    writers = SummaryWriters(str(small_disk / "run"))
    fill(small_disk)
    record = {"kind": "train", "time": 0.0, **{f"train/value_{i}": 1.0 for i in range(20)}}
    with caplog.at_level(logging.WARNING):
        for step in range(1, 100):  # ~50 KB of metrics.jsonl, many TensorBoard events
            writers.write({**record, "step": step})
        writers.close()
    assert caplog.text.count("Cannot write the run's jsonl records") == 1, caplog.text
    assert caplog.text.count("Cannot write the run's tensorboard records") == 1, caplog.text
    assert "the disk is full [No space left on device]" in caplog.text
