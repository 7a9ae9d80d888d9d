"""Checkpoint test helper: a config file, a Trainer with fault injection, an entry point.

As a config file (``--config=tests/support/run_checkpoint.py``): ``CkptTrainer`` on the toy
data, Adam, 40 steps in loops of 5, a checkpoint every 10 steps.

As an entry point, ``python -m tests.support.run_checkpoint FLAGS`` is ``python -m trainer.main
FLAGS``, plus ``CKPT_TEST_CRASH_SAVE=N``: the process dies (exit 86) while committing
checkpoint step N (all files written into orbax's temporary directory, not renamed).

``CkptTrainer`` (environment variables):

* ``CKPT_TEST_OUT=DIR``: after ``fit()`` (also when it raises) writes
  ``DIR/<task>.npz`` (``local-0`` without TF_CONFIG, else e.g. ``worker-1``): the model
  weights ``model/i``, every optimizer variable ``opt/i``, the loss-scale state and
  ``step``, read straight from the objects (not through trainer.checkpoint);
* ``CKPT_TEST_ACTION=[TASK:]kill:N`` or ``[TASK:]term:N``: during step N+1 (in the
  graph, so mid-loop) the process SIGKILLs or SIGTERMs itself, once: a marker file in
  DIR stops it from happening again after a restart. ``TASK`` (``worker:1``) limits it
  to that task.
"""

from __future__ import annotations

import os
import signal
import threading

import ml_collections
import numpy as np
import tensorflow as tf

from tests.support import toy
from tests.support.helpers import task_name

CRASH_EXIT = 86


def get_config() -> ml_collections.ConfigDict:
    config = toy.toy_config(**{
        "optimizer.name": "adam", "optimizer.learning_rate": 0.01, "train.steps": 40,
        "train.steps_per_loop": 5, "train.log_every_steps": 10,
        "checkpoint.every_steps": 10})
    config.trainer = "tests.support.run_checkpoint:CkptTrainer"
    config.model.hidden = 16
    return config


class CkptTrainer(toy.ToyTrainer):
    """ToyTrainer with a configurable hidden size, fault injection and a state dump."""

    def build_model(self):
        import keras

        return keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(self.config.model.hidden, activation="tanh"),
            keras.layers.Dense(3),
        ])

    def train_step(self, batch):
        outputs = super().train_step(batch)
        action = os.environ.get("CKPT_TEST_ACTION", "")
        if action:
            tf.py_function(self._make_action(action), [self.step_counter], [])
        return outputs

    def _make_action(self, spec: str):
        parts = spec.split(":")
        target = f"{parts[0]}-{parts[1]}" if len(parts) == 4 else task_name()
        kind, at = parts[-2], int(parts[-1])
        marker = os.path.join(os.environ["CKPT_TEST_OUT"], f"acted-{kind}-{task_name()}")
        lock = threading.Lock()

        def act(step):
            with lock:
                if target != task_name() or int(step) != at or os.path.exists(marker):
                    return
                open(marker, "w").close()
            print(f"injected {kind} of {task_name()} at step {at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGTERM)

        return act

    def fit(self):
        try:
            return super().fit()
        finally:
            out = os.environ.get("CKPT_TEST_OUT")
            if out:
                dump = {f"model/{i}": w for i, w in enumerate(self.model.get_weights())}
                dump.update({f"opt/{i}": np.asarray(v.numpy())
                             for i, v in enumerate(self.optimizer.variables)})
                p = self.precision
                for v in (p.scale, p.good_steps, p.skipped_steps, p.last_skipped_step,
                          self.step_counter):
                    dump[f"trainer/{v.name.split(':')[0]}"] = v.numpy()
                dump["step"] = np.asarray(self.step)
                np.savez(os.path.join(out, f"{task_name()}.npz"), **dump)


def _inject_crash_on_commit(step: int) -> None:
    """Makes orbax's commit (the rename of the temporary step directory) of ``step`` die."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def crashing_finalize(self):
        if self.get_final().name == str(step):
            print(f"injected crash while committing checkpoint {step}", flush=True)
            os._exit(CRASH_EXIT)
        return await finalize(self)

    atomicity.AtomicRenameTemporaryPath.finalize = crashing_finalize


if __name__ == "__main__":
    if os.environ.get("CKPT_TEST_CRASH_SAVE"):
        _inject_crash_on_commit(int(os.environ["CKPT_TEST_CRASH_SAVE"]))
    from trainer import main

    main.run()
