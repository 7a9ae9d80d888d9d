"""The objects of one checkpoint directory in a bucket (``gs://``), at the speed of the link.

Orbax writing a step straight into a bucket cost ~130 requests per save, almost all one
after another (each directory test is two requests, OCDBT commits in rounds, the
checksums read every file back): 20-40 s at 150-300 ms a request, whatever the state's
size, so periodic saves were deferred and a spot VM's 30 s notice was missed. So for a
``gs://`` workdir, orbax writes each step into a local staging directory (its own rename
commit, at local-disk speed; :mod:`trainer.checkpoint.storage.bucket_steps`) and
:class:`BucketDirectory` then moves it to the bucket:

* :meth:`BucketDirectory.upload` sends the step's files in parallel (google-cloud-storage's
  ``transfer_manager``, :data:`PARALLEL` at once; one request a file up to 8 MiB), each
  carrying the CRC32C of its bytes before upload, from the checksums written with the
  step (GCS refuses an object whose bytes do not match it), and compares the size and
  CRC32C the bucket reports for each object written with the local ones: nothing is
  read back. Then it commits the
  step with orbax's GCS commit marker, ``commit_success.txt``, written last: a step
  without it is no checkpoint to any reader (orbax's rule on GCS), so a save cut
  anywhere leaves the earlier steps as they were. A committed step is laid out as orbax
  lays it out on GCS, so plain orbax reads it. Cost: one round of parallel uploads plus
  the commit, plus bytes / bandwidth.
* :meth:`BucketDirectory.delete` removes steps (retention) in parallel, one request an
  object after one listing; it runs after the commit, off the save's path.
* :meth:`BucketDirectory.listing` is every object under the directory with its size, in one
  request (per 1,000 objects): which steps are committed (:meth:`committed_steps`),
  which are not (:meth:`incomplete_steps`).
* :meth:`BucketDirectory.download` copies a step's objects into a local directory in
  parallel (one listing, then one request an object), for a restore that reads and
  verifies locally.
* :meth:`BucketDirectory.seed` writes, for each committed step, its orbax step metadata
  (``_CHECKPOINT_METADATA``: the metrics best-N ranks by) into the staging directory, so
  orbax's retention there sees the bucket's steps as it would see them in the bucket.

Every request goes through the process's client and its one retry policy
(:mod:`trainer.runtime.gcs`: what GCS says is transient, backoff from 1 s doubling to
32 s, for 120 s at most), whose :func:`~trainer.runtime.gcs.retry_reason` says what it
last retried. Contexts: host; any thread.
"""

from __future__ import annotations

import base64
import os
from concurrent import futures
from typing import Any, Callable, Iterable

from trainer.checkpoint.storage import checksums
from trainer.runtime import gcs
from tf_cluster.storage_schemes import BUCKET_SCHEME

COMMIT_FILE = "commit_success.txt"  # orbax's commit marker on GCS (atomicity_types)
METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax's step metadata (metrics, timestamps)
PARALLEL = 8  # objects sent or fetched at once (the HTTP pool holds 10 connections)
METRICS_ITEM = "metrics"  # orbax's item of a step's metrics (best-N ranks by them)


def local_sizes(local: str) -> dict[str, int]:
    """``{file relative to the directory local: size}`` of every file under it."""
    return {os.path.relpath(os.path.join(root, n), local): os.path.getsize(os.path.join(root, n))
            for root, _, names in os.walk(local) for n in names}


