"""The process's Google Cloud Storage client and its one retry policy (``gs://`` paths).

Every request the framework sends to a bucket goes through :func:`client` and is retried
by :func:`retry`: checkpoint steps (:mod:`trainer.checkpoint.storage.bucket`), the
workdir lease (:mod:`trainer.checkpoint.guards.lease`), telemetry's appended objects
(:mod:`trainer.telemetry.object_append`) and the start check
(:mod:`trainer.checks.bucket`, with its own bound and a shorter backoff).

What is retried (:func:`transient`): a status GCS says is transient (408, 429, 5xx) or a
connection that failed, broke or timed out. Every retried error is noted, and
:func:`retry_reason` says what was retried last ("the bucket answered 503 (Service
Unavailable); its client retries"), which :func:`trainer.runtime.waiting.said_while_waiting`
adds to the line it prints while a caller waits.

google-cloud-storage is optional (the ``gcs`` extra): it is imported on first use. No
TensorFlow. Contexts: host; any thread.
"""

from __future__ import annotations

import functools
import threading
import time
from http import HTTPStatus
from typing import Any, Callable

TRANSIENT = frozenset({408, 429, 500, 502, 503, 504})  # statuses GCS says to retry
RETRY_SAID_S = 60.0  # a retry older than this is no longer what a wait is about
_retried: dict[str, Any] = {}  # the last error retried ("error", "at")
_retried_lock = threading.Lock()


@functools.cache
def client() -> Any:
    """The google-cloud-storage client of the process (raises ImportError when the
    package is missing, ``google.auth``'s DefaultCredentialsError when there are no
    credentials; neither is cached)."""
    from google.cloud import storage

    return storage.Client()


def status(error: BaseException) -> int | None:
    """The HTTP status of a client error (google-api-core's, or an upload's
    ``InvalidResponse``), or None."""
    code = getattr(error, "code", None)
    if isinstance(code, int):
        return code
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


def transient(error: BaseException) -> bool:
    """Whether ``error`` is worth retrying: a status GCS says is transient, or a
    connection that failed, broke or timed out."""
    import requests
    from google.auth import exceptions as auth_exceptions

    return status(error) in TRANSIENT or isinstance(error, (
        ConnectionError, TimeoutError, auth_exceptions.TransportError,
        requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError,
        requests.exceptions.Timeout))


def _note(error: BaseException) -> None:
    with _retried_lock:
        _retried.update(error=error, at=time.monotonic())


def retry(timeout_s: float = 120.0, initial_s: float = 1.0, maximum_s: float = 32.0,
          on_error: Callable[[BaseException], None] | None = None) -> Any:
    """The retry policy of a request: :func:`transient` errors, backoff from ``initial_s``
    doubling to ``maximum_s``, ``timeout_s`` in all (defaults: google-cloud-storage's),
    each retried error noted for :func:`retry_reason` (and passed to ``on_error``)."""
    from google.api_core.retry import Retry

    def noted(error: BaseException) -> None:
        _note(error)
        if on_error is not None:
            on_error(error)

    return Retry(predicate=transient, initial=initial_s, maximum=maximum_s, multiplier=2.0,
                 timeout=timeout_s, on_error=noted)


@functools.cache
def default_retry() -> Any:
    """:func:`retry` with its defaults, made once: the policy of every request but the
    start check's (checkpoint steps, the lease, telemetry's appended objects)."""
    return retry()


def retry_reason() -> str | None:
    """What the bucket's client retried last, within :data:`RETRY_SAID_S` ("the bucket
    answered 503 (Service Unavailable); its client retries"), or None."""
    with _retried_lock:
        error, at = _retried.get("error"), _retried.get("at")
    if error is None or time.monotonic() - at > RETRY_SAID_S:
        return None
    code = status(error)
    answer = (f"answered {code} ({HTTPStatus(code).phrase})" if code in TRANSIENT
              else f"did not answer ({type(error).__name__})")
    return f"the bucket {answer}; its client retries"


def split_url(url: str) -> tuple[str, str]:
    """``gs://BUCKET/PATH`` -> ``("BUCKET", "PATH")`` (PATH without a leading or
    trailing ``/``; empty for the bucket's root)."""
    rest = url.split("://", 1)[1]
    bucket, _, path = rest.partition("/")
    return bucket, path.strip("/")
