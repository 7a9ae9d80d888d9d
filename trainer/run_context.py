"""What the framework's services see of a run: the narrow :class:`RunContext`.

The built-in services (checkpointing, telemetry and its sources, loggers, profiler,
evaluation, early stopping, the non-finite guard, preemption) are :class:`Service`
objects. Their hooks receive a ``RunContext`` instead of the Trainer: what a service may
read of the run and what it may ask of it, and nothing else. No service reads or writes
the loop driver or another service; what one service does for the others (an
evaluation's values, a saved checkpoint, a telemetry record) goes through the context,
and the dispatcher (:class:`trainer.callbacks.CallbackList`) delivers it.

The user's :class:`trainer.Callback` keeps receiving the Trainer itself.

Contexts: every member is called on the host, eagerly, in cross-replica context,
between ``tf.function`` calls, on every worker (the loop driver implements it:
:class:`trainer.loop.context.LoopContext`). Members marked *after a loop* return something
meaningful only once a train loop of the current ``fit()`` has run.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Protocol


class RunContext(Protocol):
    """The run as a service sees it (see the module docstring)."""

    # ------------------------------------------------------------------ read
    #: The experiment config (read it; never change it).
    config: Any
    #: The run's ``tf.distribute.Strategy``.
    strategy: Any
    #: Where the run writes, or None (nowhere).
    workdir: str | None
    #: The trained objects, as the Trainer holds them (checkpointing saves them,
    #: telemetry and probes read them): ``model``, ``optimizer``, ``ema`` (or None),
    #: ``precision`` (:class:`trainer.precision.PrecisionState`), ``gradients`` (the
    #: gradient path), ``step_counter`` (the in-graph step variable), ``steps`` (the
    #: default steps: ``steps.compute_loss`` is the user's loss hook).
    model: Any
    optimizer: Any
    ema: Any
    precision: Any
    gradients: Any
    step_counter: Any
    steps: Any
    #: The train batch: ``batch.global_size``, ``batch.replicas``, ``batch.per_replica``
    #: (:class:`trainer.data.BatchSizes`, checked divisible before any step).
    batch: Any
    #: The user's ``build_train_dataset`` hook (``ctx -> tf.data.Dataset``).
    train_dataset_fn: Callable

    @property
    def step(self) -> int:
        """Global steps done so far (a Python int)."""

    @property
    def is_chief(self) -> bool:
        """True on the one process that writes files."""

    @property
    def trainer_name(self) -> str:
        """The Trainer subclass's name (for messages)."""

    @property
    def has_eval_dataset(self) -> bool:
        """True when the Trainer overrides ``build_eval_dataset``."""

    @property
    def overrides_train_step(self) -> bool:
        """True when the Trainer overrides ``train_step`` (the default steps do not run)."""

    @property
    def eval_metric_names(self) -> tuple[str, ...]:
        """The names of ``build_metrics()`` (evaluation reports ``eval/NAME`` of each)."""

    @property
    def last_loop(self) -> tuple[int, float]:
        """After a loop: ``(steps, host seconds)`` of the last compiled loop call."""

    @property
    def last_outputs(self) -> dict:
        """After a loop: the last call's outputs (its last step's ``train_step`` values)."""

    @property
    def input_report(self) -> dict:
        """``{"input_layout": InputLayout}`` of the current train dataset (empty before
        it is built): the input pipelines whose streams it follows
        (:mod:`trainer.data.resume`), which the checkpoint records."""

    @property
    def saved_plan(self) -> dict | None:
        """The execution plan the run measured and the hardware signature it holds on
        (:meth:`trainer.loop.plan.Planner.saved`), which the checkpoint records; None while
        undecided or when the plan is fixed or was not measured."""

    @property
    def service_states(self) -> dict[str, dict]:
        """What the services keep in the checkpoint (:meth:`Service.checkpoint_state`),
        by ``checkpoint_key``."""

    @property
    def last_resume(self) -> Any:
        """The :class:`trainer.data.resume.Resumed` of the latest restore (None before
        one): the step, the worker counts before and now, the services' saved states.
        A new object at every restore (a resume, a rollback)."""

    @property
    def stopped_by(self) -> str | None:
        """Why the current (or last) ``fit()`` stopped early: ``"preemption"``, the
        reason given to ``request_stop``, or None (it ran to ``train.steps``). Set
        before ``on_train_end``."""

    def other_models_and_optimizers(self) -> dict[str, Any]:
        """Every other ``keras.Model`` and Keras optimizer in a public attribute of the
        Trainer (a second model, a second optimizer), by attribute name, sorted."""

    def owned_variables(self) -> list[tuple[str, Any]]:
        """``[(attribute path, variable)]``: the trainable variables the Trainer holds
        itself, trained with the model's (:mod:`trainer.step.owned_variables`)."""

    def random_states(self) -> list[tuple[str, Any]]:
        """``[(name, variable)]``: the states of the random generators the Trainer or its
        model's layers hold that are not model variables, and of the Trainer's Keras
        global generator (:mod:`trainer.step.random_streams`)."""

    def train_graph(self) -> Any:
        """After a loop: the ``tf.Graph`` of the compiled train loop as ``fit()`` traced
        it (no retrace); None before."""

    def train_batch_spec(self) -> Any:
        """After a loop: the ``tf.TypeSpec`` structure of one replica's train batch;
        None before."""

    # ------------------------------------------------------------------- ask
    def request_stop(self, reason: str) -> None:
        """Every worker stops at the end of the current loop (the flag is all-reduced)."""

    def request_preemption(self) -> None:
        """Checkpoint at the next loop boundary, then ``fit()`` raises ``Preempted``.
        Safe from a signal handler (sets a flag)."""

    def ensure_built(self, dist_dataset: Any = None) -> None:
        """Builds the model (from ``dist_dataset``'s spec, or the train dataset's) and
        the optimizer's and EMA's variables, if not built yet."""

    def evaluate(self) -> dict[str, float]:
        """One evaluation as ``Trainer.evaluate()`` does it (EMA weights swapped in)."""

    def export(self, path: str) -> None:
        """``Trainer.export(path)``: the model's SavedModel (EMA weights if any)."""

    def restore(self) -> int | None:
        """Restores the latest checkpoint once this run's pending saves are committed;
        returns its step, or None (no workdir or no checkpoint). Every worker calls it."""

    def resumed(self, resumed: Any) -> None:
        """The checkpoint service restored a state: ``resumed`` (a
        :class:`trainer.data.resume.Resumed`: the step, the worker counts before and
        now, the input layout the checkpoint recorded) sets the step and where the next
        train dataset resumes."""

    def reset_train_window(self) -> None:
        """Discards the train metrics accumulated since the last logging window."""

    def announce_eval(self, logs: dict[str, float]) -> None:
        """An evaluation's values: every callback's ``on_eval_end`` gets them right
        after the announcing hook returns."""

    def announce_checkpoint(self, step: int) -> None:
        """A checkpoint of ``step`` was saved: every callback's ``on_checkpoint`` runs
        right after the announcing hook returns."""


