"""Cluster outputs for existing schedulers: per-host TF_CONFIG, a SLURM script, a TFJob.

The launcher does not schedule anything on other machines. For a real cluster it
prints what an existing engine needs:

* :func:`emit_tf_config`: one TF_CONFIG per host of ``--hosts`` (a JSON object keyed by
  task name, one task per line), for hosts you start yourself;
* :func:`emit_slurm`: an sbatch script; each SLURM task derives its TF_CONFIG from the
  job's environment (``python -m launch.tf_config --from_slurm``) and execs the trainer;
* :func:`emit_tfjob`: a Kubeflow ``TFJob`` manifest (the training operator sets
  TF_CONFIG in every pod). It is JSON, which is valid YAML: ``kubectl apply -f`` takes it.

Security: TensorFlow's worker-to-worker gRPC has no authentication and no encryption;
anyone who reaches a worker's port can run ops in it. :func:`check_private_hosts`
refuses host addresses that are public unless the caller explicitly allows them.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import json
import shlex
import socket
from typing import Sequence

from launch.tf_config import TFConfigError, build_tf_config, cluster_tasks, parse_address, task_name

SECURITY_NOTE = (
    "TensorFlow's worker-to-worker gRPC has no authentication and no encryption: run the "
    "workers on a private network (or a VPN) that nobody else can reach."
)
_RESOLVE_TIMEOUT_S = 2.0


class ClusterError(ValueError):
    """A cluster description is invalid or unsafe; the message says what to change."""


def parse_hosts(text: str, default_port: int) -> list[str]:
    """Parses ``"h1:p,h2,..."`` into ``host:port`` addresses (``default_port`` when absent)."""
    addresses = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise ClusterError(f"--hosts={text!r} has an empty entry; use 'h1:port,h2:port,...'.")
        if item.count(":") == 0 or (item.startswith("[") and item.endswith("]")):
            item = f"{item}:{default_port}"
        try:
            parse_address(item, where=f"--hosts entry {item!r}")
        except TFConfigError as error:
            raise ClusterError(str(error)) from None
        addresses.append(item)
    return addresses


def _resolve(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


def check_private_hosts(addresses: Sequence[str], allow_public: bool = False) -> list[str]:
    """Refuses public addresses; returns warnings for hosts that could not be checked.

    An address is accepted when it (or every IP its hostname resolves to, looked up with
    a short bound) is not globally routable: loopback, RFC 1918 / ULA private, link-local
    or shared (100.64/10). ``0.0.0.0`` / ``::`` are refused: peers cannot connect to them.

    Raises:
      ClusterError: for a public address unless ``allow_public``, or an unspecified one.
    """
    hosts = [parse_address(a)[0] for a in addresses]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts))))
    futures = {host: pool.submit(_resolve, host) for host in dict.fromkeys(hosts)}
    warnings = []
    try:
        for host, future in futures.items():
            try:
                ips = future.result(timeout=_RESOLVE_TIMEOUT_S)
            except (OSError, concurrent.futures.TimeoutError):
                warnings.append(f"cannot check that host {host!r} is on a private network (it "
                                f"does not resolve here); make sure it is.")
                continue
            if any(ip.is_unspecified for ip in ips):
                raise ClusterError(f"--hosts has {host!r}, which no peer can connect to; give "
                                   f"each host's real private address.")
            public = [str(ip) for ip in ips if ip.is_global]
            if public and not allow_public:
                raise ClusterError(
                    f"--hosts has {host!r} ({', '.join(public)}), a public address. "
                    f"{SECURITY_NOTE} Use the hosts' private addresses, or pass "
                    f"--allow_public_bind if the network is protected in another way."
                )
            if public:
                warnings.append(f"host {host!r} is public ({', '.join(public)}) and "
                                f"--allow_public_bind was given. {SECURITY_NOTE}")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return warnings


def cluster_from_addresses(
    addresses: Sequence[str], chief: bool = False, evaluator: bool = False
) -> dict[str, list[str]]:
    """Assigns tasks to addresses in order: the chief first (with ``chief``), the
    evaluator last (with ``evaluator``), workers in between."""
    addresses = list(addresses)
    if len(addresses) < 1 + int(evaluator):
        raise ClusterError(f"{len(addresses)} host(s) cannot hold a training task and an "
                           f"evaluator; give at least {1 + int(evaluator)} hosts.")
    cluster: dict[str, list[str]] = {}
    if evaluator:
        evaluator_address = addresses.pop()
    if chief:
        cluster["chief"] = [addresses.pop(0)]
    if addresses:
        cluster["worker"] = addresses
    if evaluator:
        cluster["evaluator"] = [evaluator_address]
    return cluster


def emit_tf_config(cluster: dict[str, list[str]]) -> str:
    """One TF_CONFIG per task: a JSON object keyed by task name, one task per line."""
    lines = [
        f"  {json.dumps(task_name(kind, index))}: "
        f"{json.dumps(build_tf_config(cluster, kind, index))}"
        for kind, index, _ in cluster_tasks(cluster)
    ]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def trainer_command(module: str, trainer_flags: Sequence[str], python: str = "python") -> list[str]:
    """The argv that runs ``module`` as a multi-worker task with ``trainer_flags``."""
    return [python, "-m", module, *trainer_flags, "--config.distribute.strategy=multi_worker"]


def emit_slurm(
    num_tasks: int, trainer_flags: Sequence[str], port: int = 12345, chief: bool = False,
    job_name: str = "tf-trainer", module: str = "trainer.main",
) -> str:
    """An sbatch script for ``num_tasks`` training tasks, one per node.

    Each task runs ``python -m launch.tf_config --from_slurm ... -- python -m MODULE
    FLAGS``: TF_CONFIG comes from SLURM_PROCID / SLURM_JOB_NODELIST (expanded by
    ``scontrol show hostnames``) and every task listens on ``port``. ``srun
    --kill-on-bad-exit=1`` ends the job step when one task fails.
    """
    if num_tasks < 1:
        raise ClusterError(f"--workers={num_tasks} must be >= 1.")
    tf_config_cmd = ["python", "-m", "launch.tf_config", "--from_slurm", f"--port={port}"]
    if chief:
        tf_config_cmd.append("--chief")
    command = shlex.join(["srun", "--kill-on-bad-exit=1", *tf_config_cmd, "--",
                          *trainer_command(module, trainer_flags)])
    return "\n".join([
        "#!/bin/bash",
        "# Generated by `python -m launch.multiworker --emit slurm`. Add your site's",
        "# #SBATCH lines (partition, time, --gres=gpu:N, ...) right after the generated",
        "# ones: sbatch reads them only above the first command.",
        f"# {SECURITY_NOTE}",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={num_tasks}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={job_name}-%j.out",
        "set -euo pipefail",
        command,
        "",
    ])


def emit_tfjob(
    num_tasks: int, trainer_flags: Sequence[str], image: str, chief: bool = False,
    evaluator: bool = False, name: str = "tf-trainer", module: str = "trainer.main",
    backoff_limit: int = 0,
) -> str:
    """A Kubeflow ``TFJob`` manifest (JSON, valid YAML) for ``num_tasks`` training tasks.

    With ``chief`` one of them is the ``Chief`` replica and ``num_tasks - 1`` are
    ``Worker`` replicas; ``evaluator`` adds one ``Evaluator``. The operator sets
    TF_CONFIG in each pod. Pods restart on retryable exit codes (``ExitCode`` policy:
    signals such as preemption) up to ``backoff_limit`` times.
    """
    if num_tasks < 1:
        raise ClusterError(f"--workers={num_tasks} must be >= 1.")
    if not image:
        raise ClusterError("--emit tfjob needs --image: the container image with this package "
                           "and your model installed.")
    command = trainer_command(module, trainer_flags)

    def replica(count: int) -> dict:
        return {
            "replicas": count,
            "restartPolicy": "ExitCode",
            "template": {"spec": {"containers": [
                {"name": "tensorflow", "image": image, "command": command}
            ]}},
        }

    specs = {}
    if chief:
        specs["Chief"] = replica(1)
    if num_tasks - int(chief):
        specs["Worker"] = replica(num_tasks - int(chief))
    if evaluator:
        specs["Evaluator"] = replica(1)
    manifest = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": {"name": name, "annotations": {"tf-trainer/security": SECURITY_NOTE}},
        "spec": {
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": backoff_limit},
            "tfReplicaSpecs": specs,
        },
    }
    return json.dumps(manifest, indent=2) + "\n"
