"""Orbax's and JAX's log noise, kept off the run's output.

Orbax logs a dozen INFO lines per save, and reports each write a full, read-only or
vanished disk failed (with a traceback, from several threads); the checkpoint service
says such a failure in one line (:class:`trainer.errors.StorageError`). :func:`quiet`
installs the filter (:class:`QuietOrbax`) on absl's handler and logger, and drops
orbax's closed-event-loop echoes of a failed read. Contexts: host; idempotent.
"""

from __future__ import annotations

import logging as pylogging
import os
import sys
import traceback

from absl import logging

from trainer.errors import storage_fault


def quiet() -> None:
    """Installs the filters once per process (orbax logs through absl, JAX through
    logging)."""
    handler = logging.get_absl_handler()
    if not any(isinstance(f, QuietOrbax) for f in handler.filters):
        handler.addFilter(QuietOrbax())
        # Also on the absl logger: without absl's app.run, another handler prints it.
        pylogging.getLogger("absl").addFilter(QuietOrbax())
        sys.unraisablehook = without_closed_loop_noise(sys.unraisablehook)


def without_closed_loop_noise(previous):
    """An unraisable-exception hook that drops orbax's closed-event-loop echoes.

    When one array of a checkpoint cannot be read, orbax closes its asyncio loop while
    tensorstore still completes the other reads; each completion then reports
    "RuntimeError: Event loop is closed" with a traceback. The read error itself is
    raised (and reported) normally; only these echoes are dropped.
    """

    def hook(unraisable) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        previous(unraisable)

    return hook


class QuietOrbax(pylogging.Filter):
    """Drops orbax's and JAX's INFO lines (a dozen per save), orbax's warning that a
    save holds no OCDBT data to merge (``.npy`` leaves), its reports of a write that
    failed on a full, read-only or vanished disk and its warning that the metadata of
    an unfinished save (a temporary step directory) is missing (the checkpoint service
    says it in one line: :class:`trainer.errors.StorageError`), and asyncio's "Task
    exception was never retrieved" for orbax's other reads of a step that failed to read
    (the read error is raised and reported; which sibling reads are left unretrieved,
    and whether through orbax's code or a bare tensorstore future, depends on timing), and the timeouts of orbax's writer threads still waiting for the
    directory of a save that failed to make it (a vanished workdir: the save's failure
    is reported); other warnings and errors pass."""

    _SOURCES = (f"{os.sep}orbax{os.sep}", f"{os.sep}jax{os.sep}")
    _EXPECTED = "Skipping merge of OCDBT checkpoints: No per-process OCDBT"
    _UNFINISHED = ("Metadata file does not exist: ", ".orbax-checkpoint-tmp")
    _NO_DIRECTORY = ("Timeout waiting for key", "directory_creation")

    def filter(self, record: pylogging.LogRecord) -> bool:
        path = record.pathname or ""
        if record.name == "asyncio" and record.exc_info and record.getMessage().startswith(
                "Task exception was never retrieved"):
            return not orbax_read(record.exc_info)
        if not any(s in path for s in self._SOURCES):
            return True
        if storage_fault_record(record):
            return False  # the checkpoint service reports it, in one line
        message = record.getMessage()
        if message.startswith(self._UNFINISHED[0]) and self._UNFINISHED[1] in message:
            return False  # a save cut short: reported by the checkpoint service
        if all(part in message for part in self._NO_DIRECTORY):
            return False  # waited for a directory a failed save never made
        return record.levelno >= pylogging.WARNING and self._EXPECTED not in message


def orbax_read(exc_info) -> bool:
    """Whether an exception left in an asyncio task came from one of orbax's reads:
    raised in orbax's code, or by a tensorstore future orbax awaited directly (then the
    traceback holds only asyncio's frames, and tensorstore's error names its spec)."""
    frames = traceback.extract_tb(exc_info[2])
    return (any(s in f.filename for f in frames for s in QuietOrbax._SOURCES)
            or "tensorstore_spec=" in str(exc_info[1]))


def storage_fault_record(record: pylogging.LogRecord) -> bool:
    """Whether orbax's log record reports a failed write of a full / read-only ... disk
    (it logs each with a traceback, from several threads)."""
    error = record.exc_info[1] if record.exc_info else None
    return bool((error is not None and storage_fault(error))
                or storage_fault(Exception(record.getMessage())))
