"""Clusters of named hosts: the per-host launcher, and per-task TF_CONFIGs to print.

Per-host launcher, run once on every host (host order = task order)::

    python -m launch.multiworker --hosts ADDR0,ADDR1,... --node_rank I \\
        --tasks_per_node K [--port P] [--chief] [--evaluator] [--data_service_workers S] \\
        TRAINER_FLAGS

Host ``n`` (its place in ``--hosts``) runs training tasks ``n*K .. n*K+K-1`` of the
whole cluster on ports ``P .. P+K-1`` of its address (an entry ``ADDR:Q`` uses base port
Q instead of ``--port``, e.g. for several "hosts" on one machine's loopback addresses):
task 0 of host 0 is ``chief:0`` with ``--chief``, else ``worker:0``. ``--evaluator`` puts
the evaluator on the last host at port ``P+K``; ``--data_service_workers S`` starts the
tf.data service dispatcher (port ``P+K+1``) and S service workers on host 0 and passes
``--config.data.service=ADDR0:P+K+1`` to every host's tasks. Every launcher builds the
same TF_CONFIG cluster from the same flags, so the hosts need no other coordination.

Before starting, the launcher checks that its own address is on this machine and that
its ports are free (naming the process that holds one). Then it supervises its tasks as
the local group does (:mod:`launch.group`). When a task ends because a peer was lost
(it exits :data:`~tf_cluster.exit_codes.EXIT_PEER_LOST`, or prints ``Lost peer:
TASK``), the launcher stops its other tasks and its last line names the lost task and
its host; when the task's output names none, the launcher probes the other hosts'
task ports and names those that no longer answer.

``--hosts ... --emit tf_config`` (without ``--node_rank``) instead prints one TF_CONFIG
per task, one task per ``--hosts`` entry, for hosts started some other way
(:func:`emit_tf_config`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import re
import socket
from typing import Callable, Sequence

from launch import data_service
from launch.cluster import ClusterError, cluster_from_addresses, parse_hosts
from launch.group import (RestartPolicy, StartError, preflight, resume_note,
                          run_with_restarts, task_specs)
from launch.supervision import GroupResult, TaskSpec
from tf_cluster.exit_codes import EXIT_PEER_LOST
from tf_cluster.ports import port_bindable, port_holder, probe_address
from tf_cluster.tf_config import (build_tf_config, cluster_tasks, format_address, parse_address,
                                  task_name)

DEFAULT_PORT = 23456
_PROBE_TIMEOUT_S = 1.0
# What a task prints when it stops because a peer was lost: the trainer's one line
# ("Lost peer: worker:2 (10.0.0.2:23456) ..."), or TensorFlow's own coordination-service
# report, whose lost tasks follow on lines of their own:
#   "... The following tasks are unhealthy (stopped sending heartbeats):"
#   "/job:worker/replica:0/task:2"
LOST_PEER_LINE = re.compile(rb"Lost peer: |unhealthy|stopped sending heartbeats|"
                            rb"^/job:[a-z]+/replica:\d+/task:\d+\s*$")
_NAMED_TASK = re.compile(r"Lost peer: ([a-z]+):(\d+)|/job:([a-z]+)/replica:\d+/task:(\d+)")


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """Where every task of a per-host cluster runs.

    ``hosts``: the hosts in ``--hosts`` order (address only); ``cluster``: the TF_CONFIG
    cluster every host builds; ``node_of``: task name -> the index of its host;
    ``node_rank``: this host; ``dispatcher``: the tf.data service address, or None.
    """

    hosts: tuple[str, ...]
    base_ports: tuple[int, ...]
    node_rank: int
    tasks_per_node: int
    cluster: dict[str, list[str]]
    node_of: dict[str, int]
    dispatcher: str | None = None

    @property
    def local_tasks(self) -> list[str]:
        """The names of this host's tasks, in cluster order."""
        return [name for name, node in self.node_of.items() if node == self.node_rank]

    @property
    def host_addresses(self) -> list[str]:
        """``host:base_port`` of every host, in ``--hosts`` order."""
        return [format_address(h, p) for h, p in zip(self.hosts, self.base_ports)]

    def address_of(self, name: str) -> str:
        """The ``host:port`` of task ``name``."""
        kind, index = name.split(":")
        return self.cluster[kind][int(index)]


