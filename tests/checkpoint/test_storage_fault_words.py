"""Every way a storage fault reaches the checkpoint service is one known fault with its
fix (trainer.errors.storage_fault): the errors of TensorFlow's file system, of
google-cloud-storage and of tensorstore (orbax's writer) for a bucket's 401, 403, 404,
429 and 5xx after the client's retries, as well as errno faults; anything else is
not a storage fault (a bug keeps its traceback). And asyncio's echo of orbax's reads
left unretrieved after a failed read is not printed (the failure is, once)."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import sys

import pytest
import tensorflow as tf
import tensorstore
from google.api_core import exceptions as google_errors

from trainer import errors
from trainer.checkpoint.storage import orbax_logs

TF_403 = ("Error executing an HTTP request: HTTP response code 403 with body '{\"error\": "
          "{\"code\": 403}}'\n\t when reading gs://b/run/checkpoints/")


@pytest.mark.parametrize("error, reason, fix", [
    (tf.errors.PermissionDeniedError(None, None, TF_403), "403", "roles/storage.objectAdmin"),
    (google_errors.Forbidden("POST https://storage.googleapis.com/b: denied"), "403",
     "roles/storage.objectAdmin"),
    (ValueError('PERMISSION_DENIED: Error writing "run/x" in GCS: HTTP response code: 403'),
     "403", "write access"),
    (tf.errors.UnauthenticatedError(None, None, "token expired"), "401", "gcloud auth"),
    (tf.errors.NotFoundError(None, None, "gs://b/run/checkpoints/20 not found"), "404",
     "one run alone"),
    (google_errors.TooManyRequests("rate limit"), "429", "checkpoint.every_steps"),
    (ValueError("RESOURCE_EXHAUSTED: HTTP response code: 429 with body: slow down"), "429",
     "quota"),
    (tf.errors.UnavailableError(None, None, "HTTP response code 503"), "503", "retry later"),
    (google_errors.ServiceUnavailable("backend"), "503", "retry later"),
    (ValueError("UNAVAILABLE: HTTP response code: 502 with body: bad gateway"), "502",
     "retry later"),
    (tf.errors.DeadlineExceededError(None, None, "upload timed out"), "504", "retry later"),
    (OSError(errno.ENOSPC, "No space left on device"), "the disk is full",
     "Free space or make the workdir writable"),
])
def test_a_storage_fault_in_any_clients_words_is_named_with_its_fix(error, reason, fix):
    wrapped = RuntimeError("orbax: the save failed")
    wrapped.__cause__ = error  # as orbax re-raises it
    for raised in (error, wrapped):
        assert reason in errors.storage_fault(raised)
        assert fix in errors.storage_fault_fix(raised)


@pytest.mark.parametrize("error", [
    ValueError("INVALID_ARGUMENT: NOT_FOUND: x"),
    tf.errors.InvalidArgumentError(None, None, "shapes differ"),
    TypeError("unsupported operand"),
    KeyError("model.3"),
])
def test_anything_else_is_not_a_storage_fault(error):
    assert errors.storage_fault(error) is None


def _record_raised_in(filename: str, name: str = "asyncio") -> logging.LogRecord:
    try:
        exec(compile("raise ValueError('cannot read')", filename, "exec"))
    except ValueError:
        exc_info = sys.exc_info()
    return logging.LogRecord(name, logging.ERROR, "/usr/lib/python3/asyncio/base_events.py",
                             1, "Task exception was never retrieved\nfuture: <Task finished>",
                             None, exc_info)


def test_orbax_reads_left_unretrieved_after_a_failed_read_are_not_printed():
    """A step that fails to read is reported in one line; asyncio's echo of orbax's
    other reads of it ("Task exception was never retrieved", timing-dependent) is not."""
    quiet = orbax_logs.QuietOrbax()
    assert not quiet.filter(_record_raised_in(f"/site-packages{os.sep}orbax{os.sep}x.py"))
    assert quiet.filter(_record_raised_in("/home/user/my_code.py"))  # others' pass


def test_a_bare_tensorstore_read_left_unretrieved_after_a_failed_read_is_not_printed(
        tmp_path, caplog):
    """The same echo when orbax awaited tensorstore's future directly: the task's
    traceback then holds only asyncio's frames (seen in CI, timing-dependent). A real
    tensorstore read of a corrupt array, left unretrieved, is what asyncio logs."""
    (tmp_path / "array").mkdir()
    (tmp_path / "array" / ".zarray").write_text("corrupt")

    async def read_and_leave() -> None:
        task = asyncio.ensure_future(tensorstore.open(
            {"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / "array")}}))
        await asyncio.wait([task])

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(read_and_leave())
        gc.collect()
    unretrieved = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert len(unretrieved) == 1
    assert not orbax_logs.QuietOrbax().filter(unretrieved[0])


def test_orbax_writers_waiting_for_the_directory_of_a_failed_save_are_not_printed():
    """A vanished workdir fails the save (one line); orbax's writer threads then time
    out waiting for the step directory, each with a traceback, at exit."""
    quiet = orbax_logs.QuietOrbax()
    orbax_file = f"/site-packages{os.sep}orbax{os.sep}checkpoint{os.sep}future.py"

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("absl", logging.ERROR, orbax_file, 1, message, None, None)

    assert not quiet.filter(record(
        "[process=0][thread=json_ch_save] _SignalingThread.run() raised an exception: "
        "Timeout waiting for key 'awaitable_signals_contract_5/item_directory_creation'"))
    assert quiet.filter(record("_SignalingThread.run() raised an exception: Timeout "
                               "waiting for key 'awaitable_signals_contract_5/commit'"))
