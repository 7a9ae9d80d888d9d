"""Appending to an object in a bucket by uploading only what was added (``gs://``).

Object storage has no append: TensorFlow's GCS file system downloads a file opened for
append and uploads the WHOLE file again at every flush, so a run's metrics.jsonl and
event files, flushed at every logging window, cost bytes (and seconds at exit) that
grow with the square of the run's length (one events file was uploaded 333 times, 36.8
MB, in one run). Here the records are written to local files first; each
:meth:`ComposedObject.sync` uploads the bytes added since the last one as a part object,
composes ``[object, part]`` into the object (GCS compose: a server-side concatenation,
one new generation of the same name) and deletes the part. Requests go through the
process's client (:mod:`trainer.runtime.gcs`); all but the compose, which is not
idempotent, are retried by its policy. Readers (TensorBoard, the
doctor, ``tf.io.gfile``) see one object that grows, as before.

Contexts: host; one thread per object (the telemetry writer thread).
"""

from __future__ import annotations

import os

from trainer.runtime import gcs


def upload_errors() -> tuple[type[BaseException], ...]:
    """The errors an upload raises for a storage fault (google-cloud's, when installed:
    a ``gs://`` workdir needs it anyway)."""
    try:
        from google.api_core.exceptions import GoogleAPIError
    except ImportError:
        return (OSError,)
    return (OSError, GoogleAPIError)


class ComposedObject:
    """The object ``remote`` (``gs://bucket/name``) kept equal to the local file
    ``local`` plus what the object held before (a resumed run's metrics.jsonl goes on
    where the earlier run stopped)."""

    def __init__(self, local: str, remote: str):
        bucket, self.name = gcs.split_url(remote)
        self.local = local
        self._bucket = gcs.client().bucket(bucket)
        self._offset = 0
        self._parts = 0
        self._exists: bool | None = None

    def sync(self) -> int:
        """Uploads what the local file gained since the last sync; returns its bytes."""
        try:
            size = os.path.getsize(self.local)
        except FileNotFoundError:
            return 0
        if size <= self._offset:
            return 0
        with open(self.local, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        target = self._bucket.blob(self.name)
        if self._exists is None:
            self._exists = target.exists(retry=gcs.default_retry())
        if not self._exists:
            target.upload_from_string(data, retry=gcs.default_retry())
            self._exists = True
        else:
            self._parts += 1
            part = self._bucket.blob(f"{self.name}.part-{os.getpid()}-{self._parts}")
            part.upload_from_string(data, retry=gcs.default_retry())
            target.compose([target, part])  # not idempotent: google-cloud-storage's default
            part.delete(retry=gcs.default_retry())
        self._offset += len(data)
        return len(data)
