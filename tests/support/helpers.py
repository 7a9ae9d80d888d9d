"""Helpers shared by the test modules: subprocesses, comparing weights and saved runs,
free ports, live input iterators."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def subprocess_env() -> dict:
    """This environment with the repository on PYTHONPATH (for ``python -m tests...``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def run_in_parallel(commands: Mapping[object, Sequence[str]], timeout: float = 600) -> None:
    """Starts every ``argv`` at once and waits for all; fails naming a command that did
    not exit 0, with the end of its output (one process per device layout)."""
    procs = {key: subprocess.Popen(list(argv), cwd=REPO, env=subprocess_env(),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for key, argv in commands.items()}
    for key, proc in procs.items():
        output, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"run {key!r} failed:\n{output[-4000:]}"


def run_at_once(commands: Mapping[str, Sequence[str]],
                timeout: float = 600) -> dict[str, subprocess.CompletedProcess]:
    """Starts every ``argv`` at once (from the repository, stdout and stderr as one text)
    and returns each's completed process, whatever its exit status."""
    procs = {key: subprocess.Popen(list(argv), cwd=REPO, env=subprocess_env(),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for key, argv in commands.items()}
    return {key: subprocess.CompletedProcess(proc.args, proc.wait(timeout=timeout),
                                             proc.stdout.read())
            for key, proc in procs.items()}


def task_name() -> str:
    """``type-index`` of this process's TF_CONFIG task, ``local-0`` without TF_CONFIG."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return "local-0"
    task = json.loads(raw)["task"]
    return f"{task['type']}-{task['index']}"


def max_abs_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """The largest absolute elementwise difference between two lists of arrays."""
    assert len(a) == len(b), f"{len(a)} arrays against {len(b)}"
    assert len(a), "nothing to compare"
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def relative_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """The largest difference of two weight lists, relative to each array's scale
    (its largest magnitude)."""
    assert len(a) == len(b) and len(a), (len(a), len(b))
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))
                     / max(float(np.max(np.abs(np.asarray(x)))), 1e-12))
               for x, y in zip(a, b))


def saved_run(arrays: Mapping[str, np.ndarray], run: str) -> list[np.ndarray]:
    """The arrays saved as ``"<run>/<i>"`` (i = 0, 1, ...) in an ``.npz``-like mapping."""
    count = sum(1 for k in arrays if k.startswith(run + "/"))
    assert count, f"no weights saved for {run}"
    return [arrays[f"{run}/{i}"] for i in range(count)]


def load_weights(path) -> list[np.ndarray]:
    """The ``w0, w1, ...`` arrays of an ``.npz`` written by the launcher tests' trainer."""
    with np.load(path) as f:
        return [f[f"w{i}"] for i in range(len(f.files))]


def assert_same_weights(reference: Sequence[np.ndarray], path, tol: float = 1e-5) -> None:
    """The weights saved at ``path`` equal ``reference`` within ``tol`` (absolute)."""
    weights = load_weights(path)
    assert len(weights) == len(reference)
    for got, want in zip(weights, reference):
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=str(path))


# A subprocess prelude that makes `import tensorflow` (and keras) fail loudly, then runs
# the module named by argv[1] as __main__ with the remaining arguments: proves that a
# command line reports an error before TensorFlow is imported.
NO_TENSORFLOW_PRELUDE = """
import runpy, sys
class _NoTensorFlow:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('tensorflow', 'keras'):
            raise ImportError('TENSORFLOW IMPORTED: ' + name)
        return None
sys.meta_path.insert(0, _NoTensorFlow())
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name='__main__', alter_sys=True)
"""


def last_lines(text: str, n: int = 3) -> str:
    """The last ``n`` non-empty lines of ``text`` (where a user error must be told)."""
    return "\n".join([line for line in text.splitlines() if line.strip()][-n:])


def free_loopback_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (for a hand-written TF_CONFIG)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def live_iterators() -> int:
    """tf.data and distributed iterators alive now, unreachable cycles included."""
    import tensorflow as tf  # this module stays light for the tests that never train

    iterators = (tf.data.Iterator, tf.distribute.DistributedIterator)
    return sum(1 for o in gc.get_objects() if isinstance(o, iterators))
