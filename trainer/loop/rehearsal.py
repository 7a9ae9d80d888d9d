"""The execution plan's measurement on a copy of the run: :class:`Snapshot` and
:func:`rehearse`.

With ``perf.plan="auto"`` the planner (:mod:`trainer.loop.plan`) times candidate plans
on real training steps, and plans may draw other random numbers from the same seed (XLA
and TensorFlow's kernels give other dropout masks) or sum floats in another order. So
the loop driver snapshots the state before the planner's first call; when that call
leaves the planner undecided (the run may be long enough to measure), the timed call
and the trials that follow are a rehearsal: no callback sees them, and afterwards every
variable the run's numbers depend on is put back (the checkpoint's state: model, Keras
``SeedGenerator`` states, optimizers, EMA, the Trainer's own variables, step counter,
loss scale; the driver also empties the train metrics, the gradient-norm window and the
accumulation sums, empty at a fit's start) and the input is built again at the fit's
step, so the rehearsal's batches are trained again. The run then goes on from there
with the kept plan: it ends bit for bit where that plan pinned from the config ends,
whether the plan was measured, adopted from a checkpoint or from the plan cache. When
the first call decides (a run too short to measure even at its rate, trace included)
it stands as the run's first call.

The price of measuring is the rehearsal's steps, trained again: the first two calls
and the trials (at most 3 % of the estimated run). Host, cross-replica context, every
worker alike (the calls are collective).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from trainer.loop.plan import Planner
from trainer.loop.plan_space import Plan


class Snapshot:
    """Host copies of ``variables``' values (as a checkpoint reads them);
    :meth:`restore` assigns them back (as a checkpoint's restore does)."""

    def __init__(self, variables: Sequence[Any]):
        self._saved = [(v, np.array(tf.convert_to_tensor(v))) for v in variables]

    def restore(self) -> None:
        for variable, value in self._saved:
            variable.assign(value)


def rehearse(planner: Planner, call: Callable[[Plan, int], float], snapshot: Snapshot,
             done: int, steps: int) -> dict[str, Any]:
    """Runs loop calls of the planner's plans until it decides, then restores
    ``snapshot`` (also when a call raises).

    Args:
      planner: a planner of ``perf.plan="auto"`` left undecided by its first call.
      call: ``(plan, num_steps) -> host seconds``: one loop call of ``plan``.
      snapshot: the state before the planner's first call.
      done: the steps the first call ran.
      steps: the run's steps from the snapshot on (the rehearsal runs at most as many).

    Returns the decision's event fields (:meth:`Planner.after_call`; the configured plan
    when the run's steps end first: :meth:`Planner.ended`).
    """
    record = None
    try:
        while not planner.decided and done < steps:
            plan = planner.next_plan()
            num_steps = min(plan.steps_per_loop, steps - done)
            seconds = call(plan, num_steps)
            done += num_steps
            record = planner.after_call(plan, num_steps, seconds, steps)
    finally:
        snapshot.restore()
    return record if planner.decided else planner.ended(steps)
