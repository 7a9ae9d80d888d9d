"""Is a ``gs://`` bucket there and ours? Asked once at start, within a bound, without
TensorFlow.

TensorFlow's GCS client retries a failing request with backoff for minutes (10 tries,
1 s doubling to 32 s: 203 s measured against a bucket with no route to it) before the
first checkpoint fails with a traceback. :func:`bucket_problem` asks instead, before
TensorFlow is imported, through google-cloud-storage (which orbax needs anyway to find
the bucket: it is the first thing missing on a machine without the ``[gcs]`` extra):
it lists at most one object under the path (``storage.objects.list``, the permission
every use of the workdir needs; ``storage.buckets.get`` is not needed) and turns the
answer into one line naming the bucket and what to check:

* the package missing (google-cloud-storage, or tensorstore which orbax writes arrays
  with): which extra to install;
* no credentials (401, or none found): how to provide them;
* 404: the bucket does not exist; 403: the account may not use it;
* nothing answers within the bound (no route, a firewall, a cut cable; 5xx answers that
  retries did not get past): the last error seen and how to wait longer.

The bound is :data:`DEFAULT_CHECK_S` seconds (``TRAINER_BUCKET_CHECK_S`` changes it):
the call runs in a daemon thread, retried with backoff (the process's one retry policy,
:mod:`trainer.runtime.gcs`: connection errors, 408, 429 and 5xx; from 0.5 s to 4 s here)
up to the bound, and is abandoned when the bound passes. TensorFlow's own retry policy
(``GCS_RETRY_CONFIG_*``) is left as it is: during training, a long outage is better
waited out than failed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import threading
from typing import Any, Callable

from trainer.runtime import gcs

DEFAULT_CHECK_S = 30.0
CHECK_S_ENV = "TRAINER_BUCKET_CHECK_S"
_REQUEST_TIMEOUT_S = (5.0, 10.0)  # connect, read: one try; retries fill the bound
_CONNECTION_REASON = re.compile(r"(Failed to establish a new connection|Connection to \S+ timed "
                                r"out|Read timed out)[^'\")]*")


def check_seconds() -> float:
    """The bound of :func:`bucket_problem`: ``TRAINER_BUCKET_CHECK_S`` or the default."""
    try:
        return max(1.0, float(os.environ.get(CHECK_S_ENV) or DEFAULT_CHECK_S))
    except ValueError:
        return DEFAULT_CHECK_S


def bucket_problem(url: str, what: str, *, timeout_s: float | None = None,
                   client_factory: Callable[[], Any] = gcs.client) -> str | None:
    """None when ``url`` (``gs://BUCKET/PATH``) can be listed within ``timeout_s``
    (default :func:`check_seconds`); otherwise one line (see the module docstring)
    starting with ``what=url`` (e.g. ``--workdir=gs://b/run``). ``client_factory``
    returns the google-cloud-storage client to ask."""
    bucket, path = gcs.split_url(url)
    where = f"{what}={url}"
    if importlib.util.find_spec("tensorstore") is None:
        return _missing(where, "tensorstore")
    timeout_s = check_seconds() if timeout_s is None else timeout_s
    outcome: dict[str, BaseException | None] = {}
    retried: list[BaseException] = []
    worker = threading.Thread(target=_list_one, daemon=True, name="bucket-check",
                              args=(client_factory, bucket, path, timeout_s, outcome, retried))
    worker.start()
    worker.join(timeout_s)
    if "listed" in outcome:
        return None
    if "missing" in outcome:
        return _missing(where, "google-cloud-storage")
    if "credentials" in outcome:
        return _no_credentials(where, bucket, outcome["credentials"])
    if "error" in outcome:
        return _explain(where, bucket, outcome["error"], timeout_s)
    last = f" (last error: {_short(retried[-1])})" if retried else ""
    return (f"{where}: the bucket gs://{bucket} could not be reached within "
            f"{timeout_s:.0f} s{last}. Check this machine's route to "
            f"storage.googleapis.com (network, firewall, proxy); {CHECK_S_ENV}=SECONDS "
            f"waits longer.")


def _list_one(client_factory: Callable[[], Any], bucket: str, path: str, timeout_s: float,
              outcome: dict[str, BaseException | None], retried: list[BaseException]) -> None:
    """In the checking thread: lists one object of ``gs://bucket/path``; sets one key of
    ``outcome``: ``listed``, ``missing`` (no google-cloud-storage), ``credentials`` or
    ``error`` (the final error); each retried error is appended to ``retried``."""
    try:
        client = client_factory()
    except ImportError as error:
        outcome["missing"] = error
        return
    except Exception as error:  # noqa: BLE001 (every failure becomes the one line)
        from google.auth import exceptions as auth_exceptions

        kind = "credentials" if isinstance(error, auth_exceptions.DefaultCredentialsError) else "error"
        outcome[kind] = error
        return
    from google.api_core import exceptions

    try:
        policy = gcs.retry(timeout_s, initial_s=0.5, maximum_s=4.0, on_error=retried.append)
        list(client.list_blobs(bucket, prefix=f"{path}/" if path else None, max_results=1,
                               timeout=_REQUEST_TIMEOUT_S, retry=policy))
        outcome["listed"] = None
    except exceptions.RetryError:
        return  # the bound passed while retrying: no answer (the last error is in retried)
    except Exception as error:  # noqa: BLE001 (every failure becomes the one line)
        outcome["error"] = error


def _explain(where: str, bucket: str, error: BaseException, timeout_s: float) -> str:
    """The one line for the final ``error`` of the check."""
    code = getattr(error, "code", None)
    if code == 401:
        return _no_credentials(where, bucket, error)
    if code == 404:
        return (f"{where}: the bucket gs://{bucket} does not exist (404). Check its name, "
                f"or create it: gcloud storage buckets create gs://{bucket}")
    if code == 403:
        return (f"{where}: this account may not use the bucket gs://{bucket} (403: "
                f"{_short(error)}). Grant it roles/storage.objectAdmin on the bucket, or "
                f"check which credentials are in use (GOOGLE_APPLICATION_CREDENTIALS, "
                f"gcloud auth application-default login).")
    return (f"{where}: the bucket gs://{bucket} did not answer within {timeout_s:.0f} s "
            f"({_short(error)}). Check this machine's route to storage.googleapis.com and "
            f"the bucket's status; {CHECK_S_ENV}=SECONDS waits longer.")


def _no_credentials(where: str, bucket: str, error: BaseException) -> str:
    return (f"{where}: no Google Cloud credentials were accepted for gs://{bucket} "
            f"({_short(error)}). Run `gcloud auth application-default login`, or set "
            f"GOOGLE_APPLICATION_CREDENTIALS to a service account key; on a Cloud VM or "
            f"TPU, give the VM a service account with access to the bucket.")


def _missing(where: str, package: str) -> str:
    return (f"{where} needs the Python package {package} (orbax writes checkpoints to "
            f"buckets through google-cloud-storage and tensorstore), which is not "
            f"installed. Install it: pip install 'tf-trainer[gcs]'")


def _short(error: BaseException) -> str:
    """The error's first line (an API error's message, without the request's URL), at
    most 200 characters."""
    text = str(getattr(error, "message", None) or error).strip()
    text = text.splitlines()[0] if text else type(error).__name__
    reason = _CONNECTION_REASON.search(text)  # urllib3's reason inside requests' wrapping
    text = reason.group(0) if reason else text
    return text if len(text) <= 200 else text[:197] + "..."
