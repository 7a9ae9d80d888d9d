"""The local group: every task of the cluster on this machine, over loopback.

``python -m launch.multiworker --workers N [--chief] [--evaluator]
[--data_service_workers K] ...`` (see :mod:`launch.multiworker` for the flags). Each
(re)start picks free 127.0.0.1 ports, so a port taken between the pick and TensorFlow's
bind restarts the group on new ports without counting as a restart.
"""

from __future__ import annotations

import argparse
import socket
from typing import Callable, Sequence

from launch import data_service
from launch.cluster import cluster_from_addresses
from launch.group import RestartPolicy, preflight, resume_note, run_with_restarts, task_specs
from launch.supervision import TaskSpec
from tf_cluster.tf_config import cluster_tasks, task_name

_PORT_RETRIES = 3
LOOPBACK = "127.0.0.1"


def pick_free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Returns ``count`` distinct ports that were free on ``host`` a moment ago.

    All sockets are held open until every port is picked, so the ports are distinct;
    another process may still take one before the task binds it (the group then retries
    on new ports).
    """
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def local_cluster(workers: int, chief: bool, evaluator: bool, ports: Sequence[int]) -> dict:
    """The cluster dict of a local group on 127.0.0.1 ``ports`` (chief, workers, evaluator)."""
    addresses = [f"{LOOPBACK}:{port}" for port in ports]
    if len(addresses) != workers + int(evaluator):
        raise ValueError(f"need {workers + int(evaluator)} ports, got {len(addresses)}.")
    return cluster_from_addresses(addresses, chief=chief, evaluator=evaluator)


def _builder(args: argparse.Namespace, log: Callable[[str], None],
             pick_ports: Callable[[int], list[int]]) -> Callable[[], list[TaskSpec]]:
    """What one (re)start of the local group runs, on newly picked ports."""

    def build() -> list[TaskSpec]:
        service = int(args.data_service_workers > 0)
        ports = pick_ports(args.workers + int(args.evaluator) + service)
        cluster = local_cluster(args.workers, args.chief, args.evaluator, ports[service:])
        flags = list(args.trainer_flags)
        if service:
            flags.append(f"{data_service.SERVICE_FLAG}={data_service.address(ports[0])}")
        specs = task_specs(cluster, args.module, flags, args.collective_timeout_s)
        log(f"[launcher] starting {len(specs)} task(s) on {LOOPBACK}: " + ", ".join(
            f"{task_name(k, i)}={a.rsplit(':', 1)[1]}" for k, i, a in cluster_tasks(cluster)))
        if service:
            specs += data_service.service_specs(ports[0], args.data_service_workers, True)
            log(f"[launcher] tf.data service: dispatcher at {data_service.address(ports[0])}, "
                f"{args.data_service_workers} worker(s), stopped with the group")
        return specs

    return build


def run_local_group(args: argparse.Namespace, stop: Callable[[], int | None],
                    log: Callable[[str], None],
                    pick_ports: Callable[[int], list[int]] | None = None) -> int:
    """Runs the local group with restarts; returns the launcher's exit status.

    ``pick_ports(count)`` picks the ports of one (re)start (default
    :func:`pick_free_ports` on 127.0.0.1).
    """
    checked = preflight(args.module, args.trainer_flags, log)
    if checked:
        return checked
    build = _builder(args, log, pick_ports or pick_free_ports)
    policy = RestartPolicy(max_restarts=args.max_restarts, port_retries=_PORT_RETRIES)
    return run_with_restarts(build, args.bounds, policy, stop, log,
                             resume_note(args.trainer_flags))
