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

Multi-worker: every worker takes part in a restore. With the local tier
(``checkpoint.local_every_steps``, :mod:`trainer.checkpoint.storage.local_tier`) every
worker names the newest local step it holds and the chief the workdir's newest committed
step; the newest wins (a local one at a tie: no bucket read), its holder reads it and
broadcasts it, so a host with an empty disk gets the state from a peer. Otherwise the
chief (``distribute.is_chief``) chooses the workdir's step. From a bucket, each worker
reads its share of the step's array files and the owner of each array sends it to the
others over TF collectives (:func:`_load_in_shares`,
:mod:`~trainer.checkpoint.storage.shares`); otherwise the chief reads the step and
broadcasts it (the other workers need no access to the chief's files).

Contexts: host, eager, cross-replica, between ``tf.function`` calls.
"""

from __future__ import annotations

import itertools
import os
import time

import numpy as np
from absl import logging

from trainer.checkpoint import inventory
from trainer.checkpoint import state as checkpoint_state
from trainer.checkpoint.state import CheckpointError
from trainer.checkpoint.storage import shares
from trainer.checkpoint.storage.local_tier import MARKER, LocalTier, local_dir, marked
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
    raise CheckpointError(_none_readable(workdir, step, reasons))


def _none_readable(workdir: str, step: int | None, reasons: list[str]) -> str:
    """The one line of a restore that found no readable checkpoint."""
    return (f"No readable checkpoint{'' if step is None else f' of step {step}'}: the last "
            f"good checkpoint is {inventory.describe_last_good(workdir)}. " + "; ".join(reasons)
            + ". The files are corrupt or incomplete: delete those step directories "
            "(training then resumes from an earlier one, or from scratch).")


def _load_in_shares(run: RunContext, steps: Steps, found: list, groups: dict,
                    step: int | None) -> tuple[dict, dict]:
    """(Every worker; a workdir in a bucket.) ``(state in groups' order, manifest)`` of
    the newest readable candidate the chief names, on every worker: for each, the chief
    sends its objects (its listing); a step of ``.npy`` array files is read in shares
    (each worker downloads its own and the small files, checks and reads them, and the
    owner of each array sends it: :func:`~trainer.distribution.host_collectives.gather_owned`),
    another is read by the chief and broadcast. A step any worker cannot read is
    skipped (as :func:`_load_first_readable`); none readable: :class:`CheckpointError`
    on every worker."""
    strategy, chief = run.strategy, host_collectives.is_chief(run.strategy)
    reasons: list[str] = []
    for attempt in itertools.count():
        plan = None
        if chief:
            plan = ({"error": _none_readable(run.workdir, step, reasons)}
                    if attempt == len(found) else {"path": found[attempt][1],
                                                   "names": steps.objects(found[attempt][1])})
            plan["split"] = shares.splittable(plan.get("names", {}))
        plan = host_collectives.json_from_chief(strategy, plan)
        if "error" in plan:
            raise CheckpointError(plan["error"])
        path = plan["path"]
        loaded, reason = (_read_shares(run, steps, plan, groups) if plan["split"]
                          else _read_by_chief(run, steps, path, groups))
        if loaded is not None:
            return loaded
        reasons.append(f"{path}: {reason}")
        if step is None and chief:
            logging.warning("Skipping checkpoint %s: %s; trying an earlier one.", path, reason)
    raise AssertionError("unreachable")  # itertools.count() never ends


def _read_by_chief(run: RunContext, steps: Steps, path: str, groups: dict
                   ) -> tuple[tuple[dict, dict] | None, str | None]:
    """The step ``path`` read by the chief and broadcast: ``((state, manifest), None)``
    on every worker, or ``(None, the chief's reason)``."""
    strategy, chief = run.strategy, host_collectives.is_chief(run.strategy)
    state, manifest, reason = None, None, None
    if chief:
        try:
            state, manifest = load(path, groups, steps)
        except Unreadable as error:
            reason = str(error)
    if not host_collectives.from_chief(strategy, int(reason is None)):
        return None, reason or "the chief could not read it; its log says why"
    return _broadcast(strategy, groups, state, manifest, None), None


def _read_shares(run: RunContext, steps: Steps, plan: dict, groups: dict
                 ) -> tuple[tuple[dict, dict] | None, str | None]:
    """The step of ``plan`` read in shares: ``((state, manifest), None)`` on every
    worker, or ``(None, why)`` when a worker could not read its share (each says its own
    reason in its log; the chief's reason names the workers)."""
    strategy = run.strategy
    rank, workers = host_collectives.worker_index(strategy), host_collectives.num_workers(strategy)
    path, names, arrays, manifest, reason = plan["path"], plan["names"], None, None, None
    try:
        with steps.readable(path, shares.wanted(names, workers, rank), names) as local:
            manifest = read_manifest(local)
            checkpoint_state.check_compatible(manifest, groups, f"checkpoint {path}")
            arrays, verified = shares.read_share(local, manifest, names, workers, rank)
        if not verified and host_collectives.is_chief(strategy):
            inventory.note_unverified(os.path.dirname(os.path.normpath(path)))
    except Unreadable as error:
        reason = str(error)
        logging.warning("This worker cannot read its share of checkpoint %s: %s", path, reason)
    failed = [w for w, no in enumerate(host_collectives.gather_ints(
        strategy, int(reason is not None))) if no]
    if failed:
        return None, reason or (f"worker(s) {', '.join(map(str, failed))} could not read "
                                f"their share (their logs say why)")
    entries = manifest["groups"]
    flat = host_collectives.gather_owned(
        strategy, arrays, [(shape, dtype) for e in entries.values() for _, shape, dtype in e])
    saved = _grouped(flat, {g: len(e) for g, e in entries.items()})
    return (checkpoint_state.in_trainer_order(groups, manifest, saved), manifest), None


def _grouped(flat: list[np.ndarray], counts: dict[str, int]) -> dict[str, list[np.ndarray]]:
    """``flat`` cut into ``{group: arrays}`` of ``counts`` arrays each, in order."""
    state, i = {}, 0
    for group, count in counts.items():
        state[group], i = flat[i:i + count], i + count
    return state


def restore(run: RunContext, step: int | None = None) -> int | None:
    """Restores the latest (or the given) checkpoint in ``run.workdir``.

    Builds the model and optimizer variables if need be (``run.ensure_built``). Sets the
    variables, and the step and input resume position (``run.resumed``); returns the
    step, or None when there is no checkpoint (``step=None`` only). Call it on every
    worker: one reads (the holder of the newest local step: :func:`_restore_local`, or
    the chief from the workdir; from a bucket, every worker its share), the others
    receive the state over collectives. Raises
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
    tiered = step is None and bool(run.config.checkpoint.local_every_steps)  # same everywhere
    local = _local_steps(run) if tiered else []
    offers = _offers(strategy, local) if tiered else [_NONE]
    if newest == _NONE and max(offers) == _NONE:
        return None
    run.ensure_built()  # the variables a checkpoint fills must exist
    groups = checkpoint_state.state_variables(run, optional=True)
    state, manifest, source = _restore_local(run, groups, local, offers, newest)
    if source is None and multi and steps.staged:  # every worker reads its share
        state, manifest = _load_in_shares(run, steps, found, groups, step)
    else:
        if source is None:
            state, manifest = _restore_durable(run, groups, steps, found, step)
        if multi:
            state, manifest = _broadcast(strategy, groups, state, manifest, source)
    restored, words = manifest["step"], _input_words(manifest)
    workers = host_collectives.num_workers(strategy)
    resumed = data_resume.Resumed(restored, int(words[0]), workers,
                                  data_resume.InputLayout.from_words(words[1:]),
                                  manifest.get("plan") if chief else None,
                                  manifest.get("services", {}), time.monotonic() - started)
    checkpoint_state.assign(groups, state)
    run.resumed(resumed)  # the step, and the input layout the train input continues
    if chief:
        _warn_on_input_changes(run.config, manifest)
    logging.info("resumed from step %d (%s), written by %d worker(s), continued on %d",
                 restored, f"worker {source}'s local checkpoint" if source is not None
                 else run.workdir if chief or steps.staged
                 else "the chief's checkpoint, broadcast",
                 resumed.from_workers, workers)
    return restored


def _local_steps(run: RunContext) -> list[tuple[int, str]]:
    """This worker's committed local steps, newest first. None when the workdir is not
    marked (the chief looks: :func:`~trainer.checkpoint.storage.local_tier.marked`):
    its local steps are then another run's, of a workdir deleted and made afresh at the
    same path; they are removed with one line (restored, they would continue a run the
    user threw away)."""
    cfg = run.config.checkpoint
    worker = host_collectives.worker_index(run.strategy)
    tier = LocalTier(local_dir(run.workdir, worker, cfg.local_dir), cfg)
    chief = host_collectives.is_chief(run.strategy)
    if host_collectives.from_chief(run.strategy, int(chief and marked(run.workdir))):
        return tier.candidates()
    if tier.candidates():
        logging.info("Removing the local checkpoints in %s: the workdir %s was made afresh "
                     "(it does not hold %s), so they are another run's.", tier.directory,
                     run.workdir, MARKER)
        tier.remove()
    return []


def _offers(strategy, local: list[tuple[int, str]]) -> list[int]:
    """Every worker's newest local step not yet tried, by worker index (-1: none)."""
    return host_collectives.gather_ints(strategy, local[0][0] if local else _NONE)


def _restore_local(run: RunContext, groups: dict, local: list[tuple[int, str]],
                   offers: list[int], newest: int) -> tuple[dict | None, dict | None,
                                                            int | None]:
    """The newest local step any worker holds, when it is at least the workdir's
    ``newest`` (a tie reads no bucket): its holder (the lowest worker index among
    equals) reads and checks it; one that does not load is skipped with one warning
    and the next newest (another worker's, or this one's older step) is tried, until the
    workdir's step is newer. Returns ``(state, manifest, holder)`` (state and manifest
    on the holder only; the others' None), or ``(None, None, None)``: the workdir's
    step serves. Exact on another worker count too: every worker's input position is
    the step, and the input layout is in the manifest, as in the workdir's save."""
    me = host_collectives.worker_index(run.strategy)
    while max(offers) != _NONE and max(offers) >= newest:
        source = offers.index(max(offers))
        state, manifest = None, None
        if me == source:
            _, path = local.pop(0)
            try:
                state, manifest = load(path, groups)
            except (Unreadable, CheckpointError) as error:
                logging.warning("Skipping the local checkpoint %s: %s; trying an older one "
                                "(a peer's, this worker's or the workdir's).", path, error)
        if host_collectives.gather_ints(run.strategy, int(manifest is not None))[source]:
            return state, manifest, source
        offers = _offers(run.strategy, local)
    return None, None, None


def _restore_durable(run: RunContext, groups: dict, steps: Steps, found: list,
                     step: int | None) -> tuple[dict | None, dict | None]:
    """The chief reads the newest readable workdir step (others: ``(None, None)``);
    every worker learns whether it could, and raises its error if not."""
    state, manifest, failure = None, None, None
    if host_collectives.is_chief(run.strategy):
        try:
            state, manifest = _load_first_readable(steps, run.workdir, found, groups, step)
        except CheckpointError as error:
            failure = error
    status = host_collectives.from_chief(run.strategy, manifest["step"] if manifest else _FAILED)
    if status == _FAILED:
        raise failure or CheckpointError(_CHIEF_FAILED)
    return state, manifest


def _broadcast(strategy, groups: dict, state: dict | None, manifest: dict | None,
               source: int | None) -> tuple[dict, dict]:
    """``source``'s ``(state, manifest)`` (None: the chief's) on every worker: the state
    by group, the manifest without its variable list (the groups say it)."""
    flat = host_collectives.broadcast_arrays(
        strategy, [a for g in groups for a in state[g]] if state is not None else None,
        checkpoint_state.like(groups), source)
    manifest = host_collectives.json_from_chief(
        strategy, {k: v for k, v in manifest.items() if k != "groups"} if manifest else None,
        source)
    return _grouped(flat, {g: len(e) for g, e in groups.items()}), manifest


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
