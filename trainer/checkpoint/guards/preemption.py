"""Preemption: SIGTERM (or SIGINT) during ``fit()`` becomes a checkpoint and a retryable exit.

:class:`PreemptionWatcher` (a service) registers a stop callback with
:mod:`trainer.runtime.signals` for the duration of ``fit()``. It only sets a flag
(``run.request_preemption()``; an eval pass in progress is abandoned within seconds); at
the next loop boundary
every worker agrees on it (the driver's stop all-reduce), the stop's checkpoint is saved
synchronously (:mod:`trainer.checkpoint.stop_save`, in ``on_train_end``), every worker
learns its outcome and ``fit()`` raises :class:`Preempted`. ``trainer.main`` then exits with :data:`EXIT_PREEMPTED` = 143
(128 + SIGTERM, what a process killed by SIGTERM reports), which schedulers treat as
retryable: Kubeflow's ``restartPolicy: ExitCode`` retries 128-255, Slurm requeues, and
``launch.multiworker --max_restarts`` restarts without counting. A restart resumes.

TF's ``PreemptionCheckpointHandler`` is not used: it is bound to ``tf.train.Checkpoint``
and does not initialise on CPU or GCP TPU; this signal path works on every strategy.
A second signal exits at once (:mod:`trainer.runtime.signals`).
"""

from __future__ import annotations

import signal

from absl import logging

from tf_cluster.exit_codes import EXIT_PREEMPTED  # trainer.main's exit code after a preemption save
from trainer.errors import Preempted
from trainer.run_context import RunContext, Service
from trainer.runtime import signals

__all__ = ["EXIT_PREEMPTED", "Preempted", "PreemptionWatcher"]


class PreemptionWatcher(Service):
    """Turns SIGTERM/SIGINT into ``run.request_preemption()`` during ``fit()``.

    Through :mod:`trainer.runtime.signals` (installed here for the duration of ``fit()`` unless
    the command line already did): the signal is seen even while the main thread is
    blocked in TensorFlow. Inactive without a workdir (nothing could be saved: the
    command line's default, exiting at once, applies) and outside the main thread
    (Python delivers signals there only).
    """

    def __init__(self):
        self._installed_here = False
        self._active = False

    def on_fit_start(self, run: RunContext) -> None:
        if run.workdir is None:
            return

        def on_signal(signum: int) -> None:
            run.request_preemption()
            logging.warning("%s: saving a checkpoint at the next loop boundary (an eval pass "
                            "in progress is abandoned), then fit() raises Preempted (the "
                            "command line exits with code %d); a second signal exits at "
                            "once.", signal.Signals(signum).name, EXIT_PREEMPTED)

        try:
            self._installed_here = signals.install()
        except ValueError:  # not the main thread: preemption stays the caller's business
            logging.info("fit() runs outside the main thread: SIGTERM is not handled.")
            return
        signals.set_stop_callback(on_signal)
        self._active = True

    def on_fit_end(self, run: RunContext, logs: dict[str, float]) -> None:
        if not self._active:
            return
        signals.set_stop_callback(None)
        if self._installed_here:
            signals.uninstall()
        self._active, self._installed_here = False, False
