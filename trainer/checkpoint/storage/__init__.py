"""Where a checkpoint's bytes go: a local directory or a bucket, written and read back.

* :mod:`~trainer.checkpoint.storage.writer` — the chief's writer: orbax managers, keep-N /
  best-N, async writes; a workdir in a bucket is staged locally and uploaded.
* :mod:`~trainer.checkpoint.storage.steps` — where a workdir's steps live, decided once
  (``steps_for``): :mod:`~trainer.checkpoint.storage.local_steps` (orbax's own
  directories) or :mod:`~trainer.checkpoint.storage.bucket_steps` (staged, uploaded,
  read from a downloaded copy).
* :mod:`~trainer.checkpoint.storage.shares` — on several workers in a bucket, each
  worker's share of a step's array files: uploaded by it (the chief commits once every
  share is in), and read back by it at a restore.
* :mod:`~trainer.checkpoint.storage.reader` — reading and verifying one step directory;
  the names every storage module shares.
* :mod:`~trainer.checkpoint.storage.handlers` — orbax (loaded on first use) and its item
  handlers, each writing its checksums.
* :mod:`~trainer.checkpoint.storage.bucket` — the objects of one checkpoint directory in
  a bucket (``gs://``): uploaded in parallel, committed by one marker, listed and
  downloaded in parallel.
* :mod:`~trainer.checkpoint.storage.array_files` — the opt-in ``O_DIRECT`` ``.npy`` files.
* :mod:`~trainer.checkpoint.storage.orbax_logs` — orbax's log noise kept off the output.
* :mod:`~trainer.checkpoint.storage.checksums` — a CRC32C of every file of a step.
* :mod:`~trainer.checkpoint.storage.local_tier` — every worker's own copy of the state on
  its local disk (``checkpoint.local_every_steps``), keep 2, never uploaded.
"""

__all__ = ["array_files", "bucket", "bucket_steps", "checksums", "handlers", "local_steps",
           "local_tier", "orbax_logs", "reader", "shares", "steps", "writer"]
