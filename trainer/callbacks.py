"""The public Callback API: how code acts at the loop's boundaries.

``from trainer import Callback``. Pass callbacks as ``Trainer(config, workdir,
callbacks=[...])`` or return them from ``build_callbacks()``. The framework's own
services (the FLOPs meter, telemetry and progress, the experiment loggers of
``telemetry.loggers``, profiler windows, periodic evaluation, the non-finite guard,
checkpointing, preemption) are callbacks too and run first, in that order; user callbacks follow in the order given (constructor list, then
``build_callbacks()``).

Every hook runs on the host, eagerly, in cross-replica context, between ``tf.function``
calls, on EVERY worker (a callback that writes files checks ``trainer.is_chief``).
``logs`` values are Python floats, already reduced across replicas and workers, and
identical on every worker.

Hooks, in the order a run calls them:

* ``on_fit_start(trainer)``: before the first loop, after any restore.
* ``on_log(trainer, logs)``: at each ``train.log_every_steps`` boundary (and the last
  step): ``train/loss``, ``train/<metric>``, ``perf/steps_per_s``,
  ``perf/examples_per_s``.
* ``on_eval_end(trainer, logs)``: after each evaluation during ``fit()``:
  ``eval/loss``, ``eval/<metric>``.
* ``on_checkpoint(trainer, step)``: a checkpoint for ``step`` was saved (or its async
  save issued).
* ``on_loop_end(trainer)``: after every compiled loop (``train.steps_per_loop`` steps);
  ``trainer.step`` is the global step.
* ``on_fit_end(trainer, logs)``: once, with what ``fit()`` returns (also when ``fit()``
  raises; then ``logs`` is partial).

``trainer.request_stop(reason)`` from any hook, on any worker, stops every worker at the
same loop boundary (the end of the current loop; the flag is all-reduced), writes a
final checkpoint there and makes ``fit()`` return normally.

A callback that raises stops the run with its exception; the message names the
callback's class and hook.

Framework extension points (used by the built-in services; a user callback may use
them too): ``next_boundary(step)`` makes a loop END at a given step, and
``on_train_end(trainer)`` runs when training stops normally (``train.steps`` reached or
a stop agreed), before ``on_fit_end``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from trainer.errors import UserError


class Callback:
    """Base class of callbacks; every hook does nothing by default."""

    def on_fit_start(self, trainer: Any) -> None:
        """Before the first train loop of ``fit()`` (after any restore)."""

    def on_loop_end(self, trainer: Any) -> None:
        """After every compiled train loop; ``trainer.step`` is the global step."""

    def on_log(self, trainer: Any, logs: dict[str, float]) -> None:
        """At each logging window: ``train/loss``, ``train/<metric>``, throughput."""

    def on_eval_end(self, trainer: Any, logs: dict[str, float]) -> None:
        """After each evaluation during ``fit()``: ``eval/loss``, ``eval/<metric>``."""

    def on_checkpoint(self, trainer: Any, step: int) -> None:
        """A checkpoint of ``step`` was saved (or its async save issued)."""

    def on_train_end(self, trainer: Any) -> None:
        """Training stopped normally (last step reached or a stop agreed)."""

    def on_fit_end(self, trainer: Any, logs: dict[str, float]) -> None:
        """Once at the end of ``fit()``, with its results (partial if it raised)."""

    def next_boundary(self, step: int) -> float:
        """The next step (> ``step``) at which a train loop must end; inf: none."""
        return math.inf


class CallbackList:
    """Dispatches each hook to the framework's services, then to the user's callbacks.

    An exception raised by a user callback propagates unchanged in type, its message
    prefixed with the callback's class and hook; the framework's own exceptions pass
    through untouched.
    """

    def __init__(self, services: Iterable[Callback], user: Iterable[Callback] = ()):
        self.services = list(services)
        self.user = list(user)
        for callback in self.user:
            if not isinstance(callback, Callback):
                raise UserError(f"Trainer(callbacks=...) must hold trainer.Callback "
                                f"instances; got {type(callback).__name__}.")

    def __iter__(self):
        return iter(self.services + self.user)

    def _call(self, hook: str, *args) -> None:
        for callback in self.services:
            getattr(callback, hook)(*args)
        for callback in self.user:
            try:
                getattr(callback, hook)(*args)
            except Exception as error:
                _name_in_message(error, f"{type(callback).__name__}.{hook}")
                raise

    def next_boundary(self, step: int) -> float:
        return min((c.next_boundary(step) for c in self), default=math.inf)

    def on_fit_start(self, trainer: Any) -> None:
        self._call("on_fit_start", trainer)

    def on_loop_end(self, trainer: Any) -> None:
        self._call("on_loop_end", trainer)

    def on_log(self, trainer: Any, logs: dict[str, float]) -> None:
        self._call("on_log", trainer, logs)

    def on_eval_end(self, trainer: Any, logs: dict[str, float]) -> None:
        self._call("on_eval_end", trainer, logs)

    def on_checkpoint(self, trainer: Any, step: int) -> None:
        self._call("on_checkpoint", trainer, step)

    def on_train_end(self, trainer: Any) -> None:
        self._call("on_train_end", trainer)

    def on_fit_end(self, trainer: Any, logs: dict[str, float]) -> None:
        """Calls every callback even when one raises; the first error is re-raised."""
        first: Exception | None = None
        for callback in self:
            try:
                callback.on_fit_end(trainer, logs)
            except Exception as error:  # noqa: BLE001 - re-raised below
                if callback in self.user:
                    _name_in_message(error, f"{type(callback).__name__}.on_fit_end")
                first = first or error
        if first is not None:
            raise first


def _name_in_message(error: Exception, where: str) -> None:
    """Puts ``where`` (``Class.hook``) into ``error``'s message, keeping its type."""
    note = f"raised in callback {where}"
    if len(error.args) == 1 and isinstance(error.args[0], str):
        if note not in error.args[0]:
            error.args = (f"{error.args[0]} ({note})",)
    elif hasattr(error, "add_note"):
        error.add_note(note)
