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
from tests.support.helpers import REPO, load_weights, run_in_parallel, subprocess_env  # noqa: F401 (re-exported)
from tests.properties import profiles as hypothesis_profiles
from tests.support.worker_groups import ungrouped_problem, worker_groups

# Before pytest reads --hypothesis-profile: the profiles must exist by then.
hypothesis_profiles.register()

# TFDS data (the digits dataset the tests prepare) lives in a per-session directory, never
# in the user's ~/tensorflow_datasets; subprocesses inherit it through the environment.
# Set before anything imports tensorflow_datasets (which reads it at import).
TFDS_DATA_DIR = tempfile.mkdtemp(prefix="tfds-tests-")
os.environ["TFDS_DATA_DIR"] = TFDS_DATA_DIR
atexit.register(shutil.rmtree, TFDS_DATA_DIR, ignore_errors=True)

# The plan cache (trainer/loop/plan_cache.py) lives under XDG_CACHE_HOME: never the
# user's ~/.cache, and each test gets its own (own_plan_cache) so a plan one test measured
# is not adopted by the next run of the same key; module and session fixtures share this.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="xdg-cache-tests-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)


class MainProcess:
    """``python -m trainer.main`` started at construction; :meth:`result` waits for it.

    A module fixture that starts one lets it run alongside the module's in-process
    tests (they keep about one of 2 cores busy) instead of after them."""

    def __init__(self, workdir: Path, *flags: str, config: str = "models/configs/digits.py",
                 timeout: float = 300):
        self.workdir, self.timeout = workdir, timeout
        cmd = [sys.executable, "-m", "trainer.main", f"--config={REPO / config}",
               f"--workdir={workdir}", *flags]
        # Files, not pipes: nobody reads a pipe before result(), and a full one would
        # stop the process.
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), text=True,
                                      stdout=self._out, stderr=self._err)
        self._done: subprocess.CompletedProcess | None = None

    def result(self) -> subprocess.CompletedProcess:
        """The completed process (text); kills it and raises after ``timeout`` s of
        waiting, as ``subprocess.run`` does."""
        if self._done is None:
            try:
                self._proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                raise
            out, err = (_read_and_close(f) for f in (self._out, self._err))
            self._done = subprocess.CompletedProcess(self._proc.args, self._proc.returncode,
                                                     out, err)
        return self._done

    def stop(self) -> None:
        """Kills the process if it still runs (a fixture's teardown)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def _read_and_close(file) -> str:
    file.seek(0)
    with file:
        return file.read()


def run_main(workdir: Path, *flags: str, config: str = "models/configs/digits.py",
             timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs ``python -m trainer.main`` and returns the completed process (text)."""
    return MainProcess(workdir, *flags, config=config, timeout=timeout).result()


def collected(request: pytest.FixtureRequest, test_name: str) -> bool:
    """Whether this session runs a test of that name (a fixture that starts a process
    early for one test starts none when ``-k`` deselected it)."""
    return any(item.originalname == test_name for item in request.session.items)


def early_main(name: str, test_name: str, *flags: str,
               config: str = "models/configs/digits.py"):
    """A module-scoped autouse fixture called ``name``: a :class:`MainProcess` with
    ``flags`` started with the module, so it runs alongside the module's in-process
    tests, when the session runs ``test_name`` (which requests it and calls ``result()``);
    None otherwise. Assign it to a module attribute of the same name."""

    @pytest.fixture(scope="module", autouse=True, name=name)
    def started(request, tmp_path_factory):
        if not collected(request, test_name):
            yield None
            return
        run = MainProcess(tmp_path_factory.mktemp(name), *flags, config=config)
        yield run
        run.stop()

    return started


def final_results(proc: subprocess.CompletedProcess) -> dict:
    """The ``final: {...}`` JSON that trainer.main logs at the end of fit()."""
    for line in reversed(proc.stderr.splitlines()):
        if "final: " in line:
            return json.loads(line.split("final: ", 1)[1])
    raise AssertionError(f"no final results in output:\n{proc.stderr[-3000:]}")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test with its ``xdist_group`` (tests/support/worker_groups.py) for the
    suite's ``pytest -n 2 --dist loadgroup``; without xdist the marks change nothing."""
    groups = worker_groups((item.nodeid, item.fixturenames) for item in items)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """In the xdist controller: stops the session in one line when a worker's ids carry
    no group (tests/support/worker_groups.py)."""
    problem = ungrouped_problem(node.config.getoption("dist") == "loadgroup", ids)
    if problem:
        pytest.exit(problem, returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every test module is imported (TensorFlow, Keras, ...), and those objects live for
    the whole session: frozen, they stay out of every later garbage collection. A
    collection then walks only what the tests made, so the one after each test (below)
    costs milliseconds instead of ~0.3 s of CPU over the ~500,000 objects of
    TensorFlow and Keras (minutes over a thousand tests)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def own_plan_cache(tmp_path_factory, monkeypatch):
    """This test's XDG_CACHE_HOME (its in-process runs and its subprocesses'): an empty
    plan cache, as on a fresh machine."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


@pytest.fixture(autouse=True)
def collect_garbage_after_each_test():
    """Frees each test's TensorFlow objects right after it. A Trainer sits in reference
    cycles (its driver, run context and services point back at it). ``fit()`` frees its
    own train iterators when it ends (tests/test_many_trainers.py), but an iterator a
    test or the doctor makes itself would otherwise die at some later garbage
    collection, many at once; each then waits for its tf.data autotune thread, whose
    period grows to 60 s while the iterator lives (trainer/runtime/fast_exit.py): a suite-wide
    stall of minutes inside whichever test triggers that collection. Collected young,
    an iterator is freed in milliseconds.

    What survives the collection (modules a test imported: orbax, JAX, MLflow...; module
    fixtures) is frozen as at collection time: unfrozen, those objects made every later
    collection walk them again, 0.3-0.6 s after each of a thousand tests."""
    yield
    if "tensorflow" in sys.modules:
        gc.collect()
        gc.freeze()


@pytest.fixture(scope="session")
def replica_runs(tmp_path_factory) -> dict:
    """ToyTrainer runs on 1, 2 and 4 replicas (one process each): {n: npz}."""
    out_dir = tmp_path_factory.mktemp("replicas")
    run_in_parallel({n: [sys.executable, "-m", "tests.support.run_toy", "--replicas", str(n),
                         "--out", str(out_dir / f"{n}.npz")] for n in (1, 2, 4)})
    return {n: dict(np.load(out_dir / f"{n}.npz")) for n in (1, 2, 4)}


@pytest.fixture(scope="session")
def launcher_reference_weights(tmp_path_factory) -> list[np.ndarray]:
    """Final weights of the launcher tests' digits config
    (``tests/launch_helpers/weights_config.py``: 30 steps, global batch 64, batch sharding)
    trained by one process without TF_CONFIG. With batch sharding the global batches do
    not depend on the worker count, so every launcher test (local groups, per-host,
    Slurm, simulated hosts) compares its workers' weights to this one run."""
    workdir = tmp_path_factory.mktemp("launcher-reference")
    env = {k: v for k, v in subprocess_env().items() if k != "TF_CONFIG"}
    result = subprocess.run(
        [sys.executable, "-m", "trainer.main",
         f"--config={REPO / 'tests' / 'launch_helpers' / 'weights_config.py'}",
         f"--workdir={workdir}"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return load_weights(workdir / "weights-local-0.npz")
