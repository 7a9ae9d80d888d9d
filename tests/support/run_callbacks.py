"""A config file (``--config=tests/support/run_callbacks.py``) and Trainer for the Callback tests.

``CallbackTrainer`` is the toy Trainer with eval; its ``build_callbacks()`` returns

* :class:`Recorder`: appends every public hook call (name, ``trainer.step``, logs) to
  ``workdir/hooks-<task>.json`` (``<task>`` from TF_CONFIG, ``local-0`` without), so a
  test sees the sequence each worker saw;
* :class:`StopOnTask`: ``STOP_AT="worker:1:10"`` calls ``trainer.request_stop`` on that
  task only, in ``on_loop_end`` once the step reaches 10.
"""

from __future__ import annotations

import json
import os

from tests.support import toy
from tests.support.helpers import task_name
from trainer import Callback


class Recorder(Callback):
    """Records ``(hook, step, logs)`` of every public hook, in call order."""

    def __init__(self, path: str | None = None):
        self.path = path
        self.calls: list[list] = []

    def _record(self, hook: str, trainer, logs=None) -> None:
        self.calls.append([hook, trainer.step, logs])
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.calls, f)

    def on_fit_start(self, trainer):
        self._record("on_fit_start", trainer)

    def on_loop_end(self, trainer):
        self._record("on_loop_end", trainer)

    def on_log(self, trainer, logs):
        self._record("on_log", trainer, logs)

    def on_eval_end(self, trainer, logs):
        self._record("on_eval_end", trainer, logs)

    def on_checkpoint(self, trainer, step):
        self._record("on_checkpoint", trainer, {"step": step})

    def on_fit_end(self, trainer, logs):
        self._record("on_fit_end", trainer, logs)


class StopOnTask(Callback):
    """Requests a stop on one task at a step (``STOP_AT="task:index:step"``)."""

    def __init__(self, spec: str):
        task, _, step = spec.rpartition(":")
        self.task, self.step = task.replace(":", "-"), int(step)

    def on_loop_end(self, trainer):
        if task_name() == self.task and trainer.step >= self.step:
            trainer.request_stop(f"test stop on {self.task} at step {trainer.step}")


class CallbackTrainer(toy.ToyEvalTrainer):
    def build_callbacks(self):
        callbacks = []
        if self.workdir:
            callbacks.append(Recorder(os.path.join(self.workdir, f"hooks-{task_name()}.json")))
        if os.environ.get("STOP_AT"):
            callbacks.append(StopOnTask(os.environ["STOP_AT"]))
        return callbacks


def get_config():
    config = toy.toy_config(**{"train.steps": 20, "train.steps_per_loop": 5,
                               "train.log_every_steps": 10, "eval.every_steps": 10,
                               "checkpoint.every_steps": 10})
    config.trainer = "tests.support.run_callbacks:CallbackTrainer"
    config.distribute.strategy = "auto"
    return config
