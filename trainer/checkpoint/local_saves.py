"""When the local tier saves: every ``checkpoint.local_every_steps`` steps, on every worker.

:class:`LocalSaves` is the service of :mod:`trainer.checkpoint.storage.local_tier` (what
a local step holds and where it goes): it ends a train loop at each multiple of
``checkpoint.local_every_steps`` and writes this worker's copy of the state there, after
the checkpoint service's save of the same boundary (a restart at a step both hold then
reads no bucket). Before a run's first local save the chief marks the workdir
(:func:`~trainer.checkpoint.storage.local_tier.mark`). Which copy a restart restores is :mod:`trainer.checkpoint.resume`'s.
Inactive without a workdir or with ``local_every_steps`` 0. Contexts: host, every worker.
"""

from __future__ import annotations

import time

import numpy as np
from absl import logging

from trainer.checkpoint import state as checkpoint_state
from trainer.checkpoint.storage import local_tier
from trainer.checkpoint.storage.local_tier import LocalTier, local_dir
from trainer.distribution import host_collectives
from trainer.run_context import RunContext, Service, next_multiple


class LocalSaves(Service):
    """Saves this worker's copy of the state to its local tier (see the module doc).

    ``blocking_s``: the seconds the loop waited for local saves so far (the host copy,
    and the previous local write's commit); goodput counts them as checkpoint saves.
    """

    def __init__(self, config, workdir: str | None, chief: bool):
        self.every = config.checkpoint.local_every_steps if workdir is not None else 0
        self.chief = chief
        self.total = config.train.steps
        self.blocking_s = 0.0
        self._tier: LocalTier | None = None  # made at the first local save
        self._buffers: dict[str, list[np.ndarray]] | None = None  # snapshot buffers

    def next_boundary(self, step: int) -> float:
        return next_multiple(step, self.every)

    def on_loop_end(self, run: RunContext) -> None:
        if self.every and run.step % self.every == 0 and run.step < self.total:
            self.save(run)

    def save(self, run: RunContext) -> None:
        """Writes this worker's copy of the state to the local tier, once its previous
        local write is committed (waited for: a lost host then costs at most
        ``local_every_steps`` steps); its time is added to :attr:`blocking_s`. Skipped,
        with one info line, when the weights are not finite (the workdir's save says so)."""
        started = time.monotonic()
        if self._tier is None:
            if self.chief:  # before any worker's local step of this run (see mark)
                local_tier.mark(run.workdir)
            self._tier = _tier_of(run)
        self._tier.wait()
        if checkpoint_state.all_finite(run):
            self._buffers, manifest = checkpoint_state.snapshot(run, self._buffers)
            self._tier.save(run.step, self._buffers, manifest)
        else:
            logging.info("local checkpoint of step %d skipped: the weights are not finite.",
                         run.step)
        self.blocking_s += time.monotonic() - started

    def on_fit_end(self, run: RunContext, logs: dict[str, float]) -> None:
        """Commits the last local write; a run that reached ``train.steps`` (its final
        save is the workdir's) removes this worker's local steps: nothing is left behind
        on the local disk."""
        if not self.every:
            return
        tier = self._tier or _tier_of(run)
        tier.close()
        if run.step >= self.total:
            tier.remove()
        self._tier, self._buffers = None, None


def _tier_of(run: RunContext) -> LocalTier:
    """This worker's local tier (its directory keyed by the workdir and the worker)."""
    cfg = run.config.checkpoint
    return LocalTier(local_dir(run.workdir, host_collectives.worker_index(run.strategy),
                               cfg.local_dir), cfg)
