"""Signal test helper: a config file and a Trainer that makes one phase long on purpose.

As a config file (``--config=tests/support/run_signals.py``): ``SignalTrainer`` on the toy data,
40 steps in loops of 5, a checkpoint every 10 steps, a small finite eval split.

``SIGNAL_TEST_PHASE`` (environment) selects the phase made long; its start prints the
line ``PHASE <name>`` on stdout (the test signals the process when it sees it):

* ``build_model``: ``build_model`` sleeps (Trainer construction: start-up, also under
  ``--mode=eval`` and the doctor);
* ``input``: ``build_train_dataset`` sleeps (building the input, before training);
* ``first_trace``: tracing ``train_step`` takes 3 s (the first loop call);
* ``train``: every train batch takes 20 ms to read (a long training phase; the marker
  comes at the end of the first loop);
* ``eval``: every eval batch takes 200 ms to read and there are thousands;
* ``checkpoint``: the first ``on_checkpoint`` (step 10) sleeps 4 s.
"""

from __future__ import annotations

import os
import time

import tensorflow as tf

import trainer
from tests.support import toy

PHASE = os.environ.get("SIGNAL_TEST_PHASE", "")
LONG_S = 120.0  # a phase "that never ends" in test time: the signal must end it


def get_config():
    config = toy.toy_config(**{
        "train.steps": 40, "train.steps_per_loop": 5, "train.log_every_steps": 10,
        "checkpoint.every_steps": 10})
    config.trainer = "tests.support.run_signals:SignalTrainer"
    return config


def marker(phase: str) -> None:
    print(f"PHASE {phase}", flush=True)


def _slow(seconds: float, phase: str):
    """A numpy function that passes its input through after ``seconds``; the first
    call prints the phase marker."""
    first = [True]

    def through(x):
        if first[0]:
            first[0] = False
            marker(phase)
        time.sleep(seconds)
        return x

    return through


def _slowed(ds: tf.data.Dataset, seconds: float, phase: str) -> tf.data.Dataset:
    slow = _slow(seconds, phase)

    def read(x, y):
        return tf.ensure_shape(tf.numpy_function(slow, [x], tf.float32), x.shape), y

    return ds.map(read)


class MarkCheckpoint(trainer.Callback):
    """``checkpoint`` phase: the first ``on_checkpoint`` prints the marker and sleeps."""

    def __init__(self):
        self.done = False

    def on_checkpoint(self, trainer_, step):
        if not self.done:
            self.done = True
            marker("checkpoint")
            time.sleep(4.0)


class MarkTraining(trainer.Callback):
    """``train`` phase: the marker once the first loop ran."""

    def on_loop_end(self, trainer_):
        if trainer_.step == trainer_.config.train.steps_per_loop:
            marker("train")


class SignalTrainer(toy.ToyEvalTrainer):
    def build_model(self):
        if PHASE == "build_model":
            marker("build_model")
            time.sleep(LONG_S)
        return super().build_model()

    def build_train_dataset(self, ctx):
        if PHASE == "input":
            marker("input")
            time.sleep(LONG_S)
        ds = super().build_train_dataset(ctx)
        return _slowed(ds, 0.02, "reading") if PHASE == "train" else ds

    def build_eval_dataset(self, ctx):
        ds = super().build_eval_dataset(ctx)
        return _slowed(ds.repeat(1000), 0.2, "eval") if PHASE == "eval" else ds

    traced = False

    def train_step(self, batch):
        if PHASE == "first_trace" and not self.traced:  # Python code: runs at trace time
            self.traced = True
            marker("first_trace")
            time.sleep(3.0)
        return super().train_step(batch)

    def build_callbacks(self):
        return {"checkpoint": [MarkCheckpoint()], "train": [MarkTraining()]}.get(PHASE, [])


class InfiniteEvalTrainer(toy.ToyEvalTrainer):
    """An eval dataset that never ends (a ``.repeat()`` left in by mistake)."""

    def build_eval_dataset(self, ctx):
        return super().build_eval_dataset(ctx).repeat()


class UnknownLengthEvalTrainer(toy.ToyEvalTrainer):
    """An eval dataset whose length TensorFlow cannot know (a filter): allowed."""

    def build_eval_dataset(self, ctx):
        return super().build_eval_dataset(ctx).filter(lambda x, y: tf.reduce_all(y >= 0))
