"""Where a path lives (``tf_cluster.storage_schemes``) and the one retry policy of every
request to a bucket (``trainer.runtime.gcs``), without a bucket: what each question
answers, which errors are retried, and what a wait says about them."""

from __future__ import annotations

import os

import pytest
import requests
from google.api_core import exceptions

from tf_cluster.storage_schemes import absolute, is_bucket, is_local
from trainer.runtime import gcs


@pytest.mark.parametrize("path, bucket, local", [
    ("gs://b/run", True, False),
    ("GS://b/run", True, False),  # a scheme is case-insensitive
    ("ram://run", False, False),  # TensorFlow's memory file system: not a local path either
    ("s3://b/run", False, False),
    ("/tmp/run", False, True),
    ("runs/a", False, True),
    ("", False, False),
    (None, False, False),
])
def test_is_bucket_and_is_local_answer_the_two_questions_apart(path, bucket, local):
    assert (is_bucket(path), is_local(path)) == (bucket, local)


def test_absolute_resolves_local_paths_only():
    assert absolute("runs/a") == os.path.join(os.getcwd(), "runs", "a")
    assert absolute("gs://b/run") == "gs://b/run"
    assert absolute("ram://run") == "ram://run"


@pytest.mark.parametrize("error, retried", [
    (exceptions.ServiceUnavailable("down"), True),
    (exceptions.TooManyRequests("slow down"), True),
    (exceptions.from_http_status(408, "timed out"), True),
    (requests.exceptions.ConnectionError("reset"), True),
    (requests.exceptions.ChunkedEncodingError("cut"), True),
    (TimeoutError(), True),
    (exceptions.NotFound("no such object"), False),
    (exceptions.Forbidden("not yours"), False),
    (exceptions.PreconditionFailed("generation moved"), False),
    (ValueError("a bug"), False),
])
def test_only_what_gcs_says_is_transient_is_retried(error, retried):
    assert gcs.transient(error) is retried


def test_a_wait_says_what_the_policy_retried_last():
    seen = []
    policy = gcs.retry(timeout_s=0.3, initial_s=0.01, maximum_s=0.01, on_error=seen.append)
    answers = iter([exceptions.ServiceUnavailable("down"), None])

    def request():
        answer = next(answers)
        if answer is not None:
            raise answer
        return "listed"

    assert policy(request)() == "listed"
    assert len(seen) == 1
    assert gcs.retry_reason() == ("the bucket answered 503 (Service Unavailable); its "
                                  "client retries")


def test_the_default_policy_is_made_once():
    assert gcs.default_retry() is gcs.default_retry()


def test_split_url_names_the_bucket_and_the_path():
    assert gcs.split_url("gs://runs/a/b/") == ("runs", "a/b")
    assert gcs.split_url("gs://runs") == ("runs", "")