class Service:
    """Base class of the framework's services: the hooks of :class:`trainer.Callback`
    with the :class:`RunContext` in place of the Trainer. Every hook does nothing by
    default; see :mod:`trainer.callbacks` for when each one runs."""

    def on_fit_start(self, run: RunContext) -> None:
        """Before the first train loop of ``fit()`` (after any restore)."""

    def on_loop_end(self, run: RunContext) -> None:
        """After every compiled train loop; ``run.step`` is the global step."""

    def on_log(self, run: RunContext, logs: dict[str, float]) -> None:
        """At each logging window: ``train/loss``, ``train/<metric>``, throughput."""

    def on_eval_end(self, run: RunContext, logs: dict[str, float]) -> None:
        """After each evaluation during ``fit()``: ``eval/loss``, ``eval/<metric>``."""

    def on_checkpoint(self, run: RunContext, step: int) -> None:
        """A checkpoint of ``step`` was saved (or its async save issued)."""

    def on_train_end(self, run: RunContext) -> None:
        """Training stopped normally (last step reached or a stop agreed)."""

    def on_fit_end(self, run: RunContext, logs: dict[str, float]) -> None:
        """Once at the end of ``fit()``, with its results (partial if it raised)."""

    def next_boundary(self, step: int) -> float:
        """The next step (> ``step``) at which a train loop must end; inf: none."""
        return math.inf

    #: The key of this service's state in the checkpoint manifest (``services.KEY``);
    #: "" (the default): it keeps none.
    checkpoint_key = ""

    def checkpoint_state(self) -> dict | None:
        """Host, at each save: the JSON-able state this service needs after a resume or
        a rollback (it reads it back from ``run.last_resume.services[checkpoint_key]``);
        None: nothing to keep."""
        return None


