"""Profiler windows: ``telemetry.profile_steps="200:210"`` (or ``"200:210,500:505"``).

:class:`ProfilerWindows` is a service (:class:`trainer.run_context.Service`). Window
``"a:b"`` covers the steps that take the global step from ``a`` to ``b`` (``b - a`` steps). Through
``next_boundary`` it makes train loops END at ``a`` and at ``b`` (so a window that
crosses a ``steps_per_loop`` boundary just splits that loop in two), starts
``tf.profiler.experimental`` right after the loop that reaches ``a`` and stops it
right after the loop that reaches ``b``. The granularity is therefore exactly the
requested steps; the trace also holds the host work between those loops (logging,
eval or checkpoints falling inside the window).

Traces go to ``workdir/profile/plugins/profile/steps_<a>_<b>/<host>.xplane.pb`` (the
profiler names the session directory by the wall-clock second; it is renamed after the
window so two windows never collide and each names its steps):
``tensorboard --logdir=WORKDIR`` shows them in the profile plugin (run ``profile``;
install ``tensorboard`` and ``tensorboard-plugin-profile`` to view).
Only the chief profiles; windows that ended before a resumed run's first step are
skipped, and one in progress at resume is captured from the resume step on.
"""

from __future__ import annotations

import math
import os

import ml_collections
import tensorflow as tf
from absl import logging

from trainer import config as config_lib
from trainer.run_context import RunContext, Service


class ProfilerWindows(Service):
    """Starts/stops ``tf.profiler`` at exactly the configured step windows."""

    def __init__(self, config: ml_collections.ConfigDict):
        self.windows = config_lib.parse_profile_steps(config.telemetry.profile_steps)
        self._active: tuple[int, int] | None = None  # (first step, stop) being traced
        self._before: set[str] = set()  # session directories that existed at start
        self._enabled = False
        self.logdir: str | None = None

    def next_boundary(self, step: int) -> float:
        for start, stop in self.windows:
            if step < start:
                return start
            if step < stop:
                return stop
        return math.inf

    def on_fit_start(self, run: RunContext) -> None:
        self._enabled = bool(self.windows and run.workdir and run.is_chief)
        if self.windows and not self._enabled:
            logging.info("telemetry.profile_steps ignored: %s",
                         "no workdir" if not run.workdir else "not the chief")
        self.logdir = os.path.join(run.workdir, "profile") if run.workdir else None
        self._maybe_start(run.step)

    def _sessions(self) -> set[str]:
        root = os.path.join(self.logdir, "plugins", "profile")
        if not tf.io.gfile.isdir(root):
            return set()
        return {name.rstrip("/") for name in tf.io.gfile.listdir(root)}  # gs://: "dir/"

    def _maybe_start(self, step: int) -> None:
        if not self._enabled or self._active:
            return
        for start, stop in self.windows:
            if start <= step < stop:
                self._before = self._sessions()
                tf.profiler.experimental.start(self.logdir)
                self._active = (step, stop)
                logging.info("profiler: tracing steps %d:%d", step, stop)
                return

    def _stop(self) -> None:
        tf.profiler.experimental.stop()
        root = os.path.join(self.logdir, "plugins", "profile")
        name = "steps_{}_{}".format(*self._active)
        for session in sorted(self._sessions() - self._before):
            target, n = os.path.join(root, name), 1
            while tf.io.gfile.exists(target):
                n += 1
                target = os.path.join(root, f"{name}_{n}")
            tf.io.gfile.rename(os.path.join(root, session), target)
            logging.info("profiler: trace of steps %d:%d written to %s", *self._active, target)
        self._active = None

    def on_loop_end(self, run: RunContext) -> None:
        if self._active and run.step >= self._active[1]:
            self._stop()
        self._maybe_start(run.step)

    def on_fit_end(self, run: RunContext, results: dict[str, float]) -> None:
        if self._active:
            self._stop()