def _crc_b64(crc: int) -> str:
    """A CRC32C as GCS writes it: base64 of its 4 big-endian bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


class UploadMismatch(OSError):
    """An object the bucket holds is not what was sent (size or CRC32C)."""


class BucketDirectory:
    """The step directories of one checkpoint directory in a bucket (``gs://B/P``)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        bucket, _, prefix = self.url[len(BUCKET_SCHEME):].partition("/")
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self._bucket_name = bucket

    @property
    def bucket(self) -> Any:
        return gcs.client().bucket(self._bucket_name)

    def _name(self, step: int, rel: str = "") -> str:
        return f"{self.prefix}{step}/{rel}" if rel else f"{self.prefix}{step}/"

    # ------------------------------------------------------------ reading names
    def listing(self, step: int | None = None) -> dict[str, int]:
        """``{name relative to the directory: size}`` of every object under it (or under
        ``step``'s directory), in one request per 1,000 objects."""
        prefix = self.prefix if step is None else self._name(step)
        blobs = gcs.client().list_blobs(self._bucket_name, prefix=prefix, retry=gcs.default_retry(),
                                     fields="items(name,size),nextPageToken")
        return {b.name[len(self.prefix):]: int(b.size or 0) for b in blobs}

    @staticmethod
    def _steps(names: Iterable[str]) -> dict[int, set[str]]:
        steps: dict[int, set[str]] = {}
        for name in names:
            head, _, rest = name.partition("/")
            if head.isdigit():
                steps.setdefault(int(head), set()).add(rest)
        return steps

    def committed_steps(self, names: Iterable[str] | None = None) -> list[int]:
        """The committed steps (their commit marker is there), ascending."""
        steps = self._steps(self.listing() if names is None else names)
        return sorted(s for s, files in steps.items() if COMMIT_FILE in files)

    def incomplete_steps(self, names: Iterable[str] | None = None) -> list[int]:
        """Steps with objects but no commit marker (being written, or a save cut
        before its commit), ascending."""
        steps = self._steps(self.listing() if names is None else names)
        return sorted(s for s, files in steps.items() if COMMIT_FILE not in files)

    # ------------------------------------------------------------ writing
    def upload(self, step: int, local: str, skip: Iterable[str] = (),
               before_commit: Callable[[], None] = lambda: None) -> int:
        """Uploads the staged step directory ``local`` as ``step`` (but the files
        ``skip``, relative to it: other workers' shares), calls ``before_commit`` (which
        raises to leave the step uncommitted) and commits it (the marker last); returns
        the bytes sent. Raises the storage's error, or :class:`UploadMismatch` naming an
        object whose reported size or CRC32C differs from the local file's (the step is
        then not committed)."""
        skip = set(skip)
        data = [f for f in sorted(local_sizes(local)) if f != COMMIT_FILE and f not in skip]
        sent = self.send(step, local, data)
        before_commit()
        marker = os.path.join(local, COMMIT_FILE)
        if not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(f"Checkpoint commit was successful to {self.url}/{step}")
        self.send(step, local, [COMMIT_FILE])
        return sent

    def put(self, step: int, rel: str, text: str) -> None:
        """Writes the small object ``rel`` of ``step`` holding ``text`` (one request)."""
        self.bucket.blob(self._name(step, rel)).upload_from_string(
            text, retry=gcs.default_retry())

    def read_text(self, step: int, rel: str) -> str:
        """The text of the small object ``rel`` of ``step`` (one request)."""
        return self.bucket.blob(self._name(step, rel)).download_as_text(
            retry=gcs.default_retry())

    def send(self, step: int, local: str, files: list[str]) -> int:
        """Uploads ``files`` (relative to ``local``) of ``step`` in parallel; returns
        their bytes. The CRC32C of each comes from its item's checksums, written when
        orbax finalised the item (:mod:`~trainer.checkpoint.storage.checksums`; only the files
        they do not cover are read here)."""
        from google.cloud.storage import transfer_manager

        known = checksums.step_table(local)
        blobs, expected = [], []
        for rel in files:
            size, crc = known.get(rel) or checksums.file_crc(os.path.join(local, rel))
            blob = self.bucket.blob(self._name(step, rel))
            blob.crc32c = _crc_b64(crc)  # checked by GCS on receipt
            blobs.append((os.path.join(local, rel), blob))
            expected.append((rel, size, blob.crc32c))
        transfer_manager.upload_many(blobs, upload_kwargs={"retry": gcs.default_retry()},
                                     max_workers=PARALLEL, raise_exception=True,
                                     worker_type=transfer_manager.THREAD)
        for (rel, size, crc), (_, blob) in zip(expected, blobs):
            if blob.size is not None and int(blob.size) != size:
                raise UploadMismatch(f"{self.url}/{step}/{rel}: the bucket holds {blob.size} "
                               f"bytes, {size} were sent")
            if blob.crc32c != crc:
                raise UploadMismatch(f"{self.url}/{step}/{rel}: the bucket reports CRC32C "
                               f"{blob.crc32c}, {crc} was sent")
        return sum(size for _, size, _ in expected)

    def delete(self, steps: Iterable[int], names: Iterable[str] | None = None) -> None:
        """Deletes every object of ``steps`` (``names``: a listing already made): the
        commit markers first (each step stops being a checkpoint at once), then the
        rest in parallel."""
        steps = set(steps)
        if not steps:
            return
        names = [n for n in (self.listing() if names is None else names)
                 if self._steps([n]).keys() & steps]
        markers = [n for n in names if n.endswith("/" + COMMIT_FILE)]
        rest = [n for n in names if n not in markers]
        for group in (markers, rest):
            with futures.ThreadPoolExecutor(PARALLEL, "bucket-delete") as pool:
                list(pool.map(self._delete_one, group))

    def _delete_one(self, rel: str) -> None:
        from google.api_core.exceptions import NotFound

        try:
            self.bucket.blob(self.prefix + rel).delete(retry=gcs.default_retry())
        except NotFound:
            pass  # already gone (another cleaner, or a retry of a delete that went through)

    # ------------------------------------------------------------ reading data
    def download(self, step: int, local: str, listing: dict[str, int] | None = None,
                 only: Callable[[str], bool] = lambda name: True) -> list[str]:
        """Copies the objects of ``step`` (those whose name relative to the step
        ``only`` accepts) into the directory ``local`` (made), in parallel; returns
        their names relative to the step. ``listing``: a :meth:`listing` of the
        directory already made (the step's objects are not listed again)."""
        from google.cloud.storage import transfer_manager

        listed = self.listing(step) if listing is None else listing
        names = [n[len(f"{step}/"):] for n in listed if n.startswith(f"{step}/")]
        names = [n for n in names if n and not n.endswith("/") and only(n)]
        pairs = []
        for rel in names:
            path = os.path.join(local, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            pairs.append((self.bucket.blob(self._name(step, rel)), path))
        transfer_manager.download_many(pairs, download_kwargs={"retry": gcs.default_retry()},
                                       max_workers=PARALLEL, raise_exception=True,
                                       worker_type=transfer_manager.THREAD)
        return names

    def seed(self, local: str) -> list[int]:
        """Makes the staging directory ``local`` show the bucket's steps: for each
        committed step, ``local/<step>/`` with its orbax step metadata, metrics and
        commit marker (one listing, then those small objects in parallel); the objects
        of steps never committed (a save cut before its commit) are deleted, as orbax
        deletes its incomplete steps at the next save. Returns the committed steps."""
        names = self.listing()
        steps = self._steps(names)
        committed = sorted(s for s, files in steps.items() if COMMIT_FILE in files)
        self.delete(set(steps) - set(committed), names)

        small = [n for n in names if self._steps([n]).keys() & set(committed)
                 and n.partition("/")[2].split("/")[0] in (METADATA_FILE, METRICS_ITEM)]
        for step in committed:
            os.makedirs(os.path.join(local, str(step)), exist_ok=True)
            with open(os.path.join(local, str(step), COMMIT_FILE), "w") as f:
                f.write(f"Checkpoint commit was successful to {self.url}/{step}")

        def fetch(name: str) -> None:
            target = os.path.join(local, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            self.bucket.blob(self.prefix + name).download_to_filename(
                target, retry=gcs.default_retry())

        with futures.ThreadPoolExecutor(PARALLEL, "bucket-seed") as pool:
            list(pool.map(fetch, small))
        return committed
