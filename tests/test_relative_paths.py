"""A relative path a user passes (``--workdir=runs/exp1``, ``config.data.data_dir``, an
export path) is made absolute where it is read: the command line, the Python API and the
launchers (a Slurm script resolves it on the submitting machine). Orbax refuses relative
checkpoint paths: a relative workdir used to train, then end at the first checkpoint in
an internal error."""

from __future__ import annotations

import os
import subprocess
import sys

from launch import multiworker
from tests.support import toy
from tests.support.helpers import REPO, subprocess_env
from trainer import Trainer

CONFIG = str(REPO / "tests" / "support" / "run_checkpoint.py")


def test_the_command_line_trains_and_checkpoints_in_a_relative_workdir(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "trainer.main", f"--config={CONFIG}", "--workdir=runs/exp1",
         "--config.train.steps=20"],
        cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Internal error" not in run.stderr
    steps = sorted(int(p.name) for p in (tmp_path / "runs" / "exp1" / "checkpoints").iterdir()
                   if p.name.isdigit())
    assert steps[-1] == 20, steps
    assert (tmp_path / "runs" / "exp1" / "config.json").is_file()


def test_the_python_api_resolves_workdir_data_dir_and_export_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = toy.toy_config(**{"train.steps": 10, "checkpoint.every_steps": 10})
    config.data = {"data_dir": "tfds"}
    with toy.ToyTrainer(config, "runs/api") as trainer:
        assert trainer.workdir == str(tmp_path / "runs" / "api")
        assert config.data.data_dir == str(tmp_path / "tfds")
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        os.chdir(elsewhere)  # a notebook that changes directory after building its Trainer
        trainer.fit()
        trainer.export("model")  # relative to the directory of this call
        assert trainer.restore() == 10
    assert (tmp_path / "runs" / "api" / "checkpoints" / "10").is_dir()
    assert (elsewhere / "model" / "saved_model.pb").is_file()


def test_the_launchers_resolve_paths_where_they_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flags = [f"--config={CONFIG}", "--workdir=runs/exp1", "--config.data.data_dir", "tfds"]
    local = multiworker.parse(["--workers", "2", *flags])
    assert f"--workdir={tmp_path / 'runs' / 'exp1'}" in local.trainer_flags
    assert local.trainer_flags[local.trainer_flags.index("--config.data.data_dir") + 1] == (
        str(tmp_path / "tfds"))
    # A TFJob's paths are the containers': they stay as written.
    tfjob = multiworker.parse(["--workers", "2", "--emit", "tfjob", *flags])
    assert "--workdir=runs/exp1" in tfjob.trainer_flags


def test_an_emitted_slurm_script_names_the_absolute_workdir(tmp_path):
    out = tmp_path / "job.sbatch"
    run = subprocess.run(
        [sys.executable, "-m", "launch.multiworker", "--workers", "2", "--emit", "slurm",
         "--output", str(out), f"--config={CONFIG}", "--workdir=runs/exp1"],
        cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    script = out.read_text()
    assert f"--workdir={tmp_path / 'runs' / 'exp1'}" in script
    assert "--workdir=runs/exp1" not in script
