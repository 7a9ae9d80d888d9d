"""The S3 fixture: a real S3 API (moto's server on loopback) and its bucket mounted as a
directory with s3fs-fuse, the way a user without a TensorFlow S3 file system writes a
workdir to S3 (docs/checkpoints.md, "Object storage").

``s3_bucket`` (session): the server and one bucket; ``.mount(name)`` mounts the bucket
at a new directory with its own empty cache (a new machine) and ``.unmount(path)`` takes
it away (the machine is gone); ``.keys(prefix)`` lists the objects S3 holds, read
through boto3, not through the mount.

Needs root, /dev/fuse, the ``s3fs`` program (Debian package s3fs; ``.ci/run`` installs
it) and ``moto[server]`` (the [test] extra). Without them the tests skip with the
reason; under ``CI=true`` they fail instead: CI must run them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.helpers import free_loopback_ports

BUCKET = "runs"
CREDENTIALS = ("test", "test")  # moto accepts any key pair


def unavailable(message: str) -> None:
    """Skips the test with ``message``; fails it under CI=true (CI must run it)."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message}\nCI=true: the S3 tests must run, not skip.")
    pytest.skip(message)


def fixture_problem() -> str | None:
    """Why this machine cannot mount a bucket, or None."""
    if os.geteuid() != 0:
        return "mounting a bucket with s3fs-fuse needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse: FUSE is not available"
    if shutil.which("s3fs") is None:
        return "no s3fs program (apt-get install s3fs; .ci/run installs it)"
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as error:
        return f"moto[server] is not installed ({error}): pip install -e '.[test]'"
    return None


class S3Bucket:
    """One bucket of a moto server on 127.0.0.1:``port`` (see the module docstring)."""

    def __init__(self, port: int, root: Path):
        self.endpoint = f"http://127.0.0.1:{port}"
        self.root = root
        self.mounts: list[Path] = []
        self.passwd = root / "passwd-s3fs"
        self.passwd.write_text(":".join(CREDENTIALS) + "\n")
        self.passwd.chmod(0o600)
        import boto3
        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                   aws_access_key_id=CREDENTIALS[0],
                                   aws_secret_access_key=CREDENTIALS[1])
        self.client.create_bucket(Bucket=BUCKET)

    def mount(self, name: str) -> Path:
        """Mounts the bucket at a new directory ``name`` (an empty s3fs cache)."""
        path = self.root / name
        path.mkdir()
        subprocess.run(["s3fs", BUCKET, str(path), "-o",
                        f"passwd_file={self.passwd},url={self.endpoint},use_path_request_style,"
                        f"allow_other"], check=True, timeout=60)
        self.mounts.append(path)
        return path

    def unmount(self, path: Path) -> None:
        subprocess.run(["umount", str(path)], check=True, timeout=60)
        self.mounts.remove(path)

    def keys(self, prefix: str) -> list[str]:
        """The object keys under ``prefix`` in the bucket, asked of S3 itself."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                      Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]


@pytest.fixture(scope="session")
def s3_bucket() -> Iterator[S3Bucket]:
    problem = fixture_problem()
    if problem:
        unavailable(problem)
    (port,) = free_loopback_ports(1)
    root = Path(tempfile.mkdtemp(prefix="s3-tests-"))
    log = open(root / "moto.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
    bucket = None
    try:
        deadline = time.monotonic() + 60
        while bucket is None:
            try:
                bucket = S3Bucket(port, root)
            except Exception:  # noqa: BLE001 - the server is still starting
                if server.poll() is not None or time.monotonic() > deadline:
                    unavailable(f"moto's S3 server did not start: see {root / 'moto.log'}")
                time.sleep(0.3)
        yield bucket
    finally:
        for path in list(bucket.mounts if bucket else []):
            subprocess.run(["umount", "-l", str(path)], check=False, timeout=60)
        server.terminate()
        server.wait(timeout=30)
        log.close()
