"""A long-lived worker that trains drawn model specs on N replicas, one after another.

    python -m tests.properties.run_spec_worker --replicas N --out DIR

One process hosts one Mirrored group size, so the replica-count property
(test_model_properties.py) starts one worker per replica count for the whole module and
sends every drawn spec to each: an example then costs two short trainings, not two
process starts. Protocol (stdout carries nothing else; everything the process prints
goes to stderr):

* the worker prints ``{"ready": true}`` once TensorFlow is imported;
* then for every line ``{"id": K, "spec": {...}}`` on stdin (:mod:`model_specs`) it
  trains the spec and answers ``{"id": K, "npz": PATH, "seconds": S}``, the ``.npz``
  holding ``names`` (the weights' paths), ``initial/<i>`` and ``final/<i>`` (and
  ``resumed/<i>`` for a spec that draws random numbers, ``pinned/<i>`` for plan
  ``"auto"``, whose answer's ``"plan"`` holds the run's plan event fields, else null:
  ``model_specs.train_spec``), or
  ``{"id": K, "error": "Type: message", "traceback": "..."}`` when building or training
  failed;
* it exits at the end of stdin.

The other side (the tests' process): :class:`SpecWorker`, :func:`start_workers` and
:func:`train_on_every_replica_count`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--out", required=True, help="directory for the .npz answers")
    args = parser.parse_args()

    # The protocol keeps the real stdout; anything else written to fd 1 (TensorFlow's
    # C++ logs, a print) goes to stderr instead.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import numpy as np

    from tests.properties import model_specs

    model_specs.SpecTrainer  # noqa: B018 (imports TensorFlow and Keras before "ready")
    # TensorFlow's and Keras's objects live until the exit: frozen, they stay out of the
    # collection after every spec (tests/properties/scenario.py).
    gc.collect()
    gc.freeze()
    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        key, start = request["id"], time.perf_counter()
        try:
            run = model_specs.train_spec(request["spec"], args.replicas)
        except Exception as error:  # noqa: BLE001 (answered; the property reports it)
            answer = {"id": key, "error": f"{type(error).__name__}: {error}",
                      "traceback": traceback.format_exc()[-4000:]}
        else:
            path = os.path.join(args.out, f"{key}-{args.replicas}.npz")
            np.savez(path, names=np.array(run["names"]), **{
                f"{which}/{i}": w for which in ("initial", "final", "resumed", "pinned")
                for i, w in enumerate(run[which] or [])})
            answer = {"id": key, "npz": path, "warnings": run["warnings"],
                      "plan": run["plan"], "seconds": round(time.perf_counter() - start, 3)}
        finally:
            gc.collect()  # the trainer's iterators freed now, young (tests/conftest.py)
        answers.write(json.dumps(answer) + "\n")


# ------------------------------------------------------------------------ the client


ANSWER_TIMEOUT_S = 300  # one spec on one worker (the first one traces everything)


class SpecWorker:
    """One worker process: :meth:`send` a spec, :meth:`receive` its answer."""

    def __init__(self, replicas: int, out_dir: str):
        from tests.support.helpers import REPO, subprocess_env

        self.replicas = replicas
        # stderr to a file, not a pipe: nobody reads it unless the worker fails.
        self._log = tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.properties.run_spec_worker",
             "--replicas", str(replicas), "--out", out_dir],
            cwd=REPO, env=subprocess_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._proc.stdout, selectors.EVENT_READ)
        self._ready = False

    def send(self, key: int, spec: dict) -> None:
        self._proc.stdin.write(json.dumps({"id": key, "spec": spec}) + "\n")
        self._proc.stdin.flush()

    def receive(self, key: int, timeout: float = ANSWER_TIMEOUT_S) -> dict:
        if not self._ready:
            assert self._line(timeout) == {"ready": True}
            self._ready = True
        answer = self._line(timeout)
        assert answer.get("id") == key, answer
        return answer

    def _line(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self._selector.select(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                log = self.log()
                self.stop()
                raise AssertionError(f"{self.replicas}-replica worker: no answer in "
                                     f"{timeout} s\n{log}")
        line = self._proc.stdout.readline()
        if not line:
            raise AssertionError(f"{self.replicas}-replica worker exited "
                                 f"({self._proc.wait()}):\n{self.log()}")
        return json.loads(line)

    def log(self, chars: int = 6000) -> str:
        """The end of what the worker printed (stderr)."""
        self._log.seek(0)
        return self._log.read()[-chars:]

    def stop(self) -> None:
        """Ends the worker (closes its stdin; kills it after 30 s)."""
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._selector.close()
        self._log.close()


def start_workers(out_dir: str, replica_counts=(1, 2)) -> dict[int, SpecWorker]:
    """A worker per replica count, all started now: ``{replicas: worker}``."""
    return {n: SpecWorker(n, out_dir) for n in replica_counts}


_keys = iter(range(10**9))


def answers_of_every_replica_count(workers: dict[int, SpecWorker], spec: dict) -> dict:
    """``{replicas: answer}`` (the protocol's): ``spec`` sent to every worker at once."""
    key = next(_keys)
    for worker in workers.values():
        worker.send(key, spec)
    return {n: worker.receive(key) for n, worker in workers.items()}


def train_on_every_replica_count(workers: dict[int, SpecWorker], spec: dict) -> dict:
    """``{replicas: {"names", "initial/<i>", "final/<i>", ..., "warnings", "plan"}}`` (the
    answers' ``.npz`` and fields): ``spec`` trained
    by every worker at once; fails with the workers' errors when it did not train."""
    import numpy as np

    answers = answers_of_every_replica_count(workers, spec)
    errors = {n: a["error"] + "\n" + a["traceback"] for n, a in answers.items()
              if "error" in a}
    assert not errors, f"the spec failed to train: {errors}"
    runs = {}
    for n, answer in answers.items():
        with np.load(answer["npz"]) as f:
            runs[n] = {k: f[k] for k in f.files}
        runs[n]["warnings"], runs[n]["plan"] = answer["warnings"], answer["plan"]
        os.remove(answer["npz"])
    return runs


def weights(run: dict, which: str) -> list:
    """The ``"initial"``, ``"final"``, ``"resumed"`` or ``"pinned"`` weights of one run,
    in ``run["names"]`` order."""
    return [run[f"{which}/{i}"] for i in range(len(run["names"]))]


def differences(runs: dict, replicas: int, reference: int = 1) -> dict[str, float]:
    """Per weight name: the relative difference (test_model_families.relative_diff) of
    the final weights on ``replicas`` replicas from those on ``reference``."""
    from tests.support.helpers import relative_diff

    one, other = runs[reference], runs[replicas]
    assert list(one["names"]) == list(other["names"])
    return {str(name): relative_diff([a], [b]) for name, a, b in
            zip(one["names"], weights(one, "final"), weights(other, "final"))}


if __name__ == "__main__":
    from trainer.runtime.fast_exit import exit_now

    main()
    exit_now(0)  # no teardown of distributed iterators (up to 60 s each)
