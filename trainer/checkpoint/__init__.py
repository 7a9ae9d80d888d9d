"""Checkpoints: what is saved, where it lives, when it is written, and preemption.

* :mod:`trainer.checkpoint.state` — what a checkpoint holds and how it is matched back
  to a Trainer's variables (a pytree of numpy arrays, matched by name).
* :mod:`trainer.checkpoint.storage` — where the bytes go: the writer (orbax managers,
  keep-N / best-N, async writes), the reader, a bucket's steps, checksums.
* :mod:`trainer.checkpoint.storage.bucket` — a step in a bucket (``gs://``): staged, uploaded in
  parallel, committed by one marker.
* :mod:`trainer.checkpoint.storage.array_files` — the opt-in ``O_DIRECT`` ``.npy`` writer.
* :mod:`trainer.checkpoint.service` — the save policy (a service) and the best export.
* :mod:`trainer.checkpoint.resume` — restoring the newest good checkpoint (verified).
* :mod:`trainer.checkpoint.guards.preemption` — SIGTERM during ``fit()`` becomes a checkpoint
  and a retryable exit.
* :mod:`trainer.checkpoint.guards.lease` — one run per workdir.
* :mod:`trainer.checkpoint.storage.orbax_logs` — orbax's log noise kept off the output.

A new checkpoint format is a change to ``state`` (what) and ``store`` (how it is
written); the service only decides when.
"""

__all__ = ["deferral", "guards", "inventory", "resume", "save_failures", "service", "show",
           "state", "storage"]
