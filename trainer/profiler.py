"""Profiler windows: ``telemetry.profile_steps="200:210"`` (or ``"200:210,500:505"``).

:class:`ProfilerWindows` is a :class:`trainer.loop.Component`. Window ``"a:b"`` covers
the steps that take the global step from ``a`` to ``b`` (``b - a`` steps). Through
``next_boundary`` it makes train loops END at ``a`` and at ``b`` (so a window that
crosses a ``steps_per_loop`` boundary just splits that loop in two), starts
``tf.profiler.experimental`` right after the loop that reaches ``a`` and stops it
right after the loop that reaches ``b``. The granularity is therefore exactly the
requested steps; the trace also holds the host work between those loops (logging,
eval or checkpoints falling inside the window).

Traces go to ``workdir/profile/plugins/profile/<timestamp>/<host>.xplane.pb``:
``tensorboard --logdir=WORKDIR`` shows them in the profile plugin (run ``profile``).
Only the chief profiles; windows that ended before a resumed run's first step are
skipped, and one in progress at resume is captured from the resume step on.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import ml_collections
import tensorflow as tf
from absl import logging

from trainer import config as config_lib
from trainer import distribute
from trainer.loop import Component

if TYPE_CHECKING:
    from trainer.trainer import Trainer


class ProfilerWindows(Component):
    """Starts/stops ``tf.profiler`` at exactly the configured step windows."""

    def __init__(self, config: ml_collections.ConfigDict):
        self.windows = config_lib.parse_profile_steps(config.telemetry.profile_steps)
        self._active: tuple[int, int] | None = None
        self._enabled = False
        self.logdir: str | None = None

    def next_boundary(self, step: int) -> float:
        for start, stop in self.windows:
            if step < start:
                return start
            if step < stop:
                return stop
        return math.inf

    def on_fit_start(self, trainer: "Trainer") -> None:
        self._enabled = bool(self.windows and trainer.workdir
                             and distribute.is_chief(trainer.strategy))
        if self.windows and not self._enabled:
            logging.info("telemetry.profile_steps ignored: %s",
                         "no workdir" if not trainer.workdir else "not the chief")
        self.logdir = os.path.join(trainer.workdir, "profile") if trainer.workdir else None
        self._maybe_start(trainer.step)

    def _maybe_start(self, step: int) -> None:
        if not self._enabled or self._active:
            return
        for start, stop in self.windows:
            if start <= step < stop:
                tf.profiler.experimental.start(self.logdir)
                self._active = (start, stop)
                logging.info("profiler: tracing steps %d:%d into %s", step, stop, self.logdir)
                return

    def _stop(self) -> None:
        tf.profiler.experimental.stop()
        logging.info("profiler: trace of steps %d:%d written to %s", *self._active, self.logdir)
        self._active = None

    def on_train_loop_end(self, trainer: "Trainer", num_steps: int, seconds: float) -> None:
        if self._active and trainer.step >= self._active[1]:
            self._stop()
        self._maybe_start(trainer.step)

    def on_fit_end(self, trainer: "Trainer", results: dict[str, float]) -> None:
        if self._active:
            self._stop()
