"""Preemption: SIGTERM during ``fit()`` becomes a checkpoint and a retryable exit.

:class:`PreemptionWatcher` (a Callback) installs a SIGTERM handler for the duration of
``fit()``. The handler only sets a flag on the loop driver; at the next loop boundary
every worker agrees on it (the driver's stop all-reduce), the final checkpoint is saved
synchronously (``on_train_end``), all workers pass a barrier and ``fit()`` raises
:class:`Preempted`. ``trainer.main`` then exits with :data:`EXIT_PREEMPTED` = 143
(128 + SIGTERM, what a process killed by SIGTERM reports), which schedulers treat as
retryable: Kubeflow's ``restartPolicy: ExitCode`` retries 128-255, Slurm requeues, and
``launch.multiworker --max_restarts`` restarts without counting. A restart resumes.

TF's ``PreemptionCheckpointHandler`` is not used: it is bound to ``tf.train.Checkpoint``
and does not initialise on CPU or GCP TPU; this signal path works on every strategy.
A second SIGTERM kills at once (the default handler is back after the first).
"""

from __future__ import annotations

import signal
from typing import Any

from absl import logging

from tf_cluster.exit_codes import EXIT_PREEMPTED  # trainer.main's exit code after a preemption save
from trainer.callbacks import Callback


class Preempted(RuntimeError):
    """Raised by ``fit()`` after SIGTERM once the state at ``step`` is saved."""

    def __init__(self, step: int):
        super().__init__(f"preempted at step {step}; a checkpoint of that step was saved. "
                         f"Restart the same command to resume.")
        self.step = step


class PreemptionWatcher(Callback):
    """Turns SIGTERM into ``trainer.driver.request_preemption()`` during ``fit()``.

    Inactive without a workdir (nothing could be saved) and outside the main thread
    (Python delivers signals there only).
    """

    def __init__(self):
        self._previous: Any = None
        self._installed = False

    def on_fit_start(self, trainer: Any) -> None:
        if trainer.workdir is None:
            return
        driver = trainer.driver

        def on_sigterm(signum, frame) -> None:
            driver.request_preemption()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
            logging.warning("SIGTERM: saving a checkpoint at the next loop boundary, then "
                            "exiting with code %d.", EXIT_PREEMPTED)

        try:
            self._previous = signal.signal(signal.SIGTERM, on_sigterm)
            self._installed = True
        except ValueError:  # not the main thread: preemption stays the caller's business
            logging.info("fit() runs outside the main thread: SIGTERM is not handled.")

    def on_fit_end(self, trainer: Any, logs: dict[str, float]) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            self._installed = False
