"""Driving the checkpoint service (:class:`trainer.checkpoint.service.Checkpointer`) by
hand, as the loop driver does, with a store whose writes the test controls.

* :class:`HeldStore`: a real orbax store on a local disk whose async writes can be held
  in flight (``slow``) until waited for, and whose next write can fail (``fail_next``);
  the errors it injected are kept (``injected``), so a test accepts only those.
* :class:`ServiceRun`: a Trainer's run context as the service sees it, with the
  checkpoints announced to callbacks recorded.
* :func:`set_step` / :func:`weights_of`: the weights of step ``s`` hold the value ``s``,
  so what a checkpoint holds names its step.
"""

from __future__ import annotations

import errno
import os

import numpy as np

from trainer.checkpoint.storage.writer import CheckpointWriter


class HeldStore(CheckpointWriter):
    """A store whose async writes can be held in flight (``slow``: a write completes
    only when it is waited for or when the next write of its kind starts, as orbax
    finishes one write before the next; it then writes the arrays it was handed, as
    they are by then) and whose next write fails with a full disk (``fail_next``; each
    error raised is appended to ``injected``). ``written``: the steps whose writes were
    started, in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.slow, self.fail_next = False, False
        self.injected: list[OSError] = []
        self.written: list[int] = []
        self._held: dict[str, tuple] = {}

    def save(self, kind, step, state, manifest, metrics=None, wait=False, timeout=None):
        self._write_held(kind)
        if self.fail_next:
            self.fail_next = False
            self.injected.append(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.workdir))
            raise self.injected[-1]
        if self.slow and not wait:
            self._held[kind] = (step, state, manifest, metrics)
            return
        self.written.append(step)
        super().save(kind, step, state, manifest, metrics, wait, timeout)

    def caused(self, error: BaseException) -> bool:
        """Whether ``error`` was raised from (``__cause__``) a fault this store injected."""
        return any(error.__cause__ is fault for fault in self.injected)

    def _held_step(self, kind):
        return self._held[kind][0] if kind in self._held else None

    def in_flight(self, kind):
        return self._held_step(kind) or super().in_flight(kind)

    def pending(self, kind):
        return self._held_step(kind) or super().pending(kind)

    def kinds(self):
        return sorted({*super().kinds(), *self._held})

    def _write_held(self, kind) -> None:
        if kind in self._held:
            step, state, manifest, metrics = self._held.pop(kind)
            self.written.append(step)
            super().save(kind, step, state, manifest, metrics, wait=True)

    def wait(self, kind=None, timeout=None):
        for name in [k for k in list(self._held) if kind in (None, k)]:
            self._write_held(name)
        super().wait(kind, timeout)

    def discard(self, kind):
        self._held.pop(kind, None)
        super().discard(kind)


class ServiceRun:
    """The trainer's run context in ``workdir``, with the checkpoints announced
    recorded."""

    def __init__(self, trainer, workdir: str):
        self._context, self._trainer, self.workdir = trainer.context, trainer, workdir
        self.announced: list[int] = []
        self.stopped_by = None

    def __getattr__(self, name):
        return getattr(self._context, name)

    @property
    def step(self) -> int:
        return self._trainer.step

    def announce_checkpoint(self, step: int) -> None:
        self.announced.append(step)


def weights_of(trainer) -> float:
    """The first element of the trainer's first trainable variable (:func:`set_step`)."""
    return float(np.asarray(trainer.model.trainable_variables[0].numpy()).flat[0])


def set_step(trainer, step: int) -> None:
    """Sets the trainer's step to ``step`` and its first trainable variable to ``step``
    everywhere."""
    trainer.step = step
    variable = trainer.model.trainable_variables[0]
    variable.assign(np.full(variable.shape, float(step), np.float32))
