"""What every cluster engine shares: host lists, their safety, task commands.

* :func:`parse_hosts` / :func:`check_private_hosts`: ``--hosts`` entries, and refusing
  public addresses (:data:`SECURITY_NOTE`) unless the user allows them;
* :func:`cluster_from_addresses`: tasks assigned to addresses in order (chief first,
  evaluator last);
* :func:`trainer_command` / :func:`evaluator_command`: what a training task and the
  evaluator run.

The engines themselves: :mod:`launch.local_group` (this machine), :mod:`launch.hosts`
(one launcher per host, and per-host TF_CONFIGs), :mod:`launch.slurm`,
:mod:`launch.tfjob`.

Security: TensorFlow's worker-to-worker gRPC has no authentication and no encryption;
anyone who reaches a worker's port can run ops in it. :func:`check_private_hosts`
refuses host addresses that are public unless the caller explicitly allows them.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import socket
from typing import Sequence

from tf_cluster.tf_config import TFConfigError, parse_address

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


def trainer_command(module: str, trainer_flags: Sequence[str], python: str = "python") -> list[str]:
    """The argv that runs ``module`` as a multi-worker task with ``trainer_flags``."""
    return [python, "-m", module, *trainer_flags, "--config.distribute.strategy=multi_worker"]


def evaluator_command(module: str, trainer_flags: Sequence[str], python: str = "python") -> list[str]:
    """The argv of the evaluator task: ``module`` with ``trainer_flags`` in
    ``--mode=continuous_eval`` (it watches the workdir's checkpoints and evaluates each).

    No ``--config.distribute.strategy=multi_worker``: the evaluator uses one device and
    does not join the training collectives.
    """
    return [python, "-m", module, *trainer_flags, "--mode=continuous_eval"]
