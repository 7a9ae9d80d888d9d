"""One eval pass in calls of bounded length: it can be abandoned, and it shows progress.

The compiled eval loop (:meth:`trainer.loop.compiled_loops.CompiledLoops.evaluate`) runs
``n`` steps per call, or until the data ends. :func:`run_pass` calls it with a step
count that doubles while a call takes under :data:`CALL_S` seconds and halves while it
takes over twice that, so that on one worker

* a stop (``abandon()`` true, e.g. after SIGTERM) abandons the pass within about a
  call's length, raising :class:`EvalAbandoned`;
* a long pass (an eval dataset of unknown length, a slow one) logs its progress every
  :data:`PROGRESS_S` seconds.

A call of a few steps costs a few milliseconds more than one call for the whole pass.
On several workers the pass is ONE call, as before: its cross-worker collectives need
every worker to take the same decisions, and abandoning would need an agreement per
call (``abandon`` is not consulted).

Contexts: host, cross-replica, eager.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import tensorflow as tf
from absl import logging

CALL_S = 0.5  # target seconds per eval call
PROGRESS_S = 10.0  # seconds between two progress lines of a long pass
_MAX_CALL_STEPS = 1 << 16


class EvalAbandoned(RuntimeError):
    """An eval pass stopped before its end because a stop was requested."""


def run_pass(evaluate: Callable[[Any, tf.Tensor], tf.Tensor], iterator: Any, steps: int,
             abandon: Callable[[], bool], where: str, workers: int = 1,
             clock: Callable[[], float] = time.monotonic) -> int:
    """Runs ``steps`` eval steps (< 0: until the data ends); returns the steps run.

    ``evaluate(iterator, n)``: the compiled loop, returning the steps it ran; ``where``
    names the pass in log lines (e.g. ``"eval at step 300"``). Raises
    :class:`EvalAbandoned` when ``abandon()`` is true between two calls (one worker only).
    """
    if workers > 1:
        return int(evaluate(iterator, tf.constant(steps, tf.int64)))
    done, chunk = 0, 1
    started = last_report = clock()
    while steps < 0 or done < steps:
        if abandon():
            raise EvalAbandoned(f"{where}: the eval pass was abandoned after {done} batches "
                                f"(stop requested).")
        want = chunk if steps < 0 else min(chunk, steps - done)
        before = clock()
        ran = int(evaluate(iterator, tf.constant(want, tf.int64)))
        took = clock() - before
        done += ran
        if ran < want:
            break  # the data ended
        if took < CALL_S / 2:
            chunk = min(chunk * 2, _MAX_CALL_STEPS)
        elif took > CALL_S * 2:
            chunk = max(chunk // 2, 1)
        if clock() - last_report >= PROGRESS_S:
            last_report = clock()
            total = f" of {steps}" if steps > 0 else ""
            logging.info("%s: %d batches%s so far (%.1f batches/s)", where, done, total,
                         done / max(last_report - started, 1e-9))
    return done
