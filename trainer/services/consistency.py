"""The replica-consistency sentinel: ``distribute.consistency_check`` (a service).

Every replica and every worker must hold the same weights, optimizer state and model
state; user code can break it without a word (an integer counter of data-dependent
values, a weight assigned in the step, a step with ``manual_optimization`` that applies
unreduced gradients). This service compares the copies
(:class:`trainer.distribution.replica_check.ReplicaCheck`: one fingerprint per copy,
computed on its device) and ends a run whose copies differ with one
:class:`trainer.errors.ReplicaDivergenceError` line naming the variable, the step, the
likely cause and the fix.

When (``"auto"``): after the first train loop of every ``fit()`` (``steps_per_loop``
steps, or fewer when a boundary comes first; no extra boundary is asked for, so the
loops and callbacks run as without the check), at every loop end on a
``checkpoint.every_steps`` multiple and when training ends, before the checkpoint is
saved, so a diverged state is never saved as good; ``"every_loop"``: at every loop end; ``"off"``: never. On one replica of one
worker there is nothing to compare. On TPU the copies live in the cores' memory and are
not read back: the check is skipped there (one log line).
"""

from __future__ import annotations

import time

import tensorflow as tf
from absl import logging

from trainer.distribution import host_collectives
from trainer.distribution.replica_check import Disagreement, ReplicaCheck
from trainer.errors import ReplicaDivergenceError
from trainer.run_context import RunContext, Service


def _cause(run: RunContext, found: Disagreement) -> str:
    """The likely cause and the fix, by what the variable is."""
    ids = lambda variables: {id(v) for v in variables}  # noqa: E731
    if id(found.variable) in ids([*run.model.trainable_variables,
                                  *(v for _, v in run.owned_variables())]):
        return ("a weight changed outside self.apply_gradients (an assign in the step, or a "
                "step with manual_optimization whose gradients were not all-reduced). "
                "Update weights through self.apply_gradients")
    if id(found.variable) in ids(run.model.non_trainable_variables):
        return ("state the forward pass updates differently on each replica that the "
                "framework does not average (integer state such as a count of examples or "
                "of data-dependent events, or a weight created with its own aggregation). "
                "Update it the same way on every replica (count steps, not examples), or "
                "make it a float weight with Keras' default aggregation (averaged)")
    return ("the optimizer applied different updates on different replicas (a step with "
            "manual_optimization whose gradients were not all-reduced). Update through "
            "self.apply_gradients")


class ConsistencyCheck(Service):
    """Compares every replica's and worker's copies at the boundaries the module says."""

    def __init__(self, config):
        self.mode = config.distribute.consistency_check
        self.every = config.checkpoint.every_steps
        self._check: ReplicaCheck | None = None
        self._first_loop = False  # the next loop end is this fit()'s first
        self._checked_step = -1
        self.seconds = 0.0  # host seconds spent checking in this process

    def _applies(self, run: RunContext) -> bool:
        if self.mode == "off":
            return False
        if isinstance(run.strategy, tf.distribute.TPUStrategy):
            return False
        return (run.strategy.num_replicas_in_sync > 1
                or host_collectives.num_workers(run.strategy) > 1)

    def on_fit_start(self, run: RunContext) -> None:
        if self.mode != "off" and isinstance(run.strategy, tf.distribute.TPUStrategy):
            logging.info("distribute.consistency_check: skipped on TPU (the copies live "
                         "in the cores' memory).")
        self._first_loop = True

    def on_loop_end(self, run: RunContext) -> None:
        step = run.step
        due = (self.mode == "every_loop" or self._first_loop
               or (self.every > 0 and step % self.every == 0))
        self._first_loop = False
        if due and self._applies(run):
            self.check(run)

    def on_train_end(self, run: RunContext) -> None:
        if self._applies(run):
            self.check(run)

    def check(self, run: RunContext) -> None:
        """Compares the copies now (every worker at the same point); raises on the first
        variable that differs."""
        if run.step == self._checked_step:
            return
        start = time.perf_counter()
        if self._check is None:
            variables = [*run.model.variables, *(v for _, v in run.owned_variables()),
                         *run.optimizer.variables]
            if run.ema is not None:
                variables += list(run.ema.variables)
            self._check = ReplicaCheck(run.strategy, variables)
        found = self._check.disagreements()
        self.seconds += time.perf_counter() - start
        self._checked_step = run.step
        if found:
            first = found[0]
            raise ReplicaDivergenceError(
                f"variable '{first.name}' differs between replicas at step {run.step} "
                f"({first.where}: max |difference| {first.max_abs_diff:.3g}"
                f"{f'; {len(found) - 1} more variable(s) differ' if len(found) > 1 else ''}). "
                f"Likely cause: {_cause(run, first)}. (distribute.consistency_check='off' "
                f"skips this check.)")
        logging.info("replica consistency: %d variables agree on %d replica(s) of %d "
                     "worker(s) at step %d (%.1f ms)", len(self._check.variables),
                     run.strategy.num_replicas_in_sync,
                     host_collectives.num_workers(run.strategy), run.step,
                     1e3 * (time.perf_counter() - start))
