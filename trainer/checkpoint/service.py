"""Checkpointing as a service: the save policy (a service) and the best export.

Saves happen at every multiple of ``checkpoint.every_steps`` and at ``train.steps``
(all workers pass a barrier before ``fit()`` returns); the save of a run that stops
early (``request_stop`` or preemption) is :mod:`trainer.checkpoint.stop_save`'s, through
:meth:`Checkpointer.save`. With gradient accumulation
only steps that are multiples of ``perf.grad_accum_steps`` are saved (a step inside a
window holds partial per-replica sums; config validation makes ``every_steps`` and
``train.steps`` multiples). With ``checkpoint.best_metric`` (``"eval/NAME"`` or
``"train/NAME"``) a save per evaluation (or logging window) also goes to the best
directory, and the best step's model is exported to ``workdir/export/best`` at the end
of ``fit()``. Every save of the latest state is announced (``run.announce_checkpoint``):
every callback's ``on_checkpoint`` runs once the saving hook returns.

The loop is held only while the state is copied to host memory; that copy goes into
buffers kept between the saves of one ``fit()`` (one state-sized host copy per
directory in use, freed when ``fit()`` returns). See :mod:`trainer.checkpoint.storage` for
files and formats and :mod:`trainer.checkpoint.state` for what is saved and how it is
matched.

Resume is :mod:`trainer.checkpoint.resume`. A save failing on a full, read-only or
vanished disk warns and retries, then stops (:mod:`trainer.checkpoint.save_failures`);
a checkpoint directory deleted during the run is made again by the next save, with one
warning. A periodic save due while the previous async write still runs is skipped
(:mod:`trainer.checkpoint.deferral`). Only the chief (``distribute.is_chief``) writes.

Contexts: host, eager, cross-replica, between ``tf.function`` calls.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import numpy as np
import tensorflow as tf
from absl import logging

from trainer.checkpoint import inventory
from trainer.checkpoint import state as checkpoint_state
from trainer.checkpoint.deferral import SaveDeferral
from trainer.checkpoint.resume import load
from trainer.checkpoint.save_failures import SaveFailures
from trainer.checkpoint.storage.writer import CheckpointWriter, StillWriting
from trainer.checkpoint.storage.reader import BEST_DIR, LATEST_DIR
from trainer.config import ConfigError
from trainer.distribution import host_collectives
from trainer.errors import storage_fault
from trainer.precision import NonFiniteError
from trainer.run_context import RunContext, Service, next_multiple
from trainer.runtime import gcs, signals
from trainer.runtime.waiting import said_while_waiting

BEST_EXPORT_DIR = os.path.join("export", "best")
_SKIPPED, _SAVED, _WRITE = 0, 1, 2  # what the chief tells the workers of a save in shares


# ------------------------------------------------------------------ service
class Checkpointer(Service):
    """Saves on the ``checkpoint.*`` policy and exports the best (see the module doc).

    Inactive without a workdir. The orbax managers exist on the chief only. With
    ``events`` (the run's :class:`trainer.run_context.RunEvents`), the first ``fit()`` after
    a restore written by another number of workers reports ``{"kind": "resume", "step",
    "from_workers", "to_workers"}`` (metrics.jsonl and one console line). ``writer`` and
    ``deferral``: the :class:`~trainer.checkpoint.storage.writer.CheckpointWriter` and
    :class:`~trainer.checkpoint.deferral.SaveDeferral` to use instead of the default
    ones (a slower or failing writer under test). ``blocking_s``: the seconds the
    caller waited in :meth:`save` and :meth:`wait` so far (the host copy, a previous
    write's commit, a stop's whole save; not an async write's background part).
    """

    def __init__(self, config, workdir: str | None, chief: bool, events: Any = None,
                 writer: CheckpointWriter | None = None, deferral: SaveDeferral | None = None):
        cfg = config.checkpoint
        self.enabled = workdir is not None
        self.accum_steps = config.perf.grad_accum_steps
        self.every = cfg.every_steps
        self.total = config.train.steps
        self.chief = chief
        self.best_metric = cfg.best_metric
        self.best_source = cfg.best_metric.partition("/")[0]
        self.writer = writer or (CheckpointWriter(workdir, cfg, cfg.best_metric)
                               if self.enabled else None)
        self._host_state: dict[str, dict[str, list[np.ndarray]]] = {}  # snapshot buffers
        self._saved: dict[str, int] = {}  # the last step saved to each kind by this run
        self.failures, self.deferral = SaveFailures(workdir), deferral or SaveDeferral(self.every)
        self.events = events
        self._reported: Any = None  # the restore last written as a resume record
        self.blocking_s = 0.0  # seconds the loop waited in save() and wait(), this process
        self._share: bool | None = None  # every worker writes its share (at the first save)
        self._told = False  # the chief told the workers of this save (in shares)

    def next_boundary(self, step: int) -> float:
        return next_multiple(step, self.every if self.enabled else 0)

    def save(self, run: RunContext, kind: str = LATEST_DIR,
             metrics: dict[str, float] | None = None, wait: bool = False,
             deadline: float | None = None) -> bool:
        """:meth:`_save`, its time added to :attr:`blocking_s`."""
        started = time.monotonic()
        try:
            return self._save(run, kind, metrics, wait, deadline)
        finally:
            self.blocking_s += time.monotonic() - started

    def _save(self, run: RunContext, kind: str, metrics: dict[str, float] | None,
              wait: bool, deadline: float | None) -> bool:
        """:meth:`_save_alone`; on several workers saving in shares, the chief's save
        tells every worker when to write its share (:meth:`_save_shared`)."""
        if self._shared(run):
            return self._save_shared(run, kind, metrics, wait, deadline)
        return self._save_alone(run, kind, metrics, wait, deadline)

    def _shared(self, run: RunContext) -> bool:  # see CheckpointWriter.share_over
        if self._share is None:
            self._share = self.enabled and self.writer.share_over(
                host_collectives.worker_index(run.strategy),
                host_collectives.num_workers(run.strategy))
        return self._share

    def _save_shared(self, run: RunContext, kind: str, metrics: dict[str, float] | None,
                     wait: bool, deadline: float | None) -> bool:
        """The chief saves as alone and tells every worker, once per call, :data:`_WRITE`
        right before its write (each worker writes the step too and uploads its share,
        :mod:`~trainer.checkpoint.storage.shares`; a failed one fails the chief's save),
        else :data:`_SAVED` or :data:`_SKIPPED` as it returns or raises."""
        if self.chief:
            self._told, saved = False, False
            try:
                saved = self._save_alone(run, kind, metrics, wait, deadline)
                return saved
            finally:
                if not self._told:
                    host_collectives.from_chief(run.strategy, _SAVED if saved else _SKIPPED)
        told = host_collectives.from_chief(run.strategy, 0)
        if told == _SKIPPED:
            if not checkpoint_state.all_finite(run):  # the chief raised the same
                raise self._nonfinite(run)
            return False
        if told == _WRITE:
            self.writer.wait(kind, _remaining(deadline))  # its buffers are reused
            if self.writer.has(kind, run.step):  # the chief writes a failed save again
                self.writer.discard(kind)
            state, manifest = checkpoint_state.snapshot(run, self._host_state.get(kind))
            self._host_state[kind] = state
            try:
                self.writer.save(kind, run.step, state, manifest, metrics, wait,
                                 timeout=_remaining(deadline))
            except Exception as error:  # noqa: BLE001 - only storage faults are handled
                if isinstance(error, StillWriting) or storage_fault(error) is None:
                    raise
                self.writer.failed_share(kind, run.step, error)
        self._saved[kind] = run.step
        if kind == LATEST_DIR:
            run.announce_checkpoint(run.step)
        return True

    def _nonfinite(self, run: RunContext) -> NonFiniteError:
        return NonFiniteError(
            f"The weights are NaN/inf at step {run.step}; no checkpoint was written "
            f"(the last good checkpoint is {inventory.describe_last_good(run.workdir)}). Set "
            f"train.on_nonfinite='skip' or 'rollback', lower optimizer.learning_rate, "
            f"or set optimizer.clipnorm.")

    def _save_alone(self, run: RunContext, kind: str, metrics: dict[str, float] | None,
                    wait: bool, deadline: float | None) -> bool:
        """Saves the current state (chief writes; every worker announces a save of the
        latest state, so every callback's ``on_checkpoint`` runs). A step already saved
        to ``kind`` by this run is not saved again; with ``wait`` (a stop's save) its
        write in flight is waited for and checked committed, and written again if it
        is not. A save skipped (:mod:`~trainer.checkpoint.deferral`) or failed is not
        a saved step: the stop's save at that step writes it. Returns whether the step
        is saved (with ``wait``, on the chief: committed, as the storage shows; checked
        once). ``deadline`` (monotonic seconds; a preemption's grace period): the waits
        for a bucket's uploads end then, raising :class:`StillWriting`."""
        checked = wait and self.chief
        if self._saved.get(kind) == run.step:
            if not checked:
                return True
            self._commit_pending(kind, deadline=deadline)
            if self.writer.committed(kind, run.step):
                return True
            self._saved.pop(kind, None)
        if not checkpoint_state.all_finite(run):
            if self.chief:  # a pending save of an earlier step is a good checkpoint
                self._commit_pending(deadline=deadline)
            raise self._nonfinite(run)
        if self.chief and not self._write(run, kind, metrics, wait, deadline):
            return False
        self._saved[kind] = run.step
        if kind == LATEST_DIR:
            run.announce_checkpoint(run.step)
        return not checked or self.writer.committed(kind, run.step)

    def _write(self, run: RunContext, kind: str, metrics: dict[str, float] | None,
               wait: bool, deadline: float | None) -> bool:
        """Writes the current state to ``kind`` (chief); False when it was skipped
        (:mod:`~trainer.checkpoint.deferral`) or a storage fault stopped it."""
        if not wait and kind == LATEST_DIR and run.step < self.total:
            if signals.seconds_since_signal() is not None:
                logging.info("checkpoint of step %d: left to the stop's save at this boundary "
                             "(a stop signal came).", run.step)
                return False
            if self.deferral.skip(run.step, lambda: self.writer.in_flight(kind),
                                  os.path.join(run.workdir, kind), why=gcs.retry_reason):
                return False
        self._commit_pending(kind, deadline=deadline)  # the buffers reused may still be read
        try:
            if self.writer.vanished(kind):
                self._recreate(kind, run.step)
            if self.writer.has(kind, run.step) and self._intact(kind, run.step):
                return True
            state, manifest = checkpoint_state.snapshot(run, self._host_state.get(kind))
            self._host_state[kind] = state
            if self._share:  # every worker writes its share of this step now
                self._told = bool(host_collectives.from_chief(run.strategy, _WRITE))
            with said_while_waiting(f"the checkpoint of step {run.step} being written to "
                                    f"{os.path.join(run.workdir, kind)}", why=gcs.retry_reason):
                self.writer.save(kind, run.step, state, manifest, metrics, wait,
                                timeout=_remaining(deadline))
        except StillWriting:
            raise
        except Exception as error:  # noqa: BLE001 - only storage faults are handled
            self._storage_fault(error, kind, run.step, final=wait)
            return False
        if wait:
            self.failures.succeeded()
        logging.info("checkpoint of step %d -> %s%s", run.step,
                     os.path.join(run.workdir, kind), "" if wait else " (async)")
        return True

    def _intact(self, kind: str, step: int) -> bool:
        """Whether the copy of ``step`` already in ``kind`` (a resume fell back from it, or
        a run before wrote it) verifies; a corrupt one is removed with one warning, so the
        save about to happen replaces it (otherwise every later resume would fall back
        from it and train those steps again)."""
        entry = inventory.check(step, self.writer.path(kind, step))
        if entry.state == inventory.COMPLETE:
            return True
        logging.warning("The checkpoint of step %d in %s is corrupt (%s): replaced by this "
                        "run's save of that step.", step, os.path.join(self.writer.workdir, kind),
                        entry.detail)
        self.writer.delete(kind, step)
        return False

    def _recreate(self, kind: str, step: int) -> None:
        """The directory of ``kind`` vanished during the run: one warning; the manager is
        dropped (with the error of a write the deletion cut) and the save about to
        happen makes the directory again. Not a failed save: training goes on."""
        directory = os.path.join(self.writer.workdir, kind)
        self.writer.discard(kind)
        logging.warning("Storage error (training goes on): the checkpoint directory %s "
                        "vanished during the run (deleted?); the checkpoint of step %d makes "
                        "it again. The last good checkpoint is %s.", directory, step,
                        inventory.describe_last_good(self.writer.workdir))

    def _commit_pending(self, kind: str | None = None, final: bool = False,
                        deadline: float | None = None) -> None:
        """Waits for the async writes of ``kind`` (default: all), until ``deadline`` at
        most; one that failed on a storage fault is handled (:meth:`_storage_fault`)."""
        for name in [k for k in self.writer.kinds() if kind in (None, k)]:
            step = self.writer.pending(name)
            notice = (contextlib.nullcontext() if step is None else said_while_waiting(
                f"the checkpoint of step {step} being written to "
                f"{os.path.join(self.writer.workdir, name)} to commit",
                why=gcs.retry_reason))  # none: no thread
            try:
                with notice:
                    self.writer.wait(name, timeout=_remaining(deadline))
            except StillWriting:
                raise
            except Exception as error:  # noqa: BLE001 - only storage faults are handled
                self._storage_fault(error, name, step, final)
                continue
            if step is not None:
                self.failures.succeeded()

    def _storage_fault(self, error: Exception, kind: str, step: int | None,
                       final: bool) -> None:
        """A write failed: re-raised unless a storage fault; else the manager of ``kind``
        is dropped (the next one removes the incomplete step directory) and the run
        warns or stops (:class:`~trainer.checkpoint.save_failures.SaveFailures`)."""
        if storage_fault(error) is None:
            raise error
        if step is not None and self._saved.get(kind) == step:
            del self._saved[kind]  # not saved: a stop's save at this step writes it again
        self.writer.discard(kind)
        self.failures.failed(error, os.path.join(self.writer.workdir, kind), step, final)

    def wait(self) -> None:
        """Blocks until pending async saves are committed (chief; others return); its
        time is added to :attr:`blocking_s`."""
        if self.enabled and self.chief:
            started = time.monotonic()
            self._commit_pending()
            self.blocking_s += time.monotonic() - started

    # --- hooks
    def on_fit_start(self, run: RunContext) -> None:
        self._record_resume(run)
        if self.enabled and self.best_source == "eval" and not run.has_eval_dataset:
            raise ConfigError(f"config.checkpoint.best_metric={self.best_metric!r} needs an "
                              f"eval dataset; override build_eval_dataset or use a "
                              f"'train/...' metric.")
        if self.enabled and self.best_source == "eval":
            # eval reports exactly eval/loss and eval/NAME of build_metrics() (train/ also
            # reports train_step's other outputs, known only once it runs).
            produced = sorted({"eval/loss", *(f"eval/{n}" for n in run.eval_metric_names)})
            if self.best_metric not in produced:
                raise ConfigError(
                    f"config.checkpoint.best_metric={self.best_metric!r} is not a value eval "
                    f"produces ({', '.join(produced)}: eval/loss and build_metrics()'s "
                    f"names); pick one of them.")

    def _record_resume(self, run: RunContext) -> None:
        """The resume event of the latest restore on another number of workers, once
        (a restore on the same count is the ``restore`` event alone)."""
        resumed = run.last_resume
        if self.events is None or resumed is None or resumed is self._reported:
            return
        if resumed.from_workers == resumed.to_workers:
            return
        self._reported = resumed
        self.events.emit("resume", resumed.step, from_workers=resumed.from_workers,
                         to_workers=resumed.to_workers)

    def on_loop_end(self, run: RunContext) -> None:
        if not self.enabled:
            return
        if run.step >= self.total or (self.every and run.step % self.every == 0):
            self.save(run)  # the last step even inside an accumulation: the run ends

    def on_train_end(self, run: RunContext) -> None:
        """At ``train.steps`` (its save was the last loop's): every worker waits for the
        others, so none leaves before the save. An early stop's save is
        :class:`trainer.checkpoint.stop_save.StopSave`'s."""
        if self.enabled and run.step >= self.total:
            host_collectives.barrier(run.strategy)

    def _save_best(self, run: RunContext, logs: dict[str, float]) -> None:
        if self.best_metric not in logs:
            raise ConfigError(
                f"config.checkpoint.best_metric={self.best_metric!r} is not among the "
                f"{self.best_source} values ({', '.join(sorted(logs))}).")
        if run.step % self.accum_steps == 0:
            self.save(run, BEST_DIR, {self.best_metric: float(logs[self.best_metric])})

    def on_log(self, run: RunContext, logs: dict[str, float]) -> None:
        if self.enabled and self.best_source == "train":
            self._save_best(run, logs)

    def on_eval_end(self, run: RunContext, logs: dict[str, float]) -> None:
        if self.enabled and self.best_source == "eval":
            self._save_best(run, logs)

    def on_fit_end(self, run: RunContext, logs: dict[str, float]) -> None:
        if not self.enabled:
            return
        if not self.chief:
            if self._share:  # its last share uploaded, its staging directory removed
                self.writer.close()
                self._host_state.clear()
            return
        self._commit_pending(final=True)
        best = self.writer.best_step()
        if best is not None and run.step >= self.total:
            self._export_best(run, best)
        self.writer.close()
        self._host_state.clear()

    def _export_best(self, run: RunContext, step: int) -> None:
        """Exports the best step's model to ``workdir/export/best`` (chief)."""
        groups = checkpoint_state.state_variables(run, optional=True)
        current, _ = checkpoint_state.snapshot(run)
        state, _ = load(os.path.join(run.workdir, BEST_DIR, str(step)), groups)
        target = os.path.join(run.workdir, BEST_EXPORT_DIR)
        model_only = {g: groups[g] for g in ("model", "ema") if g in groups}
        current = {g: current[g] for g in model_only}
        state = {g: state[g] for g in model_only}
        try:
            checkpoint_state.assign(model_only, state)
            if tf.io.gfile.exists(target):
                tf.io.gfile.rmtree(target)
            run.export(target)
        finally:
            checkpoint_state.assign(model_only, current)
        metrics = self.writer.metrics(BEST_DIR, step)
        with tf.io.gfile.GFile(os.path.join(target, "best.json"), "w") as f:
            f.write(json.dumps({"step": step, **{k.partition("/")[2]: float(v)
                                                 for k, v in metrics.items()}}))
        logging.info("exported the best checkpoint (step %d, %s) to %s", step, metrics, target)


def _remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (monotonic), at least 0; None: no bound."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
