"""A gs:// workdir's start check, for what needs no bucket: the missing package and the
missing credentials are one line each, found without TensorFlow. The answers of a real
bucket (404, 403, no route, 5xx) are tests/cluster/test_gcs_faults.py."""

from __future__ import annotations

import subprocess
import sys

from google.auth.exceptions import DefaultCredentialsError

from tests.support.helpers import REPO
from trainer.checks.bucket import bucket_problem
from trainer.runtime.gcs import split_url


def no_package():
    raise ImportError("cannot import name 'storage' from 'google.cloud'")


def no_credentials():
    raise DefaultCredentialsError("Your default credentials were not found.")


def test_a_missing_google_cloud_storage_is_one_line_naming_the_extra():
    line = bucket_problem("gs://runs/digits", "--workdir", client_factory=no_package)
    assert line.startswith("--workdir=gs://runs/digits needs the Python package "
                           "google-cloud-storage"), line
    assert "pip install 'tf-trainer[gcs]'" in line and "\n" not in line


def test_missing_credentials_are_one_line_saying_how_to_give_them():
    line = bucket_problem("gs://runs/digits", "--config.data.data_dir", client_factory=no_credentials)
    assert line.startswith("--config.data.data_dir=gs://runs/digits: no Google Cloud "
                           "credentials were accepted for gs://runs"), line
    assert "gcloud auth application-default login" in line and "\n" not in line


def test_the_package_check_imports_no_tensorflow():
    code = ("import sys\n"
            "from trainer.checks.bucket import bucket_problem\n"
            "def factory():\n"
            "    raise ImportError('no google-cloud-storage')\n"
            "print(bucket_problem('gs://b/run', '--workdir', client_factory=factory))\n"
            "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    line, imported = out.stdout.strip().splitlines()
    assert "needs the Python package google-cloud-storage" in line and imported == "[]"


def test_a_gs_url_splits_into_bucket_and_path():
    assert split_url("gs://runs/a/b/") == ("runs", "a/b")
    assert split_url("gs://runs") == ("runs", "")
