"""Shared fixtures. Multi-replica runs happen in subprocesses: logical devices must be
configured before TensorFlow starts, and one process hosts one Mirrored group size."""

from __future__ import annotations

import atexit
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from tests.helpers import REPO, run_in_parallel, subprocess_env  # noqa: F401 (re-exported)
from tests.properties import profiles as hypothesis_profiles

# Before pytest reads --hypothesis-profile: the profiles must exist by then.
hypothesis_profiles.register()

# TFDS data (the digits dataset the tests prepare) lives in a per-session directory, never
# in the user's ~/tensorflow_datasets; subprocesses inherit it through the environment.
# Set before anything imports tensorflow_datasets (which reads it at import).
TFDS_DATA_DIR = tempfile.mkdtemp(prefix="tfds-tests-")
os.environ["TFDS_DATA_DIR"] = TFDS_DATA_DIR
atexit.register(shutil.rmtree, TFDS_DATA_DIR, ignore_errors=True)


def run_main(workdir: Path, *flags: str, config: str = "models/configs/digits.py",
             timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs ``python -m trainer.main`` and returns the completed process (text)."""
    cmd = [sys.executable, "-m", "trainer.main", f"--config={REPO / config}",
           f"--workdir={workdir}", *flags]
    return subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)


def final_results(proc: subprocess.CompletedProcess) -> dict:
    """The ``final: {...}`` JSON that trainer.main logs at the end of fit()."""
    for line in reversed(proc.stderr.splitlines()):
        if "final: " in line:
            return json.loads(line.split("final: ", 1)[1])
    raise AssertionError(f"no final results in output:\n{proc.stderr[-3000:]}")


@pytest.fixture(autouse=True)
def collect_garbage_after_each_test():
    """Frees each test's TensorFlow objects right after it. A Trainer sits in reference
    cycles (its driver, run context and services point back at it), so without this its
    distributed iterators die at some later garbage collection, many at once; each then
    waits for its tf.data autotune thread, whose period grows to 60 s while the iterator
    lives (trainer/fast_exit.py): a suite-wide stall of minutes inside whichever test
    triggers that collection. Collected young, an iterator is freed in milliseconds."""
    yield
    if "tensorflow" in sys.modules:
        gc.collect()


@pytest.fixture(scope="session")
def replica_runs(tmp_path_factory) -> dict:
    """ToyTrainer runs on 1, 2 and 4 replicas (one process each): {n: npz}."""
    out_dir = tmp_path_factory.mktemp("replicas")
    run_in_parallel({n: [sys.executable, "-m", "tests.run_toy", "--replicas", str(n),
                         "--out", str(out_dir / f"{n}.npz")] for n in (1, 2, 4)})
    return {n: dict(np.load(out_dir / f"{n}.npz")) for n in (1, 2, 4)}
