"""The workdir of a multi-worker run is shared by every task: checked at start.

On a cluster the workdir must be one directory every host sees (NFS, Lustre, GCS...):
the chief writes the checkpoints, and a restarted group, an evaluator or a run resumed
on other hosts reads them. A node-local path passes every local check and fails much
later (or silently: checkpoints nobody else can read). :func:`check` finds it at start:

1. the chief writes ``workdir/.cluster-<nonce>`` (``nonce``: 8 random bytes, new each
   run, so a file left by an earlier run or another group cannot pass the check);
2. the nonce is broadcast to every task over the strategy's collectives
   (:func:`trainer.distribution.host_collectives.broadcast_arrays`, never through the file system);
3. every other task waits up to ``checkpoint.shared_workdir_timeout_s`` for that file
   in ITS workdir (``tf.io.gfile``: ``gs://...`` is checked the same way), polling;
4. one all-reduce tells every task which tasks did not see it; the chief removes the
   file. If any did not, EVERY task raises :class:`trainer.errors.WorkdirError` naming
   those tasks (TF_CONFIG address) and the path, so the whole group exits non-zero in
   bounded time instead of one task failing and the others hanging.

A single worker, no workdir or a timeout of 0 checks nothing. Contexts: host, eager,
cross-replica, on every worker at the same point (it takes part in collectives).
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
import tensorflow as tf
from absl import logging

from trainer.distribution import host_collectives
from trainer.errors import WorkdirError

MARKER_PREFIX = ".cluster-"
_POLL_S = 0.2


def _tasks(strategy: tf.distribute.Strategy) -> tuple[list[tuple[str, int, str]], int]:
    """Every training task as ``(job, index, address)`` (chief first) and this task's rank."""
    resolver = strategy.cluster_resolver
    spec = resolver.cluster_spec().as_dict()
    tasks = [(job, i, addr) for job in ("chief", "worker")
             for i, addr in enumerate(spec.get(job, []))]
    own = [r for r, (job, i, _) in enumerate(tasks)
           if job == resolver.task_type and i == int(resolver.task_id)]
    return tasks, own[0]


def _wait_for(path: str, timeout_s: float, sleep: Callable[[float], None],
              clock: Callable[[], float]) -> bool:
    """True once ``path`` exists; False after ``timeout_s`` seconds without it."""
    deadline = clock() + timeout_s
    while True:
        try:
            if tf.io.gfile.exists(path):
                return True
        except (OSError, tf.errors.OpError):
            pass  # an unreachable file system is a file that is not there
        if clock() >= deadline:
            return False
        sleep(_POLL_S)


def check(strategy: tf.distribute.Strategy, workdir: str | None, timeout_s: float,
          sleep: Callable[[float], None] = time.sleep,
          clock: Callable[[], float] = time.monotonic) -> None:
    """Raises :class:`WorkdirError` on every task unless all see the chief's workdir
    (see the module docstring). Call on every worker at the same point."""
    if workdir is None or timeout_s <= 0 or host_collectives.num_workers(strategy) == 1:
        return
    chief = host_collectives.is_chief(strategy)
    logging.info("checking that every task sees the workdir %s (up to %g s, "
                 "checkpoint.shared_workdir_timeout_s)", workdir, timeout_s)
    nonce = np.frombuffer(os.urandom(8), np.int32).copy() if chief else None
    if chief:
        tf.io.gfile.makedirs(workdir)
        with tf.io.gfile.GFile(os.path.join(workdir, MARKER_PREFIX + nonce.tobytes().hex()),
                               "w") as f:
            f.write("written by the chief; removed once every task has seen it\n")
    nonce = host_collectives.broadcast_arrays(
        strategy, [nonce] if chief else None, [([2], "int32")])[0]
    marker = os.path.join(workdir, MARKER_PREFIX + nonce.tobytes().hex())
    seen = chief or _wait_for(marker, timeout_s, sleep, clock)
    tasks, rank = _tasks(strategy)
    missing = np.zeros(len(tasks), np.int32)
    missing[rank] = 0 if seen else 1
    missing = host_collectives.sum_over_workers(strategy, missing)
    if chief:
        tf.io.gfile.remove(marker)
    if missing.any():
        raise WorkdirError(_message(tasks, rank, missing, marker, timeout_s))


def _message(tasks: list[tuple[str, int, str]], rank: int, missing: np.ndarray,
             marker: str, timeout_s: float) -> str:
    chief = f"{tasks[0][0]}:{tasks[0][1]}, {tasks[0][2]}"
    blind = ", ".join(f"{job}:{i} ({addr})" for r, (job, i, addr) in enumerate(tasks)
                      if missing[r])
    workdir, name = os.path.split(marker)
    fix = (f"Every task must see the same workdir (a shared file system such as NFS, or "
           f"gs://...): give every task the same shared --workdir, or raise "
           f"checkpoint.shared_workdir_timeout_s if the file system is slow to show new "
           f"files (0 turns this check off).")
    if missing[rank]:
        job, i, addr = tasks[rank]
        return (f"--workdir={workdir} is not shared with the chief: {job}:{i} ({addr}) did "
                f"not see the file {name} that the chief ({chief}) wrote there within "
                f"{timeout_s:g} s (checkpoint.shared_workdir_timeout_s). {fix}")
    return (f"--workdir={workdir} is not shared by every task: {blind} did not see the "
            f"file {name} that the chief ({chief}) wrote there within {timeout_s:g} s "
            f"(checkpoint.shared_workdir_timeout_s). {fix}")
