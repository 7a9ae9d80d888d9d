"""The framework's services, wired in the one order they run.

:func:`build_services` is the only place that orders them; the Trainer calls it once.
It sits above the service packages (checkpoint, telemetry, services), which never
import one another, and below the Trainer.
"""

from __future__ import annotations

import ml_collections

from trainer.checkpoint import inventory as checkpoint_inventory
from trainer.checkpoint.guards.lease import WorkdirLease
from trainer.checkpoint.guards.preemption import PreemptionWatcher
from trainer.checkpoint.local_saves import LocalSaves
from trainer.checkpoint.service import Checkpointer
from trainer.checkpoint.stop_save import StopSave
from trainer.precision import NonFinitePolicy
from trainer.run_context import RunEvents
from trainer.run_context import Service
from trainer.services.consistency import ConsistencyCheck
from trainer.services.early_stopping import EarlyStopping
from trainer.services.evaluation import PeriodicEvaluation
from trainer.services.history import History
from trainer.services.nonfinite import NonFiniteGuard
from trainer.services.pruning import Pruning
from trainer.telemetry.flops import FlopsMeter
from trainer.telemetry.goodput import Goodput
from trainer.telemetry.loggers import build_loggers
from trainer.telemetry.profiler import ProfilerWindows
from trainer.telemetry.service import Telemetry


def build_services(config: ml_collections.ConfigDict, workdir: str | None, chief: bool,
                   has_eval: bool, history: History, nonfinite: NonFinitePolicy,
                   events: RunEvents) -> tuple[list[Service], Checkpointer]:
    """The framework's services in the ONE order they run (every hook, every boundary),
    with why; user callbacks run after all of them, so they see each boundary's outcome
    (its evaluation, its checkpoint). Returns them with the checkpoint service, which
    a rollback's restore waits for. Services that report run events get ``events``
    (telemetry writes and prints them).

    The FLOPs meter is no service: telemetry asks it for values (a record source), and
    the loggers and goodput are telemetry's sinks too.
    """
    loggers = build_loggers(config)
    checkpointer = Checkpointer(config, workdir, chief, events)
    evaluation = PeriodicEvaluation(config, has_eval)
    local_saves = LocalSaves(config, workdir, chief)
    goodput = Goodput(workdir, chief, events, [checkpointer, local_saves], evaluation)
    telemetry = Telemetry(config, sources=[FlopsMeter(config)], sinks=[*loggers, goodput],
                          events=events)

    def last_good(workdir: str | None) -> str:  # once this run's saves are committed
        checkpointer.wait()
        return checkpoint_inventory.describe_last_good(workdir)

    return [
        # Before anything writes to the workdir: one run at a time holds it; a run whose
        # lease was taken over stops before the boundary's save.
        WorkdirLease(config.checkpoint.lease_s, chief),
        # What fit() returns: first, so it holds every window's and evaluation's values
        # whatever a later service raises.
        history,
        # Where the time went: its window hooks before telemetry's (the window record it
        # receives as a sink is then this boundary's); its end-of-fit event while
        # telemetry still writes. It reads what saves and evaluations cost from them.
        goodput,
        # The window record and progress line before anything acts on the window, so
        # metrics.jsonl shows the window that led to a rollback or stop before its event.
        telemetry,
        # Telemetry's sinks (MLflow): open their run after telemetry starts, close it after
        # telemetry's last record; they hear the checkpoint saved at the end.
        *loggers,
        # Trace windows start and stop at loop ends before evaluation and saves run, so
        # a window covers train steps only.
        ProfilerWindows(config),
        # Acts on the loop's outcome before anything uses the weights: a rollback
        # restores before this boundary's evaluation and save; 'stop' raises before a save.
        NonFiniteGuard(config, nonfinite, events, last_good),
        # Compares the replicas' copies after a rollback's restore and before anything
        # uses or saves the weights: a diverged state is never evaluated nor saved.
        ConsistencyCheck(config),
        # Evaluates before early stopping judges its values and before the checkpoint
        # that keeps the best step needs them.
        evaluation,
        # Judges the evaluation just announced; its stop is agreed after every hook.
        EarlyStopping(config),
        # A sweep's trial: reports the evaluation just announced to the study, whose
        # pruner may stop it; the stop is agreed after every hook, as early stopping's.
        Pruning(config),
        # Saves after every service that changes the state or reports on it at this
        # boundary (rollback, evaluation); the final save follows the final evaluation.
        checkpointer,
        # Each worker's local copy after the boundary's workdir save (a restart at a step
        # both hold then reads no bucket).
        local_saves,
        # The save of a stop before train.steps (and a preemption's outcome, reported as
        # its event) right after the boundary's other saves.
        StopSave(checkpointer, config, events),
        # Last: SIGTERM is handled from when every service has started until all ended.
        PreemptionWatcher(),
    ], checkpointer
