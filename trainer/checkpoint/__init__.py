"""Checkpoints: what is saved, where it lives, when it is written, and preemption.

* :mod:`trainer.checkpoint.state` — what a checkpoint holds and how it is matched back
  to a Trainer's variables (a pytree of numpy arrays, matched by name).
* :mod:`trainer.checkpoint.store` — where checkpoints live and how they are read back.
* :mod:`trainer.checkpoint.managers` — writing them: orbax managers, keep-N / best-N,
  async writes.
* :mod:`trainer.checkpoint.bucket` — a step in a bucket (``gs://``): staged, uploaded in
  parallel, committed by one marker.
* :mod:`trainer.checkpoint.array_files` — the opt-in ``O_DIRECT`` ``.npy`` writer.
* :mod:`trainer.checkpoint.service` — the save policy (a service) and the best export.
* :mod:`trainer.checkpoint.resume` — restoring the newest good checkpoint (verified).
* :mod:`trainer.checkpoint.preemption` — SIGTERM during ``fit()`` becomes a checkpoint
  and a retryable exit.
* :mod:`trainer.checkpoint.lease` — one run per workdir.
* :mod:`trainer.checkpoint.orbax_logs` — orbax's log noise kept off the output.

A new checkpoint format is a change to ``state`` (what) and ``store`` (how it is
written); the service only decides when.
"""

__all__ = ["array_files", "bucket", "checksums", "deferral", "inspect", "inventory",
           "lease", "managers", "orbax_logs", "preemption", "resume", "save_failures",
           "service", "shared_workdir", "state", "store"]
