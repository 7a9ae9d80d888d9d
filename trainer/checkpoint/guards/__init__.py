"""What keeps a run's checkpoints safe from outside: nothing else in the package imports them.

* :mod:`~trainer.checkpoint.guards.lease` — one run per workdir (``lease.json``).
* :mod:`~trainer.checkpoint.guards.shared_workdir` — every task of a multi-worker run sees
  the chief's workdir (checked at start).
* :mod:`~trainer.checkpoint.guards.preemption` — SIGTERM (or SIGINT) during ``fit()``
  becomes a stop at the next loop boundary, whose save is the checkpoint service's.
"""

__all__ = ["lease", "preemption", "shared_workdir"]
