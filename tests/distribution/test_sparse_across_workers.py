"""Sparse gradients across real worker processes: the text classifier (Embedding over
padded variable-length batches, custom metric, custom train_step) trained by
``python -m launch.multiworker --workers 2`` reaches the weights of one process.

Two workers all-gather their rows at a capacity of the ladder
(``trainer.step.sparse_gradients``), or all-reduce densely; both are compared. A 600 x 16
table on 2 workers has the capacities 64, 128 and 256 rows below its dense branch; a
replica's batch of 16 sequences of 2-40 tokens touches about 100 to 400 rows, so steps
take the larger capacities and the dense branch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from models.text_classifier import TextClassifierTrainer
from models.configs.text_classifier import get_config as text_config
from tests.support.helpers import REPO, relative_diff, subprocess_env

CONFIG = f"--config={REPO / 'models' / 'configs' / 'text_classifier.py'}"
OVERRIDES = {"train.steps": 20, "train.steps_per_loop": 5, "train.log_every_steps": 10,
             "eval.every_steps": 0, "perf.plan": "fixed", "model.vocab": 600,
             "data.examples": 512, "data.min_len": 2, "data.max_len": 40}
FLAGS = [f"--config.{key}={value}" for key, value in OVERRIDES.items()]
TOL = 1e-5


def _start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Workdirs: one process, 2 workers gathering rows, 2 workers densifying."""
    base = tmp_path_factory.mktemp("sparse_workers")
    argv = {
        "one": [sys.executable, "-m", "trainer.main", CONFIG, f"--workdir={base / 'one'}",
                *FLAGS],
        "gather": [sys.executable, "-m", "launch.multiworker", "--workers", "2", CONFIG,
                   f"--workdir={base / 'gather'}", *FLAGS,
                   "--config.perf.sparse_reduce=gather"],
        "dense": [sys.executable, "-m", "launch.multiworker", "--workers", "2", CONFIG,
                  f"--workdir={base / 'dense'}", *FLAGS, "--config.perf.sparse_reduce=dense"],
    }
    procs = {name: _start(a) for name, a in argv.items()}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} failed:\n{output[-4000:]}"
    return {name: base / name for name in argv}


def _final_weights(workdir) -> list[np.ndarray]:
    """The weights of the workdir's last checkpoint, restored into a fresh Trainer."""
    config = text_config()
    config.update_from_flattened_dict(OVERRIDES)
    t = TextClassifierTrainer(config, workdir=str(workdir))
    assert t.restore() == OVERRIDES["train.steps"]
    return [np.asarray(w) for w in t.model.get_weights()]


@pytest.mark.parametrize("mode", ["gather", "dense"])
def test_two_workers_reach_the_weights_of_one_process(runs, mode):
    one = _final_weights(runs["one"])
    two = _final_weights(runs[mode])
    assert relative_diff(one, two) <= TOL
