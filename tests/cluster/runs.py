"""What the tests on simulated hosts share to run things there: the config they train,
the commands they start on the hosts (the per-host launchers, ``trainer.main`` with its
workdir in the emulator's bucket, a one-shot TCP client) and what those runs leave.

The config (one definition; a test that differs passes its overrides after it):

* :data:`CONFIG` is the launcher tests' digits config (``tests/launch_helpers/weights_config.py``:
  :data:`STEPS` steps of 5 per loop, global batch 64, batch sharding, final weights
  saved by ``WeightsTrainer``), absolute (a Slurm job runs in its shared submit
  directory); :data:`CONFIG_FLAG` is its ``--config=`` flag. The gs:// workdir tests
  that need no weights train the digits demo instead (:data:`DIGITS`, the default of
  :func:`trainer_argv`).
* :data:`SLOW`: the environment that slows each input pipeline to 1 s a batch from
  batch 10 on, only in a run that finds no marker of an earlier one (the resumed run
  goes at full speed): for runs that must be interrupted mid-training.

Runs:

* :func:`per_host` starts one ``launch.multiworker --hosts ... --node_rank I`` launcher
  of :data:`CONFIG` on each host (ports from :func:`consecutive_ports`);
  :func:`finish_all` waits for them, :func:`outputs` is what to print when they failed.
* :func:`trainer_argv` is ``python -m trainer.main`` of a config with
  ``--workdir=gs://BUCKET/PREFIX`` (:func:`bucket_url`); :func:`start` runs it on a
  host with :meth:`tests.cluster.gcs.GcsEmulator.client_env` and extra environment,
  read line by line (:class:`tests.cluster.hosts.Watched`).
* :func:`fetch` lists and downloads what is under a bucket prefix (through a host).
* :func:`one_error_line` asserts an output ends in exactly one ``Workdir error:`` line
  and holds no traceback, and returns that line.
* :func:`connect` connects once from a host to an address and port (reachability).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Mapping, Sequence

from tests.cluster.gcs import BUCKET, GcsEmulator
from tests.cluster.hosts import Host, SimulatedCluster, Watched
from tests.support.helpers import REPO

CONFIG = REPO / "tests" / "launch_helpers" / "weights_config.py"
CONFIG_FLAG = f"--config={CONFIG}"
STEPS = 30  # CONFIG's train.steps
DIGITS = REPO / "models" / "configs" / "digits.py"
SLOW = {"LAUNCH_TEST_SLOW_FROM": "10:1"}  # 1 s per input batch from batch 10 on
RUN_S = 300  # bound for one short run on 2 shared cores (TensorFlow's start is most of it)
GROUP_RUN_S = 600  # bound for one launcher run (up to 4 TensorFlow processes on 2 shared cores)

# Connects once; prints the server's hostname, or "unreachable: <error>" (exit 1).
CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as c:
        print(c.recv(100).decode())
except OSError as error:
    print(f"unreachable: {error!r}")
    sys.exit(1)
"""


def connect(cluster: SimulatedCluster, host, to: str, port: int, timeout: float = 3):
    return cluster.run(host, [sys.executable, "-c", CLIENT, to, str(port), str(timeout)],
                       check=False, timeout=timeout + 30)


# ---------------------------------------------------------------- per-host launchers

def consecutive_ports(cluster: SimulatedCluster, count: int) -> int:
    """The first of ``count`` consecutive ports never handed out before."""
    ports = cluster.ports(count)
    assert ports == list(range(ports[0], ports[0] + count)), ports
    return ports[0]


def per_host(cluster: SimulatedCluster, hosts: Sequence[Host], tasks_per_node: int,
             workdir: Path, flags: Sequence[str] = (), env: dict | None = None) -> list[Watched]:
    """One ``launch.multiworker --hosts ... --node_rank I`` launcher on each of ``hosts``
    (``flags``: the launcher's or the trainer's, after ``--config``; a later ``--grace_s``
    wins)."""
    port = consecutive_ports(cluster, tasks_per_node)
    addresses = ",".join(h.address for h in hosts)
    return [Watched(cluster.popen(host, [
        "python", "-m", "launch.multiworker", "--hosts", addresses, "--node_rank", str(rank),
        "--tasks_per_node", str(tasks_per_node), "--port", str(port), "--grace_s", "5",
        CONFIG_FLAG, f"--workdir={workdir}", *flags], env=env)) for rank, host in enumerate(hosts)]


def finish_all(runs: Sequence[Watched], timeout: float = GROUP_RUN_S) -> list[int]:
    return [run.finish(timeout) for run in runs]


def outputs(runs: Sequence[Watched], per_task: int = 25) -> str:
    """Each launcher's own lines and the last ``per_task`` lines of each of its tasks."""
    parts = []
    for run in runs:
        by_source: dict[str, list[str]] = {}
        for line in run.lines:
            source = line.split("]", 1)[0] + "]" if line.startswith("[") else "?"
            by_source.setdefault(source, []).append(line)
        parts.append(f"--- {run.where}:\n" + "\n".join(
            "\n".join(lines if source == "[launcher]" else lines[-per_task:])
            for source, lines in by_source.items()))
    return "\n\n".join(parts)


# ---------------------------------------------------------------- gs:// workdirs

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
