"""Checkpointing as a service: the save policy (a service), resume, and the best export.

Saves happen at every multiple of ``checkpoint.every_steps``, at ``train.steps`` and
when training stops early (``request_stop`` or preemption: then synchronously, and all
workers pass a barrier before ``fit()`` returns or raises). With gradient accumulation
only steps that are multiples of ``perf.grad_accum_steps`` are saved (a step inside a
window holds partial per-replica sums; config validation makes ``every_steps`` and
``train.steps`` multiples). With ``checkpoint.best_metric`` (``"eval/NAME"`` or
``"train/NAME"``) a save per evaluation (or logging window) also goes to the best
directory, and the best step's model is exported to ``workdir/export/best`` at the end
of ``fit()``. Every save of the latest state is announced (``run.announce_checkpoint``):
every callback's ``on_checkpoint`` runs once the saving hook returns.

The loop is held only while the state is copied to host memory; that copy goes into
buffers kept between the saves of one ``fit()`` (one state-sized host copy per
directory in use, freed when ``fit()`` returns). See :mod:`trainer.checkpoint.store` for
files and formats and :mod:`trainer.checkpoint.state` for what is saved and how it is
matched.

Resume (:func:`restore`): the step is restored BEFORE the train dataset is built, and
the dataset skips the consumed batches in every input pipeline; exact for a
deterministic pipeline (``train.deterministic``, seeded shuffles), and a warning says
when it cannot hold; also on another number of workers (the input follows the
checkpoint's input layout, :mod:`trainer.data_resume`). Every restore logs the worker
counts of both runs, and the next ``fit()`` writes a ``"resume"`` record. When resuming (``step=None``) a committed step that cannot be read
is skipped with a warning and the previous one is tried.

A restore checks a step's files against their checksums (a damaged step is skipped
like an unreadable one); a save failing on a full or read-only disk warns and retries,
then stops (:mod:`trainer.checkpoint.save_failures`).

Multi-worker: only the chief (``distribute.is_chief``) writes and reads; every worker
takes part in a restore, which the chief performs and broadcasts to the others over TF
collectives (the other workers need no access to the chief's files).

Contexts: host, eager, cross-replica, between ``tf.function`` calls.
"""

from __future__ import annotations

import json
import os

import numpy as np
import tensorflow as tf
from absl import logging

from trainer import data_resume, host_collectives
from trainer.checkpoint import inventory
from trainer.checkpoint import state as checkpoint_state
from trainer.checkpoint.state import CheckpointError
from trainer.checkpoint.store import BEST_DIR, LATEST_DIR, CheckpointStore, Unreadable
from trainer.checkpoint.store import candidates as _all_candidates
from trainer.checkpoint.store import read_manifest, read_state, verify
from trainer.checkpoint.save_failures import SaveFailures
from trainer.config import ConfigError
from trainer.errors import storage_fault
from trainer.precision import NonFiniteError
from trainer.run_context import RunContext, Service, next_multiple

BEST_EXPORT_DIR = os.path.join("export", "best")
_NONE, _FAILED = -1, -2
_CHIEF_FAILED = "The chief could not restore the checkpoint; its log has the reason."


# ------------------------------------------------------------------- restore
def load(path: str, groups: checkpoint_state.Groups) -> tuple[dict, dict]:
    """Reads and checks one step directory (chief): ``(state in groups' order, manifest)``.

    Then its files are checked against their checksums (:class:`Unreadable` naming the
    file; none: an earlier version, said once); the ``.npy`` array files by the CRC of
    the bytes just read, the others read again. A failed read, or a manifest that does
    not fit, is :class:`Unreadable` when a file does not match (naming both)."""
    try:
        manifest = read_manifest(path)
        checkpoint_state.check_compatible(manifest, groups, f"checkpoint {path}")
        state, known = read_state(path, manifest)
    except (Unreadable, CheckpointError) as error:
        try:
            verify(path)
        except Unreadable as damaged:
            raise Unreadable(f"{error}; {damaged}" if isinstance(error, Unreadable)
                             else str(damaged)) from error
        raise
    if not verify(path, known):
        inventory.note_unverified(os.path.dirname(os.path.normpath(path)))
    return checkpoint_state.in_trainer_order(groups, manifest, state), manifest


def _select(workdir: str, step: int | None) -> list[tuple[int, str]]:
    """The step directories to try, newest first (only ``step``'s when given: then a
    save in progress of another step is no reason for a warning)."""
    found = _all_candidates(workdir, warn_incomplete=step is None)
    if step is None:
        return found
    chosen = [c for c in found if c[0] == step]
    if not chosen:
        available = sorted({s for s, _ in found})
        raise CheckpointError(f"There is no checkpoint of step {step} in {workdir} "
                              f"(available: {available or 'none'}).")
    return chosen


def _load_first_readable(found: list, groups: dict, step: int | None) -> tuple[dict, dict]:
    """Loads the newest readable candidate; with ``step`` given, only that step."""
    reasons = []
    for _, path in found:
        try:
            return load(path, groups)
        except Unreadable as error:
            reasons.append(f"{path}: {error}")
            if step is None:
                logging.warning("Skipping checkpoint %s: %s; trying an earlier one.", path, error)
    raise CheckpointError(
        "No readable checkpoint: " + "; ".join(reasons) + ". The files are corrupt or "
        "incomplete: delete those step directories (training then resumes from an "
        "earlier one, or from scratch).")


