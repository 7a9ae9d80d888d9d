"""The public Callback API: how code acts at the loop's boundaries.

``from trainer import Callback``. Pass callbacks as ``Trainer(config, workdir,
callbacks=[...])`` or return them from ``build_callbacks()``. The framework's own
services (:class:`trainer.run_context.Service`: the run's history, the FLOPs meter,
telemetry and progress, the experiment loggers, profiler windows, the non-finite guard,
periodic evaluation, early stopping, checkpointing, preemption) receive the same hooks
and run first, in the one order written (with why) in :func:`trainer.service_order.build_services`;
user callbacks follow in the order given (constructor list, then ``build_callbacks()``).

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

(Evaluation and checkpointing are services that run inside another hook: at a loop end,
say. What they announce, ``on_eval_end`` and ``on_checkpoint``, is dispatched to every
callback right after the announcing service's hook returns, before the next callback's
hook: one dispatcher, one order.)
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

from absl import logging

from trainer.errors import UserError
from trainer.run_context import Service


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
    """Dispatches each hook to the framework's services (with the run context), then to
    the user's callbacks (with the Trainer).

    After each service's hook, what it announced (``run.announce_eval``,
    ``run.announce_checkpoint``) is dispatched to every callback before the next one
    runs. An exception raised by a user callback propagates unchanged in type, its
    message prefixed with the callback's class and hook; the framework's own exceptions
    pass through untouched.

    Args:
      services: the framework's services, in order.
      user: the user's callbacks, in order.
      trainer: what user callbacks receive.
      run: what services receive; ``run.take_announcements()`` returns (and forgets)
        the ``(hook, argument)`` pairs announced since the last call.
    """

    def __init__(self, services: Iterable[Service], user: Iterable[Callback], trainer: Any,
                 run: Any):
        self.services = list(services)
        self.user = list(user)
        self._trainer, self._run = trainer, run
        for callback in self.user:
            if not isinstance(callback, Callback):
                raise UserError(f"Trainer(callbacks=...) must hold trainer.Callback "
                                f"instances; got {type(callback).__name__}.")

    def __iter__(self):
        return iter(self.services + self.user)

    def _call(self, hook: str, *args, done: list | None = None) -> None:
        """``hook`` on every service, then every user callback; each one whose hook
        returned is appended to ``done`` (when given)."""
        for service in self.services:
            getattr(service, hook)(self._run, *args)
            if done is not None:
                done.append(service)
            self._dispatch_announcements()
        for callback in self.user:
            try:
                getattr(callback, hook)(self._trainer, *args)
            except Exception as error:
                _name_in_message(error, f"{type(callback).__name__}.{hook}")
                raise
            if done is not None:
                done.append(callback)

    def _dispatch_announcements(self) -> None:
        for hook, arg in self._run.take_announcements():
            self._call(hook, arg)

    def next_boundary(self, step: int) -> float:
        return min((c.next_boundary(step) for c in self), default=math.inf)

    def service_states(self) -> dict[str, dict]:
        """``{checkpoint_key: checkpoint_state()}`` of the services that keep one."""
        states = {s.checkpoint_key: s.checkpoint_state() for s in self.services
                  if s.checkpoint_key}
        return {key: state for key, state in states.items() if state is not None}

    def on_fit_start(self) -> None:
        """When one callback raises, every one whose ``on_fit_start`` returned gets its
        ``on_fit_end`` (empty results: an MLflow run is ended as FAILED, threads and
        signal handlers are released), then the error propagates; the others get
        neither."""
        self._run.take_announcements()  # none left from a fit() that raised mid-hook
        started: list = []
        try:
            self._call("on_fit_start", done=started)
        except BaseException:
            self._end(started, {}, reraise=False)
            raise

    def _end(self, callbacks: list, logs: dict[str, float], reraise: bool) -> None:
        """``on_fit_end`` on each of ``callbacks`` even when one raises; the first error
        is re-raised (``reraise``) or logged."""
        first: Exception | None = None
        for callback in callbacks:
            user = callback in self.user
            try:
                callback.on_fit_end(self._trainer if user else self._run, logs)
            except Exception as error:  # noqa: BLE001 - re-raised or logged below
                if user:
                    _name_in_message(error, f"{type(callback).__name__}.on_fit_end")
                first = first or error
        if first is not None:
            if reraise:
                raise first
            logging.warning("on_fit_end after a failed fit start also raised: %s", first)

    def on_loop_end(self) -> None:
        self._call("on_loop_end")

    def on_log(self, logs: dict[str, float]) -> None:
        self._call("on_log", logs)

    def on_train_end(self) -> None:
        self._call("on_train_end")

    def on_fit_end(self, logs: dict[str, float]) -> None:
        """Calls every callback even when one raises; the first error is re-raised."""
        self._end(list(self), logs, reraise=True)


def _name_in_message(error: Exception, where: str) -> None:
    """Puts ``where`` (``Class.hook``) into ``error``'s message, keeping its type."""
    note = f"raised in callback {where}"
    if len(error.args) == 1 and isinstance(error.args[0], str):
        if note not in error.args[0]:
            error.args = (f"{error.args[0]} ({note})",)
    elif hasattr(error, "add_note"):
        error.add_note(note)
