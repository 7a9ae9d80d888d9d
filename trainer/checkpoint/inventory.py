"""What a workdir's checkpoints are worth: complete (verified), incomplete, corrupt.

:func:`survey` lists every step directory of ``checkpoints/`` and ``checkpoints_best/``
(committed or not) with its state; :func:`last_good` finds the newest committed step
that verifies, the one every message about "the last good checkpoint" names
(:func:`describe_last_good`), whichever process wrote it.

A committed step is *complete* when its files match the checksums written with them
(:func:`trainer.checkpoint.storage.reader.verify`) and its manifest reads; one written before
checksums existed is complete when its manifest reads ("no checksums"). *Corrupt*: a
file missing, truncated or changed, or an unreadable manifest. *Incomplete*: a save
that did not finish (orbax's temporary directory), never read.

Contexts: host only (reads files; every call re-reads them).
"""

from __future__ import annotations

import dataclasses
import functools

from absl import logging

from trainer.checkpoint.storage import reader
from trainer.checkpoint.storage.steps import readable, steps_for

COMPLETE, INCOMPLETE, CORRUPT = "complete", "incomplete", "corrupt"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One step directory: its ``step``, ``path``, ``state`` (:data:`COMPLETE`,
    :data:`INCOMPLETE` or :data:`CORRUPT`) and ``detail`` (what was found)."""

    step: int
    path: str
    state: str
    detail: str


def check(step: int, path: str) -> Entry:
    """The state of the committed step directory ``path`` (in a bucket: downloaded in
    parallel, then checked locally)."""
    try:
        with readable(path) as local:
            verified = reader.verify(local)
            reader.read_manifest(local)
    except reader.Unreadable as error:
        return Entry(step, path, CORRUPT, str(error))
    return Entry(step, path, COMPLETE,
                 "checksums match" if verified else "no checksums (an earlier version)")


def survey(workdir: str) -> list[Entry]:
    """Every step directory of ``workdir`` with its state, newest first (a committed
    step before a save of the same step that did not finish)."""
    steps = steps_for(workdir)
    entries = [check(step, path) for step, path in steps.candidates(False)]
    entries += [Entry(step, path, INCOMPLETE, "a save that did not finish (never read)")
                for step, path in steps.incomplete()]
    return sorted(entries, key=lambda e: (-e.step, e.state == INCOMPLETE))


def last_good(workdir: str | None) -> Entry | None:
    """The newest complete step of ``workdir`` (None: none, or no workdir)."""
    if workdir is None:
        return None
    for step, path in steps_for(workdir).candidates(warn_incomplete=False):
        entry = check(step, path)
        if entry.state == COMPLETE:
            return entry
    return None


def describe_last_good(workdir: str | None) -> str:
    """``"step 200 (/w/checkpoints/200)"``, or why there is none, for a message."""
    if workdir is None:
        return "none (no workdir)"
    try:
        entry = last_good(workdir)
    except Exception as error:  # noqa: BLE001 - only a part of a message about another failure
        return f"unknown ({type(error).__name__}: {error})"
    return (f"step {entry.step} ({entry.path})" if entry
            else f"none (no complete checkpoint in {workdir})")


@functools.cache
def note_unverified(directory: str) -> None:
    """Says once per checkpoint directory that a step without checksums was restored."""
    logging.warning("Checkpoints in %s have no checksums (written by an earlier version): "
                    "restored without verifying their files; new saves have them.", directory)
