"""Checkpoints: what is saved, when, where the bytes go, and what guards them.

The map (every module of the package is on it; ``trainer.checkpoint.`` is left out):

* the policy, on top: ``service`` (when to save: periodic, best, final; the best export),
  ``local_saves`` (when each worker writes its local tier copy), ``stop_save`` (the
  save of a run that stops early, within a preemption's grace period), ``deferral`` (a periodic save due while the last write still runs),
  ``save_failures`` (a failed save: warn, retry, then stop), ``resume`` (restoring the
  newest good checkpoint), ``inventory`` (what a workdir's steps are worth), ``show``
  (``python -m trainer.checkpoint.show --workdir=DIR``);
* what a checkpoint holds: ``state`` (the variables by name, the manifest);
* where the bytes go: ``storage`` — ``storage.writer`` (orbax's managers),
  ``storage.steps`` (``steps_for(workdir)``: the one dispatch, chosen once, to
  ``storage.local_steps`` or ``storage.bucket_steps``), ``storage.reader`` (one step
  directory read and verified), ``storage.handlers`` (orbax and its item handlers),
  ``storage.bucket`` (a checkpoint directory's objects in a bucket),
  ``storage.shares`` (on several workers in a bucket: each worker's share of a step's
  array files, uploaded and read back by it), ``storage.array_files`` (the
  ``O_DIRECT`` ``.npy`` files), ``storage.orbax_logs``, ``storage.checksums``,
  ``storage.local_tier`` (every worker's own copy on its local disk, never uploaded);
* what guards the run from outside, imported by nothing else here: ``guards`` —
  ``guards.lease`` (one run per workdir), ``guards.shared_workdir`` (every task sees
  the chief's workdir), ``guards.preemption`` (SIGTERM becomes a stop).

Periodic save. The loop driver calls ``service`` (``Checkpointer.on_loop_end``) at
every multiple of ``checkpoint.every_steps``: ``deferral`` skips it while the last
write still runs; ``state`` copies the variables to host memory; ``storage.writer``
hands them to orbax's manager in the directory ``storage.steps`` chose when the writer
was made: ``storage.local_steps`` (``workdir/checkpoints``, orbax's own rename commit)
or ``storage.bucket_steps`` (a local staging directory, seeded from the bucket by
``storage.bucket``); orbax writes through ``storage.handlers`` (``storage.array_files``
with ``fast_io``; quieted by ``storage.orbax_logs``) and each item's
``storage.checksums`` in its own thread. In a bucket, ``storage.bucket_steps``'s upload
thread then sends the step with ``storage.bucket`` (through ``trainer.runtime.gcs``)
and commits it by its marker. On several workers with ``fast_io`` in a bucket, the
chief tells every worker to write the step too (``service``, one broadcast) and each
uploads only its share of the array files (``storage.shares``); the chief's thread
commits once every worker's share marker is in. A write that fails reaches
``save_failures``, which names the last good checkpoint from ``inventory``.

Local tier. With ``checkpoint.local_every_steps``, ``local_saves`` (its own service,
right after ``service`` at each boundary) has every worker, the chief too, copy the
state to host memory (``state``) once its previous local write committed, and hand it to
``storage.local_tier``, which writes it with a ``storage.writer`` of its own (keep 2,
``storage.local_steps``, ``storage.handlers``, ``storage.checksums``) to its local
directory. Nothing is uploaded: the workdir's saves stay the only durable copy.

Stop's save. SIGTERM reaches ``guards.preemption``, which only sets a flag; at the next
loop boundary every worker agrees to stop and the driver calls ``on_train_end``:
``stop_save`` calls ``service`` (``Checkpointer.save``, synchronous, its waits bounded
by what is left of ``checkpoint.preemption_grace_s`` in a bucket), which crosses
``state``, ``storage.writer`` and the storage ``storage.steps`` chose
(``storage.local_steps``, or ``storage.bucket_steps`` and ``storage.bucket``; orbax
through ``storage.handlers``, ``storage.array_files``, ``storage.orbax_logs`` and
``storage.checksums``) as a periodic save does, ``save_failures`` when the write fails,
then checks the step committed;
``stop_save`` broadcasts what the chief found and reports the run's ``preemption``
event, from which ``fit()`` raises ``Preempted`` and ``trainer.main`` exits 143. No
call goes back into the loop driver.

Restore. A fresh process's ``Trainer.restore()`` (or ``fit()``) calls ``resume``: the
chief lists the committed steps (``storage.steps``: ``storage.local_steps`` asks orbax,
``storage.bucket_steps`` makes one listing with ``storage.bucket``), newest first, and
reads the newest good one through a local copy (``storage.steps.readable``: in a
bucket, downloaded in parallel); ``storage.reader`` reads its manifest and arrays
(orbax through ``storage.handlers``, quieted by ``storage.orbax_logs``;
``storage.array_files``) and checks them against
``storage.checksums``; ``state`` matches the arrays to the variables by name and
assigns them (``inventory`` notes a step without checksums). With the local tier every
worker names the newest step ``storage.local_tier`` holds for it; the newest of all
(a local one at a tie) is read by its holder, through the same ``load``, skipping to
the next newest when it does not verify, and broadcast over the cluster's collectives.
Otherwise, with several workers and a workdir in a bucket, the chief sends the step's
listing and every worker downloads and checks its share of the array files
(``storage.shares``, the same split over the current worker count) and the small
files; the owner of each array sends it to the others in one sum over the cluster's
collectives. Otherwise the chief's state is broadcast over them.

At start, ``guards.lease`` takes the workdir's lease and ``guards.shared_workdir``
checks that every task sees the chief's workdir. A new checkpoint format is a change to
``state`` (what) and ``storage`` (how it is written); the policy only decides when.
"""

__all__ = ["deferral", "guards", "inventory", "local_saves", "resume", "save_failures",
           "service", "show", "state", "stop_save", "storage"]
