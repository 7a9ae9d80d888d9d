"""Where a run executes and how its replicas stay one: strategies, manual data parallelism,
collectives, the replica-consistency check, BatchNorm across replicas.

* :mod:`trainer.distribution.strategies` — devices and the strategy factory
  (``distribute.strategy``).
* :mod:`trainer.distribution.data_parallel` — manual data parallelism
  (``distribute.strategy="manual"``): another gradient reducer.
* :mod:`trainer.distribution.host_collectives` — small host-side collectives between
  workers (is this the chief, agree on a value).
* :mod:`trainer.distribution.lost_peer` — naming the peer a multi-worker error lost.
* :mod:`trainer.distribution.replica_check` — do every replica's and worker's copies of
  the variables agree.
* :mod:`trainer.distribution.batch_norm` — BatchNormalization across replicas: named at
  start, synchronised on request.
* :mod:`trainer.distribution.collectives` — ``all_gather`` / ``all_reduce`` for a custom
  step (``Trainer.all_gather``).
"""

__all__ = ["batch_norm", "collectives", "data_parallel", "host_collectives", "lost_peer",
           "replica_check", "strategies"]
