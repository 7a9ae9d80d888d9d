"""Where a workdir's checkpoint steps live, decided once: :func:`steps_for`.

A workdir on a file system gets :class:`~trainer.checkpoint.storage.local_steps.LocalSteps`
(orbax's own directories and commits); one in a bucket (``gs://``) gets
:class:`~trainer.checkpoint.storage.bucket_steps.BucketSteps` (staged locally, uploaded,
committed by a marker, read from a downloaded copy). Both answer the same calls:

* reading: ``candidates(warn_incomplete)`` (the committed steps, newest first),
  ``incomplete()``, ``readable(path)`` (a local directory to read a step from);
* for the writer (:class:`trainer.checkpoint.storage.writer.CheckpointWriter`):
  ``directory(kind)`` (where orbax's manager writes), ``opened``, ``saved``, ``writing``,
  ``wait``, ``committed``, ``delete``, ``vanished``, ``discard``, ``last_committed``,
  ``abandon``, ``close``; ``staged`` says which it is.

Nothing else in the package asks whether a workdir is in a bucket to decide how its
steps are written or read. Contexts: host only.
"""

from __future__ import annotations

import os
from typing import ContextManager

from tf_cluster.storage_schemes import is_bucket
from trainer.checkpoint.storage.bucket_steps import BucketSteps
from trainer.checkpoint.storage.local_steps import LocalSteps


Steps = LocalSteps | BucketSteps  # what steps_for returns


def steps_for(workdir: str, staging_parent: str = "") -> Steps:
    """The checkpoint steps of ``workdir``: in a bucket, staged under ``staging_parent``
    (``checkpoint.staging_dir``; ``""``: ``$TMPDIR``) when written; else on its file
    system."""
    return BucketSteps(workdir, staging_parent) if is_bucket(workdir) else LocalSteps(workdir)


def readable(path: str) -> ContextManager[str]:
    """A local directory to read the committed step directory ``path``
    (``WORKDIR/KIND/STEP``) from, for as long as the context lasts (its workdir's
    :meth:`readable`)."""
    workdir = os.path.dirname(os.path.dirname(path.rstrip("/")))
    return steps_for(workdir).readable(path)