def restore(run: RunContext, step: int | None = None) -> int | None:
    """Restores the latest (or the given) checkpoint in ``run.workdir``.

    Builds the model and optimizer variables if need be (``run.ensure_built``). Sets the
    variables, and the step and input resume position (``run.resumed``); returns the
    step, or None when there is no checkpoint (``step=None`` only). Call it on every
    worker: the chief reads, the others receive the state over collectives. Raises
    :class:`CheckpointError` (naming the variable) when a checkpoint is missing,
    unreadable or does not fit the model.
    """
    strategy = run.strategy
    multi = host_collectives.num_workers(strategy) > 1
    chief = host_collectives.is_chief(strategy)
    if run.workdir is None:
        if step is not None:
            raise CheckpointError(f"restore(step={step}) needs a workdir; this Trainer has none.")
        return None
    found, failure, newest = [], None, _NONE
    if chief:
        try:
            found = _select(run.workdir, step)
            newest = found[0][0] if found else _NONE
        except CheckpointError as error:
            failure, newest = error, _FAILED
    if multi:  # every worker learns the chief's answer before anything else happens
        newest = host_collectives.from_chief(strategy, newest)
    if newest == _FAILED:
        raise failure or CheckpointError(_CHIEF_FAILED)
    if newest == _NONE:
        return None
    run.ensure_built()  # the variables a checkpoint fills must exist
    groups = checkpoint_state.state_variables(run)
    state, manifest, failure = None, None, None
    if chief:
        try:
            state, manifest = _load_first_readable(found, groups, step)
        except CheckpointError as error:
            failure = error
    if multi:
        status = host_collectives.from_chief(strategy, manifest["step"] if manifest else _FAILED)
        if status == _FAILED:
            raise failure or CheckpointError(_CHIEF_FAILED)
        flat = host_collectives.broadcast_arrays(
            strategy, [a for g in groups for a in state[g]] if chief else None,
            checkpoint_state.like(groups))
        state, i = {}, 0
        for group, entries in groups.items():
            state[group], i = flat[i:i + len(entries)], i + len(entries)
        restored = status
        words = host_collectives.sum_over_workers(
            strategy, _input_words(manifest) if chief else np.zeros(4, np.int32))
    else:
        if failure:
            raise failure
        restored = manifest["step"]
        words = _input_words(manifest)
    workers = host_collectives.num_workers(strategy)
    services = host_collectives.json_from_chief(
        strategy, manifest.get("services", {}) if chief else None)
    resumed = data_resume.Resumed(restored, int(words[0]), workers,
                                  data_resume.InputLayout.from_words(words[1:]),
                                  manifest.get("plan") if chief else None, services)
    checkpoint_state.assign(groups, state)
    run.resumed(resumed)  # the step, and the input layout the train input continues
    if chief:
        _warn_on_input_changes(run.config, manifest)
    logging.info("resumed from step %d (%s), written by %d worker(s), continued on %d",
                 restored, run.workdir if chief else "the chief's checkpoint, broadcast",
                 resumed.from_workers, workers)
    return restored


def _input_words(manifest: dict) -> np.ndarray:
    """The checkpoint's worker count and input layout (zeros: none), as 4 int32 words."""
    layout = data_resume.InputLayout.from_manifest(manifest)
    return np.concatenate([np.array([int(manifest.get("workers", 0))], np.int32),
                           layout.to_words() if layout else np.zeros(3, np.int32)])


def _warn_on_input_changes(cfg, manifest: dict) -> None:
    if not cfg.train.deterministic:
        logging.warning("train.deterministic is False: the input resumes after %d batches, "
                        "but their order may differ from the interrupted run.", manifest["step"])
    if manifest["global_batch_size"] != cfg.train.global_batch_size:
        logging.warning("The checkpoint was written with train.global_batch_size=%d, the run "
                        "uses %d: the input position (%d batches) is no longer exact.",
                        manifest["global_batch_size"], cfg.train.global_batch_size,
                        manifest["step"])
    if manifest["seed"] != cfg.seed:
        logging.warning("The checkpoint was written with seed=%d, the run uses seed=%d.",
                        manifest["seed"], cfg.seed)


