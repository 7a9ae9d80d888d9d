"""What a run does when a checkpoint cannot be written: warn and retry, then stop.

A save that fails on a storage fault (:func:`trainer.errors.storage_fault`: a full
disk, a quota, a read-only or vanished workdir) is no bug and loses nothing already
saved. The first failure is one warning line and training goes on: the next save
retries. The :data:`MAX_FAILED_SAVES`-th failure in a row, or a failure of the run's
last save (no next save would retry it), raises :class:`trainer.errors.StorageError`:
one line naming the directory, the step not saved and the last good checkpoint (the
newest on disk that verifies, :func:`trainer.checkpoint.inventory.describe_last_good`).

Contexts: host only (the chief's checkpoint service).
"""

from __future__ import annotations

from absl import logging

from trainer.checkpoint import inventory
from trainer.errors import StorageError, storage_fault, storage_fault_fix

MAX_FAILED_SAVES = 2  # saves failed in a row before the run stops


class SaveFailures:
    """Counts the saves of one run that failed in a row; warns or raises.

    Args:
      workdir: the run's directory (where the last good checkpoint is looked for).
    """

    def __init__(self, workdir: str | None):
        self.workdir = workdir
        self.in_a_row = 0

    def succeeded(self) -> None:
        """A save was committed: the count starts again."""
        self.in_a_row = 0

    def failed(self, error: BaseException, directory: str, step: int | None,
               final: bool) -> None:
        """The save of ``step`` to ``directory`` failed with ``error`` (a storage fault).
        Raises :class:`StorageError` when ``final`` or at :data:`MAX_FAILED_SAVES` in a
        row; else logs one warning."""
        self.in_a_row += 1
        last_good = inventory.describe_last_good(self.workdir)
        what = (f"cannot write the checkpoint of step {step} to {directory}: "
                f"{storage_fault(error)}; the last good checkpoint is {last_good}")
        if final or self.in_a_row >= MAX_FAILED_SAVES:
            resumes = ("starts from step 0" if last_good.startswith("none")
                       else "resumes from that checkpoint")
            raise StorageError(
                f"{what} ({self.in_a_row} failed save(s) in a row). "
                f"{storage_fault_fix(error)}, then run the same command again: it "
                f"{resumes}.") from error
        logging.warning("Storage error (training goes on; the next save retries, the run "
                        "stops if it fails too): %s.", what)
