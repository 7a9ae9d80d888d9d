"""Resume: reading a workdir's newest good checkpoint back into a Trainer's variables.

:func:`restore` restores the step BEFORE the train dataset is built, and the dataset
skips the consumed batches in every input pipeline; exact for a deterministic pipeline
(``train.deterministic``, seeded shuffles), and a warning says when it cannot hold;
also on another number of workers (the input follows the checkpoint's input layout,
:mod:`trainer.data.resume`). Every restore logs the worker counts of both runs, and the
next ``fit()`` writes a ``"resume"`` record. When resuming (``step=None``) a committed
step that cannot be read is skipped with a warning and the previous one is tried.

A restore checks a step's files against their checksums (:func:`load`; a damaged step
is skipped like an unreadable one).

Multi-worker: only the chief (``distribute.is_chief``) reads; every worker takes part
in a restore, which the chief performs and broadcasts to the others over TF
collectives (the other workers need no access to the chief's files).

Contexts: host, eager, cross-replica, between ``tf.function`` calls.
"""

from __future__ import annotations

import os
import time

import numpy as np
from absl import logging

from trainer.checkpoint import inventory
from trainer.checkpoint import state as checkpoint_state
from trainer.checkpoint.state import CheckpointError
from trainer.checkpoint.storage.reader import Unreadable
from trainer.checkpoint.storage.reader import read_manifest, read_state, verify
from trainer.checkpoint.storage.steps import Steps, readable, steps_for
from trainer.data import resume as data_resume
from trainer.distribution import host_collectives
from trainer.run_context import RunContext

_NONE, _FAILED = -1, -2
_CHIEF_FAILED = "The chief could not restore the checkpoint; its log has the reason."

def load(path: str, groups: checkpoint_state.Groups, steps: Steps | None = None
         ) -> tuple[dict, dict]:
    """Reads and checks one step directory (chief): ``(state in groups' order, manifest)``.

    A step in a bucket is first copied to a local directory (one listing, the objects
    in parallel: :func:`~trainer.checkpoint.storage.steps.readable`), so the restore costs a
    few round trips plus its bytes. Then its files are checked against their checksums
    (:class:`Unreadable` naming the file; none: an earlier version, said once); the ``.npy`` array files by the CRC of
    the bytes just read, the others read again. A failed read, or a manifest that does
    not fit, is :class:`Unreadable` when a file does not match (naming both)."""
    with (steps.readable(path) if steps else readable(path)) as local:  # read here
        try:
            manifest = read_manifest(local)
            checkpoint_state.check_compatible(manifest, groups, f"checkpoint {path}")
            state, known = read_state(local, manifest)
        except (Unreadable, CheckpointError) as error:
            try:
                verify(local)
            except Unreadable as damaged:
                raise Unreadable(f"{error}; {damaged}" if isinstance(error, Unreadable)
                                 else str(damaged)) from error
            raise
        if not verify(local, known):
            inventory.note_unverified(os.path.dirname(os.path.normpath(path)))
    return checkpoint_state.in_trainer_order(groups, manifest, state), manifest


def _select(steps: Steps, workdir: str, step: int | None) -> list[tuple[int, str]]:
    """The step directories to try, newest first (only ``step``'s when given: then a
    save in progress of another step is no reason for a warning)."""
    found = steps.candidates(warn_incomplete=step is None)
    if step is None:
        return found
    chosen = [c for c in found if c[0] == step]
    if not chosen:
        available = sorted({s for s, _ in found})
        raise CheckpointError(f"There is no checkpoint of step {step} in {workdir} "
                              f"(available: {available or 'none'}).")
    return chosen


def _load_first_readable(steps: Steps, workdir: str, found: list, groups: dict,
                         step: int | None) -> tuple[dict, dict]:
    """Loads the newest readable candidate; with ``step`` given, only that step. When
    none loads, :class:`CheckpointError` in one line: the last good checkpoint
    (:func:`~trainer.checkpoint.inventory.describe_last_good`), then each step's reason."""
    reasons = []
    for _, path in found:
        try:
            return load(path, groups, steps)
        except Unreadable as error:
            reasons.append(f"{path}: {error}")
            if step is None:
                logging.warning("Skipping checkpoint %s: %s; trying an earlier one.", path, error)
    raise CheckpointError(
        f"No readable checkpoint{'' if step is None else f' of step {step}'}: the last good "
        f"checkpoint is {inventory.describe_last_good(workdir)}. " + "; ".join(reasons)
        + ". The files are corrupt or incomplete: delete those step directories (training "
        "then resumes from an earlier one, or from scratch).")


def restore(run: RunContext, step: int | None = None) -> int | None:
    """Restores the latest (or the given) checkpoint in ``run.workdir``.

    Builds the model and optimizer variables if need be (``run.ensure_built``). Sets the
    variables, and the step and input resume position (``run.resumed``); returns the
    step, or None when there is no checkpoint (``step=None`` only). Call it on every
    worker: the chief reads, the others receive the state over collectives. Raises
    :class:`CheckpointError` (naming the variable) when a checkpoint is missing,
    unreadable or does not fit the model.
    """
    started = time.monotonic()
    strategy = run.strategy
    multi = host_collectives.num_workers(strategy) > 1
    chief = host_collectives.is_chief(strategy)
    if run.workdir is None:
        if step is not None:
            raise CheckpointError(f"restore(step={step}) needs a workdir; this Trainer has none.")
        return None
    found, failure, newest = [], None, _NONE
    steps = steps_for(run.workdir)  # listed once: a step in a bucket is read by that listing
    if chief:
        try:
            found = _select(steps, run.workdir, step)
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
    groups = checkpoint_state.state_variables(run, optional=True)
    state, manifest, failure = None, None, None
    if chief:
        try:
            state, manifest = _load_first_readable(steps, run.workdir, found, groups, step)
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
                                  manifest.get("plan") if chief else None, services,
                                  time.monotonic() - started)
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