# ------------------------------------------------------------------ service
class Checkpointer(Service):
    """Saves on the ``checkpoint.*`` policy and exports the best (see the module doc).

    Inactive without a workdir. The orbax managers exist on the chief only. With
    ``events`` (the run's :class:`trainer.events.RunEvents`), the first ``fit()`` after
    a restore written by another number of workers reports ``{"kind": "resume", "step",
    "from_workers", "to_workers"}`` (metrics.jsonl and one console line).
    """

    def __init__(self, config, workdir: str | None, chief: bool, events: Any = None):
        cfg = config.checkpoint
        self.enabled = workdir is not None
        self.k = config.perf.grad_accum_steps
        self.every = cfg.every_steps
        self.total = config.train.steps
        self.chief = chief
        self.best_metric = cfg.best_metric
        self.best_source = cfg.best_metric.partition("/")[0]
        self.store = CheckpointStore(workdir, cfg, cfg.best_metric) if self.enabled else None
        self._host_state: dict[str, dict[str, list[np.ndarray]]] = {}  # snapshot buffers
        self._saved: dict[str, int] = {}  # the last step saved to each kind by this run
        self.failures = SaveFailures(workdir)
        self.events = events
        self._reported: Any = None  # the restore last written as a resume record

    def next_boundary(self, step: int) -> float:
        return next_multiple(step, self.every if self.enabled else 0)

    def save(self, run: RunContext, kind: str = LATEST_DIR,
             metrics: dict[str, float] | None = None, wait: bool = False) -> None:
        """Saves the current state (chief writes; every worker announces a save of the
        latest state, so every callback's ``on_checkpoint`` runs).

        A step already saved to ``kind`` by this run is not saved again."""
        if self._saved.get(kind) == run.step:
            return
        if not checkpoint_state.all_finite(run):
            self.wait()  # a pending save of an earlier step is a good checkpoint
            raise NonFiniteError(
                f"The weights are NaN/inf at step {run.step}; no checkpoint was written "
                f"(the last good one is {inventory.describe_last_good(run.workdir)}). Set "
                f"train.on_nonfinite='skip' or 'rollback', lower optimizer.learning_rate, "
                f"or set optimizer.clipnorm.")
        self._saved[kind] = run.step
        written = True
        if self.chief:
            written = self._write(run, kind, metrics, wait)
        if kind == LATEST_DIR and written:
            run.announce_checkpoint(run.step)

    def _write(self, run: RunContext, kind: str, metrics: dict[str, float] | None,
               wait: bool) -> bool:
        """Writes the current state to ``kind`` (chief); False when a storage fault
        stopped it and training goes on (:meth:`_storage_fault`)."""
        self._commit_pending(kind)  # an async write may still read the buffers reused
        try:
            if self.store.has(kind, run.step):
                return True
            state, manifest = checkpoint_state.snapshot(run, self._host_state.get(kind))
            self._host_state[kind] = state
            self.store.save(kind, run.step, state, manifest, metrics, wait)
        except Exception as error:  # noqa: BLE001 - only storage faults are handled
            self._storage_fault(error, kind, run.step, final=wait)
            return False
        if wait:
            self.failures.succeeded()
        logging.info("checkpoint of step %d -> %s%s", run.step,
                     os.path.join(run.workdir, kind), "" if wait else " (async)")
        return True

    def _commit_pending(self, kind: str | None = None, final: bool = False) -> None:
        """Waits for the async writes of ``kind`` (default: all); one that failed on a
        storage fault is handled (:meth:`_storage_fault`)."""
        for name in [k for k in self.store.kinds() if kind in (None, k)]:
            step = self.store.pending(name)
            try:
                self.store.wait(name)
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
        self.store.discard(kind)
        self.failures.failed(error, os.path.join(self.store.workdir, kind), step, final)

    def wait(self) -> None:
        """Blocks until pending async saves are committed (chief; others return)."""
        if self.enabled and self.chief:
            self._commit_pending()

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
        """The final checkpoint when training stopped before ``train.steps``."""
        if not self.enabled:
            return
        if run.step < self.total:
            self.save(run, wait=True)
        host_collectives.barrier(run.strategy)  # no worker leaves before the save

    def _save_best(self, run: RunContext, logs: dict[str, float]) -> None:
        if self.best_metric not in logs:
            raise ConfigError(
                f"config.checkpoint.best_metric={self.best_metric!r} is not among the "
                f"{self.best_source} values ({', '.join(sorted(logs))}).")
        if run.step % self.k == 0:
            self.save(run, BEST_DIR, {self.best_metric: float(logs[self.best_metric])})

    def on_log(self, run: RunContext, logs: dict[str, float]) -> None:
        if self.enabled and self.best_source == "train":
            self._save_best(run, logs)

    def on_eval_end(self, run: RunContext, logs: dict[str, float]) -> None:
        if self.enabled and self.best_source == "eval":
            self._save_best(run, logs)

    def on_fit_end(self, run: RunContext, logs: dict[str, float]) -> None:
        if not self.enabled or not self.chief:
            return
        self._commit_pending(final=True)
        best = self.store.best_step()
        if best is not None and run.step >= self.total:
            self._export_best(run, best)
        self.store.close()
        self._host_state.clear()

    def _export_best(self, run: RunContext, step: int) -> None:
        """Exports the best step's model to ``workdir/export/best`` (chief)."""
        groups = checkpoint_state.state_variables(run)
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
        metrics = self.store.metrics(BEST_DIR, step)
        with tf.io.gfile.GFile(os.path.join(target, "best.json"), "w") as f:
            f.write(json.dumps({"step": step, **{k.partition("/")[2]: float(v)
                                                 for k, v in metrics.items()}}))
        logging.info("exported the best checkpoint (step %d, %s) to %s", step, metrics, target)
