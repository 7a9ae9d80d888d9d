"""What the gs:// workdir tests share: the trainer's command on a simulated host with the
workdir in the emulator's bucket, the objects a run left there, and the one-line error.

* :func:`trainer_argv` is ``python -m trainer.main`` of a config (default: the digits
  demo, ``models/configs/digits.py``) with ``--workdir=gs://BUCKET/PREFIX``.
* :func:`start` runs it on a host with :meth:`tests.cluster.gcs.GcsEmulator.client_env`
  and extra environment, read line by line (:class:`tests.cluster.hosts.Watched`).
* :func:`fetch` lists and downloads what is under a prefix (through a host).
* :func:`one_error_line` asserts an output ends in exactly one ``Workdir error:`` line
  and holds no traceback, and returns that line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from tests.cluster.gcs import BUCKET, GcsEmulator
from tests.cluster.hosts import Host, SimulatedCluster, Watched
from tests.support.helpers import REPO

DIGITS = REPO / "models" / "configs" / "digits.py"
RUN_S = 300  # bound for one short run on 2 shared cores (TensorFlow's start is most of it)


def bucket_url(prefix: str, bucket: str = BUCKET) -> str:
    return f"gs://{bucket}/{prefix}"


def trainer_argv(workdir: str, *flags: str, config: Path = DIGITS) -> list[str]:
    return ["python", "-m", "trainer.main", f"--config={config}", f"--workdir={workdir}", *flags]


def start(cluster: SimulatedCluster, gcs: GcsEmulator, host: int | str | Host,
          argv: Sequence[str], env: Mapping[str, str] | None = None) -> Watched:
    """``argv`` on ``host`` with the emulator's client environment (plus ``env``)."""
    return Watched(cluster.popen(host, list(argv), env={**gcs.client_env(), **(env or {})}))


def one_error_line(output: str, prefix: str = "Workdir error: ") -> str:
    """The output's last line, asserted to be its only line starting with ``prefix``,
    with no traceback anywhere in the output."""
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(prefix), output[-3000:]
    assert sum(line.startswith(prefix) for line in lines) == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    return lines[-1]

def fetch(cluster: SimulatedCluster, gcs: GcsEmulator, prefix: str, dest: Path,
          host: int | str = 0) -> list[str]:
    """Downloads every object under ``gs://BUCKET/prefix/`` into ``dest`` (through
    google-cloud-storage on ``host``: only the hosts reach the emulator); returns the
    object names relative to ``prefix``."""
    script = ("import sys, pathlib\n"
              "from google.cloud import storage\n"
              "bucket, prefix, dest = sys.argv[1:]\n"
              "for blob in storage.Client().list_blobs(bucket, prefix=prefix + '/'):\n"
              "    name = blob.name[len(prefix) + 1:]\n"
              "    print(name)\n"
              "    if name and not name.endswith('/'):\n"
              "        (pathlib.Path(dest) / name).parent.mkdir(parents=True, exist_ok=True)\n"
              "        blob.download_to_filename(str(pathlib.Path(dest) / name))\n")
    result = cluster.run(host, ["python", "-c", script, BUCKET, prefix, dest],
                         env=gcs.client_env(), timeout=120)
    return result.stdout.split()