def next_multiple(step: int, every: int) -> float:
    """The first multiple of ``every`` after ``step``; inf when ``every`` is 0 (never).

    The one cadence of the loop: logging windows, evaluations and checkpoints all end
    their loops at multiples of their ``every_steps``."""
    return (step // every + 1) * every if every > 0 else math.inf


# ---------------------------------------------------------------- run events
# The framework's own events of a run, on one path: a service reports, listeners act.
#
# A run's notable moments that are not a logging window or an evaluation — restored from
# a checkpoint, rolled back, stopped early (by a callback, early stopping, or because the
# workdir is already at ``train.steps``), preempted — are reported once to the run's
# :class:`RunEvents` (``trainer.run_context``, owned by the Trainer and handed to the services
# that report). Every listener receives the same record: telemetry writes it to
# ``metrics.jsonl`` and prints it through the progress service (console of a plain script,
# a notebook and ``trainer.main`` alike).
#
# Records (``time`` is added to each)::
#
#     {"kind": "restore", "step": S, "workdir": DIR}
#     {"kind": "stop", "step": S, "reason": TEXT}
#     {"kind": "rollback", "step": RESTORED, "from_step": S, "reason": TEXT,
#      "rollbacks": N, "max_rollbacks": M}
#     {"kind": "preemption", "step": S, "saved": S | None, "last_good": TEXT}
#     {"kind": "plan", "step": S, "source": "measured" | "checkpoint" | "skipped",
#      "chosen": {"xla": B, "steps_per_loop": N}, "baseline": {...}, "ratio": R,
#      "measure_s": T, "plans": [{"xla", "steps_per_loop", "steps_per_s", "vs_baseline"}],
#      ...}  (the execution plan: trainer.loop.plan)
#     {"kind": "goodput", "step": S, "goodput/goodput": G, "goodput/total_s": T, ...}
#      (at the end of fit(): where the time went, trainer.telemetry.goodput)
#
# Host only; no TensorFlow.
Record = dict[str, Any]


class RunEvents:
    """The events of one Trainer: ``subscribe(listener)``, then the reporting methods.

    ``records`` keeps every event reported so far (in order), e.g. for a notebook.
    """

    def __init__(self):
        self._listeners: list[Callable[[Record], None]] = []
        self.records: list[Record] = []

    def subscribe(self, listener: Callable[[Record], None]) -> None:
        """``listener(record)`` is called for every later event."""
        self._listeners.append(listener)

    def emit(self, kind: str, step: int, **fields: Any) -> Record:
        """Reports an event of ``kind`` at ``step`` to every listener; returns the record."""
        record = {"kind": kind, "step": int(step), **fields, "time": time.time()}
        self.records.append(record)
        for listener in self._listeners:
            listener(record)
        return record

    def latest(self, kind: str, since: int = 0) -> Record | None:
        """The newest record of ``kind`` among those reported after the first ``since``
        (None: none)."""
        return next((r for r in reversed(self.records[since:]) if r["kind"] == kind), None)

    def restore(self, step: int, workdir: str) -> Record:
        """The run resumed from the checkpoint of ``step`` in ``workdir``."""
        return self.emit("restore", step, workdir=workdir)

    def stop(self, step: int, reason: str) -> Record:
        """Training stops at ``step`` before ``train.steps`` (or does not start)."""
        return self.emit("stop", step, reason=reason)

    def rollback(self, step: int, from_step: int, reason: str, rollbacks: int,
                 max_rollbacks: int) -> Record:
        """At ``from_step`` the run went back to the checkpoint of ``step``."""
        return self.emit("rollback", step, from_step=int(from_step), reason=reason,
                         rollbacks=rollbacks, max_rollbacks=max_rollbacks)

    def plan(self, step: int, fields: dict[str, Any]) -> Record:
        """The run's execution plan was decided at ``step`` (:mod:`trainer.loop.plan`)."""
        return self.emit("plan", step, **fields)

    def preemption(self, step: int, saved: int | None, last_good: str) -> Record:
        """SIGTERM: the run stopped at ``step``, to be restarted; ``saved``: the step whose
        checkpoint the stop committed (None: none could be written), ``last_good``: the
        checkpoint a restart resumes from."""
        return self.emit("preemption", step, saved=saved, last_good=last_good)
