"""The same command twice gives the same weights, bit for bit, on CPU, whatever the
machine's load: the input order (``train.deterministic``), TensorFlow's thread pools
and the cadence do not depend on timing. What does, and so is pinned here, is the
execution plan's measurement (``perf.plan="auto"`` times XLA settings on the run and
keeps the fastest, and XLA sums floats in another order): docs/training.md says so and
how to pin it. The first run shares the machine's cores with busy processes."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import numpy as np

from tests.support.helpers import REPO, load_weights, subprocess_env

CONFIG = f"--config={REPO / 'tests' / 'launch_helpers' / 'weights_config.py'}"
FLAGS = ("--config.train.steps=60", "--config.perf.plan=fixed")


def busy() -> None:
    while True:
        pass


def train(workdir) -> list[np.ndarray]:
    proc = subprocess.run([sys.executable, "-m", "trainer.main", CONFIG,
                           f"--workdir={workdir}", *FLAGS], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return load_weights(workdir / "weights-local-0.npz")


def test_the_same_command_gives_the_same_bits_on_a_loaded_and_an_idle_machine(tmp_path):
    hogs = [multiprocessing.Process(target=busy, daemon=True) for _ in range(2)]
    for hog in hogs:
        hog.start()
    try:
        loaded = train(tmp_path / "loaded")
    finally:
        for hog in hogs:
            hog.kill()
    idle = train(tmp_path / "idle")
    assert len(loaded) == len(idle)
    for a, b in zip(loaded, idle):
        np.testing.assert_array_equal(a, b)