def host_layout(hosts: str, node_rank: int, tasks_per_node: int, port: int = DEFAULT_PORT,
                chief: bool = False, evaluator: bool = False,
                data_service_workers: int = 0) -> HostLayout:
    """The cluster of ``--hosts`` with ``tasks_per_node`` tasks each, seen from host
    ``node_rank``; see the module docstring for the placement.

    Raises:
      ClusterError: a malformed or repeated host, ``node_rank`` out of range,
        ``tasks_per_node < 1`` or ports beyond 65535.
    """
    entries = [parse_address(a) for a in parse_hosts(hosts, port)]
    names = [host.lower() for host, _ in entries]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ClusterError(
                f"--hosts lists {entries[i][0]} twice (entries {names.index(name)} and {i}); "
                f"list every host once: its launcher starts all of its --tasks_per_node tasks.")
    if not 0 <= node_rank < len(entries):
        raise ClusterError(f"--node_rank={node_rank} is out of range for {len(entries)} host(s) "
                           f"in --hosts; give this host's place in --hosts, 0..{len(entries) - 1}.")
    if tasks_per_node < 1:
        raise ClusterError(f"--tasks_per_node={tasks_per_node} must be >= 1.")
    for host, base in entries:
        if base + tasks_per_node + 1 > 65535:
            raise ClusterError(f"--hosts entry {host}: ports {base}..{base + tasks_per_node + 1} "
                               f"go beyond 65535; use a lower --port.")
    training = [format_address(h, b + i) for h, b in entries for i in range(tasks_per_node)]
    cluster = cluster_from_addresses(training, chief=chief)
    if evaluator:
        cluster["evaluator"] = [format_address(entries[-1][0], entries[-1][1] + tasks_per_node)]
    node_of = {}
    for kind, index, _ in cluster_tasks(cluster):
        position = index + (1 if kind == "worker" and chief else 0)
        node_of[task_name(kind, index)] = (len(entries) - 1 if kind == "evaluator"
                                           else position // tasks_per_node)
    dispatcher = (format_address(entries[0][0], entries[0][1] + tasks_per_node + 1)
                  if data_service_workers else None)
    return HostLayout(tuple(h for h, _ in entries), tuple(b for _, b in entries), node_rank,
                      tasks_per_node, cluster, node_of, dispatcher)


def check_this_host(layout: HostLayout) -> None:
    """Raises :class:`StartError` unless this host's address belongs to this machine and
    every port its tasks (and the tf.data service on host 0) listen on is free here."""
    host = layout.hosts[layout.node_rank]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, 0))
        except OSError as error:
            raise StartError(
                f"--hosts entry {layout.node_rank} ({host}) is not an address of this machine "
                f"({error.strerror}): run this launcher on that host, or fix --node_rank "
                f"(this host's place in --hosts).", exit_code=2) from None
    ports = [parse_address(layout.address_of(name))[1] for name in layout.local_tasks]
    if layout.dispatcher and layout.node_rank == 0:
        ports.append(parse_address(layout.dispatcher)[1])
    for port in ports:
        if not port_bindable(port):
            holder = port_holder(port)
            held = f", held by {holder}" if holder else ""
            raise StartError(
                f"port {port} of this host ({host}) is taken (Address already in use{held}); "
                f"no task was started. Stop that process, or give every launcher another "
                f"--port.")


def _named_lost_task(lines: Sequence[str], layout: HostLayout) -> str | None:
    """The peer task the failing task's last matching lines name (not one of ours)."""
    for line in reversed(lines):
        for match in _NAMED_TASK.finditer(line):
            kind, index = (match.group(1), match.group(2)) if match.group(1) else match.group(3, 4)
            name = task_name(kind, int(index))
            if name in layout.node_of and layout.node_of[name] != layout.node_rank:
                return name
    return None


def _silent_peers(layout: HostLayout) -> list[str]:
    """The tasks of other hosts whose port does not answer a TCP connect now."""
    peers = [n for n, node in layout.node_of.items() if node != layout.node_rank]
    if not peers:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(peers))) as pool:
        answers = pool.map(lambda n: probe_address(layout.address_of(n), _PROBE_TIMEOUT_S), peers)
        return [name for name, reason in zip(peers, answers) if reason is not None]


def _describe_host(layout: HostLayout, tasks: Sequence[str]) -> str:
    node = layout.node_of[tasks[0]]
    listed = ", ".join(f"{t} at {layout.address_of(t)}" for t in tasks)
    return f"host {layout.hosts[node]} (node_rank {node}: {listed})"


def explain_failure(result: GroupResult, layout: HostLayout) -> GroupResult:
    """Adds to a failed result which peer host was lost: the task its output names, or
    else (after a failure that may be a peer's loss) the peer hosts that do not answer."""
    reporter = result.failed_task or "a task"
    named = _named_lost_task(result.watched, layout)
    if named:
        reason = (f"{result.reason}; lost peer {named} on "
                  f"{_describe_host(layout, [named])}, reported by {reporter}")
        return dataclasses.replace(result, reason=reason)
    if result.failed_task is None or result.failed_task not in layout.node_of:
        return result
    silent = _silent_peers(layout)
    if silent:
        nodes = sorted({layout.node_of[t] for t in silent})
        hosts = "; ".join(_describe_host(layout, [t for t in silent if layout.node_of[t] == n])
                          for n in nodes)
        reason = f"{result.reason}; lost peer: {hosts} does not answer"
    elif result.exit_code == EXIT_PEER_LOST:
        reason = (f"{result.reason}: {reporter} reported a lost peer without naming it, and "
                  f"every peer host still answers")
    else:
        return result
    return dataclasses.replace(result, reason=reason)


def _builder(args: argparse.Namespace, layout: HostLayout,
             log: Callable[[str], None]) -> Callable[[], list[TaskSpec]]:
    host = layout.hosts[layout.node_rank]

    def build() -> list[TaskSpec]:
        check_this_host(layout)
        flags = list(args.trainer_flags)
        if layout.dispatcher:
            flags.append(f"{data_service.SERVICE_FLAG}={layout.dispatcher}")
        specs = task_specs(layout.cluster, args.module, flags, args.collective_timeout_s,
                           only=layout.local_tasks)
        log(f"[launcher] node_rank {layout.node_rank} of {len(layout.hosts)}: starting "
            f"{len(specs)} task(s) on {host}: " + ", ".join(
                f"{n}={parse_address(layout.address_of(n))[1]}" for n in layout.local_tasks))
        if layout.dispatcher and layout.node_rank == 0:
            port = parse_address(layout.dispatcher)[1]
            specs += data_service.service_specs(port, args.data_service_workers, True,
                                                host=host)
            log(f"[launcher] tf.data service: dispatcher at {layout.dispatcher}, "
                f"{args.data_service_workers} worker(s), stopped with this host's tasks")
        return specs

    return build


def run_host_group(args: argparse.Namespace, layout: HostLayout,
                   stop: Callable[[], int | None], log: Callable[[str], None]) -> int:
    """Runs this host's tasks of ``layout`` with restarts; returns the exit status."""
    checked = preflight(args.module, args.trainer_flags, log)
    if checked:
        return checked
    log("[launcher] cluster (every host builds the same): " + json.dumps(layout.cluster))
    policy = RestartPolicy(max_restarts=args.max_restarts)
    return run_with_restarts(_builder(args, layout, log), args.bounds, policy, stop, log,
                             resume_note(args.trainer_flags),
                             explain=lambda result: explain_failure(result, layout),
                             watch=LOST_PEER_LINE)


def emit_tf_config(cluster: dict[str, list[str]]) -> str:
    """One TF_CONFIG per task: a JSON object keyed by task name, one task per line."""
    lines = [
        f"  {json.dumps(task_name(kind, index))}: "
        f"{json.dumps(build_tf_config(cluster, kind, index))}"
        for kind, index, _ in cluster_tasks(cluster)
    ]
    return "{\n" + ",\n".join(lines) + "\n}\n"
