"""Build, validate and check ``TF_CONFIG``, the cluster description of a multi-worker run.

``TF_CONFIG`` is a JSON object in each process's environment::

    {"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"],
                 "evaluator": ["h3:2222"]},
     "task": {"type": "worker", "index": 1},
     "rpc_layer": "grpc"}

Every process of a cluster gets the same ``cluster`` and its own ``task``. This module
owns the format: :func:`build_tf_config` makes one, :func:`validate_tf_config` rejects a
broken one with a message that names the field and the fix (``trainer/distribute.py``
calls it before creating ``MultiWorkerMirroredStrategy``), :func:`tf_config_from_slurm`
derives one from a SLURM job's environment.

Command line::

    python -m launch.tf_config --check          # what this process will be; do peers answer?
    python -m launch.tf_config --from_slurm --port 12345 [--tasks_per_node N] [--chief]
    python -m launch.tf_config --from_slurm --port 12345 [...] -- CMD ARGS...  # exec CMD

``--from_slurm`` derives TF_CONFIG from the SLURM step (local task i of a node listens on
``port + i``) and, with several tasks per node on a GPU node, gives each task its own
GPU(s) through ``CUDA_VISIBLE_DEVICES`` (see :func:`slurm_visible_gpus`).

``--check`` exits 0 when TF_CONFIG is valid and every peer's port answers, 3 when it is
valid but some peer does not answer (not started yet, wrong address or a firewall), and
1 when TF_CONFIG is unset or invalid. This module never imports TensorFlow.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from typing import Any, Mapping, Sequence

import psutil

TASK_TYPES = ("chief", "worker", "evaluator", "ps")
TRAINING_TASK_TYPES = ("chief", "worker")
_SINGLETON_TASK_TYPES = ("chief", "evaluator")
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")


class TFConfigError(ValueError):
    """TF_CONFIG (or a cluster description) is invalid; the message says what to fix."""


def task_name(task_type: str, task_index: int) -> str:
    """The name a task is known by in logs and outputs, e.g. ``"worker:1"``."""
    return f"{task_type}:{task_index}"


def parse_address(address: Any, where: str = "address") -> tuple[str, int]:
    """Splits ``"host:port"`` (or ``"[v6]:port"``) into ``(host, port)``.

    Raises:
      TFConfigError: naming ``where`` when the address is not ``host:port`` with a port
        in 1..65535 and a valid hostname or IP address.
    """
    example = "e.g. '10.0.0.2:2222' or 'node1:2222'"
    if not isinstance(address, str):
        raise TFConfigError(f"{where} must be a 'host:port' string ({example}), got {address!r}.")
    if "://" in address:
        raise TFConfigError(
            f"{where}={address!r} carries a scheme; cluster addresses are plain 'host:port' "
            f"({example}) and the protocol goes in TF_CONFIG's 'rpc_layer'."
        )
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text:
        raise TFConfigError(f"{where}={address!r} is not 'host:port' ({example}).")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise TFConfigError(f"{where}={address!r} has port {port_text!r}; use a number in 1..65535.")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise TFConfigError(f"{where}={address!r}: {host} is not an IPv6 address.") from None
        return host[1:-1], int(port_text)
    if ":" in host:
        raise TFConfigError(
            f"{where}={address!r}: write an IPv6 host in brackets, e.g. '[fd00::2]:2222'."
        )
    if not _HOSTNAME.match(host):
        raise TFConfigError(f"{where}={address!r}: {host!r} is not a valid hostname or IPv4 address.")
    return host, int(port_text)


def _suggest(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(name), list(choices), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _validate_cluster(cluster: Any) -> None:
    if not isinstance(cluster, Mapping):
        raise TFConfigError(
            f"TF_CONFIG 'cluster' must be an object mapping task types to address lists, "
            f"got {type(cluster).__name__}."
        )
    if not cluster:
        raise TFConfigError(
            "TF_CONFIG 'cluster' is empty: list at least one 'chief' or 'worker' address, "
            "e.g. {\"worker\": [\"10.0.0.1:2222\", \"10.0.0.2:2222\"]}."
        )
    seen: dict[str, str] = {}
    for task_type, addresses in cluster.items():
        if task_type not in TASK_TYPES:
            raise TFConfigError(
                f"TF_CONFIG cluster has unknown task type {task_type!r}; known types: "
                f"{', '.join(TASK_TYPES)}.{_suggest(task_type, TASK_TYPES)}"
            )
        if not isinstance(addresses, (list, tuple)):
            raise TFConfigError(
                f"TF_CONFIG cluster[{task_type!r}] must be a list of 'host:port' strings, "
                f"got {addresses!r}."
            )
        if not addresses:
            raise TFConfigError(
                f"TF_CONFIG cluster[{task_type!r}] is an empty list: remove the key or list "
                f"its addresses."
            )
        if task_type in _SINGLETON_TASK_TYPES and len(addresses) > 1:
            raise TFConfigError(
                f"TF_CONFIG cluster[{task_type!r}] has {len(addresses)} addresses; there can "
                f"be at most one {task_type}. Make the others 'worker' tasks."
            )
        for index, address in enumerate(addresses):
            name = task_name(task_type, index)
            host, port = parse_address(address, where=f"TF_CONFIG cluster[{task_type!r}][{index}]")
            key = f"{host.lower()}:{port}"
            if key in seen:
                raise TFConfigError(
                    f"TF_CONFIG address {address!r} is used twice, by {seen[key]} and {name}; "
                    f"every task needs its own host:port."
                )
            seen[key] = name
    if not any(t in cluster for t in TRAINING_TASK_TYPES):
        raise TFConfigError(
            f"TF_CONFIG cluster has only {', '.join(sorted(cluster))} tasks; it needs at "
            f"least one 'chief' or 'worker' to train."
        )


def validate_tf_config(tf_config: dict, require_chief: bool = False) -> None:
    """Checks a parsed TF_CONFIG; returns None or raises :class:`TFConfigError`.

    Checked: ``cluster`` is a non-empty object of known task types (chief, worker,
    evaluator, ps) with non-empty lists of valid ``host:port``; no address is used
    twice; at most one chief and one evaluator; at least one chief or worker; ``task``
    names a type present in the cluster and an integer index in range; ``rpc_layer``,
    when present, is a non-empty string. With ``require_chief``, a ``chief`` task must
    exist. Keys other than these (e.g. ``environment``, ``job``) are left alone.
    """
    if not isinstance(tf_config, Mapping):
        raise TFConfigError(
            f"TF_CONFIG must be a JSON object with 'cluster' and 'task', got "
            f"{type(tf_config).__name__}."
        )
    if "cluster" not in tf_config:
        raise TFConfigError(
            "TF_CONFIG has no 'cluster': add {\"cluster\": {\"worker\": [\"host:port\", ...]}}."
        )
    cluster = tf_config["cluster"]
    _validate_cluster(cluster)
    if require_chief and "chief" not in cluster:
        raise TFConfigError(
            "TF_CONFIG has no 'chief' task but this run needs one: add "
            "cluster['chief'] = ['host:port'] (the multiworker launcher does this with --chief)."
        )
    task = tf_config.get("task")
    if not isinstance(task, Mapping) or "type" not in task or "index" not in task:
        raise TFConfigError(
            f"TF_CONFIG 'task' must be an object {{\"type\": ..., \"index\": ...}} naming this "
            f"process, got {task!r}."
        )
    task_type, index = task["type"], task["index"]
    if task_type not in cluster:
        hint = (f" Known types: {', '.join(TASK_TYPES)}.{_suggest(task_type, TASK_TYPES)}"
                if task_type not in TASK_TYPES else "")
        raise TFConfigError(
            f"TF_CONFIG task type {task_type!r} is not in the cluster (it has: "
            f"{', '.join(cluster)}).{hint}"
        )
    if not isinstance(index, int) or isinstance(index, bool):
        raise TFConfigError(f"TF_CONFIG task index must be an integer, got {index!r}.")
    count = len(cluster[task_type])
    if not 0 <= index < count:
        raise TFConfigError(
            f"TF_CONFIG task index {index} is out of range for {task_type!r}: the cluster has "
            f"{count} {task_type} task(s), so the index must be in 0..{count - 1}."
        )
    rpc_layer = tf_config.get("rpc_layer", "grpc")
    if not isinstance(rpc_layer, str) or not rpc_layer:
        raise TFConfigError(f"TF_CONFIG 'rpc_layer' must be a non-empty string such as 'grpc', "
                            f"got {rpc_layer!r}.")


def build_tf_config(
    cluster: dict[str, list[str]], task_type: str, task_index: int, rpc_layer: str = "grpc"
) -> dict:
    """Returns the TF_CONFIG dict for task ``task_type:task_index`` of ``cluster``.

    ``cluster`` maps task types to ordered ``host:port`` lists; the result is validated
    with :func:`validate_tf_config` (which raises :class:`TFConfigError`) and is a fresh
    copy: ``json.dumps`` it into the process's environment.
    """
    tf_config = {
        "cluster": {kind: list(addresses) for kind, addresses in cluster.items()},
        "task": {"type": task_type, "index": task_index},
        "rpc_layer": rpc_layer,
    }
    validate_tf_config(tf_config)
    return tf_config


def cluster_tasks(cluster: Mapping[str, Sequence[str]]) -> list[tuple[str, int, str]]:
    """Lists ``(task_type, index, address)`` in the order chief, worker, evaluator, ps."""
    return [
        (task_type, index, address)
        for task_type in TASK_TYPES
        for index, address in enumerate(cluster.get(task_type, ()))
    ]


def probe_address(address: str, timeout_s: float = 1.0) -> str | None:
    """Tries a TCP connect to ``host:port``; returns None if it answers, else the reason."""
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except socket.timeout:
        return f"no answer within {timeout_s:g} s"
    except OSError as error:
        return error.strerror or str(error)


def _port_free_here(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def _port_bindable(port: int) -> bool:
    """True when TensorFlow's server could bind ``0.0.0.0:port`` here. SO_REUSEADDR, as
    gRPC sets it: a port whose old connections are in TIME_WAIT is free, a listening
    socket is not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def port_holder(port: int) -> str | None:
    """``"pid N (name)"`` of the local process listening on TCP ``port``, or None.

    None when psutil may not inspect the process (another user's).
    """
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    for conn in connections:
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            if conn.pid is None:
                return None
            try:
                command = " ".join(" ".join(psutil.Process(conn.pid).cmdline()[:3]).split())
                return f"pid {conn.pid} ({command[:80]})"
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                return f"pid {conn.pid}"
    return None


def check_own_port(tf_config: dict) -> None:
    """Raises :class:`TFConfigError` when this task's TF_CONFIG port is taken here.

    TensorFlow's gRPC server binds ``0.0.0.0:PORT`` of this task's address; a taken
    port otherwise fails deep in TensorFlow ("could not start gRPC server"). The message
    names the task, the address and, where psutil can find it, the process holding the
    port; it contains "Address already in use" (what the local launcher retries on).
    ``tf_config`` must already be valid (see :func:`validate_tf_config`).
    """
    task = tf_config["task"]
    address = tf_config["cluster"][task["type"]][task["index"]]
    port = parse_address(address)[1]
    if _port_bindable(port):
        return
    holder = port_holder(port)
    held = f", held by {holder}" if holder else ""
    raise TFConfigError(
        f"TF_CONFIG task {task_name(task['type'], task['index'])} listens on {address}, but "
        f"port {port} is taken on this machine (Address already in use{held}). Stop that "
        f"process, or give this task a free port in TF_CONFIG (the local launcher picks "
        f"free ports itself).")


def check(tf_config: dict, timeout_s: float = 1.0, out=sys.stdout) -> int:
    """Reports what this process is and whether its peers answer; returns an exit code.

    Prints one line per task. The process's own port is checked for being free to bind
    (TensorFlow's server listens on it); every other task's port gets a TCP connect with
    ``timeout_s``. Returns 0 when every peer answers, 3 otherwise. ``tf_config`` must
    already be valid (see :func:`validate_tf_config`).
    """
    cluster, task = tf_config["cluster"], tf_config["task"]
    tasks = cluster_tasks(cluster)
    me = task_name(task["type"], task["index"])
    training = sum(len(cluster.get(t, ())) for t in TRAINING_TASK_TYPES)
    print(f"this process is {me} of a cluster of {len(tasks)} task(s) ({training} training), "
          f"rpc_layer {tf_config.get('rpc_layer', 'grpc')}", file=out)
    peers = [(name, address) for kind, index, address in tasks
             if (name := task_name(kind, index)) != me]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(peers)))) as pool:
        results = dict(zip([n for n, _ in peers],
                           pool.map(lambda p: probe_address(p[1], timeout_s), peers)))
    width = max(len(task_name(k, i)) for k, i, _ in tasks)
    for kind, index, address in tasks:
        name = task_name(kind, index)
        if name == me:
            port = parse_address(address)[1]
            state = ("this process; port free to bind" if _port_free_here(port) else
                     "this process; port IN USE here, TensorFlow's server will fail to start")
        elif results[name] is None:
            state = "answers"
        else:
            state = f"does not answer ({results[name]})"
        print(f"  {name:<{width}}  {address:<24} {state}", file=out)
    silent = [name for name, reason in results.items() if reason is not None]
    if silent:
        print(f"{len(silent)} peer(s) do not answer: not started yet, a wrong address, or a "
              f"firewall between the hosts.", file=out)
        return 3
    return 0


def tf_config_from_slurm(
    environ: Mapping[str, str], port: int, chief: bool = False,
    hostnames: Sequence[str] | None = None, tasks_per_node: int = 1,
) -> dict:
    """Builds this SLURM task's TF_CONFIG from the job step's environment.

    The step has ``tasks_per_node`` tasks on each of its nodes, placed in blocks (srun's
    default ``--distribution=block``): task ``SLURM_PROCID`` = ``node * tasks_per_node +
    SLURM_LOCALID`` runs on the ``node``-th host of ``SLURM_STEP_NODELIST`` (or
    ``SLURM_JOB_NODELIST``) and listens on ``port + SLURM_LOCALID``. With ``chief``,
    task 0 is ``chief:0`` and the others ``worker:0..``; otherwise task i is
    ``worker:i``. The node list is expanded with ``scontrol show hostnames`` unless
    ``hostnames`` is given.

    Raises:
      TFConfigError: outside a job step, when the step's task count or this task's
        place does not match ``tasks_per_node`` tasks per node in blocks, or when
        ``scontrol`` is missing.
    """
    if tasks_per_node < 1:
        raise TFConfigError(f"--tasks_per_node={tasks_per_node} must be >= 1.")
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST") if k not in environ]
    if missing:
        raise TFConfigError(
            f"not inside a SLURM job step: {', '.join(missing)} unset. Run this under `srun` "
            f"inside an sbatch allocation."
        )
    procid, ntasks = int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"])
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"]
    if hostnames is None:
        scontrol = shutil.which("scontrol")
        if scontrol is None:
            raise TFConfigError("`scontrol` is not on PATH; it is needed to expand the SLURM "
                                "node list. Run this inside the SLURM job (srun).")
        hostnames = subprocess.run(
            [scontrol, "show", "hostnames", nodelist],
            check=True, capture_output=True, text=True, timeout=30,
        ).stdout.split()
    if len(hostnames) * tasks_per_node != ntasks:
        raise TFConfigError(
            f"SLURM step has {ntasks} task(s) on {len(hostnames)} node(s), but "
            f"{tasks_per_node} task(s) per node were expected ({len(hostnames) * tasks_per_node} "
            f"in all). Ask for the same count in the script (#SBATCH --ntasks-per-node="
            f"{tasks_per_node}) and here (--tasks_per_node)."
        )
    local = int(environ.get("SLURM_LOCALID", procid % tasks_per_node))
    node = int(environ.get("SLURM_NODEID", procid // tasks_per_node))
    if (node, local) != divmod(procid, tasks_per_node):
        raise TFConfigError(
            f"SLURM task {procid} is local task {local} on node {node}, not where a block "
            f"distribution puts it (node {procid // tasks_per_node}, local task "
            f"{procid % tasks_per_node}); run srun with --distribution=block."
        )
    if port + tasks_per_node - 1 > 65535:
        raise TFConfigError(f"--port={port} + {tasks_per_node - 1} (one port per local task) "
                            f"exceeds 65535; use a lower --port.")
    addresses = [f"{host}:{port + i}" for host in hostnames for i in range(tasks_per_node)]
    if chief:
        cluster = {"chief": addresses[:1]}
        if addresses[1:]:
            cluster["worker"] = addresses[1:]
        task_type, index = ("chief", 0) if procid == 0 else ("worker", procid - 1)
    else:
        cluster, task_type, index = {"worker": addresses}, "worker", procid
    return build_tf_config(cluster, task_type, index)


def _gpu_device_files(dev: str = "/dev") -> list[str]:
    try:
        names = os.listdir(dev)
    except OSError:
        return []
    return sorted((n[len("nvidia"):] for n in names if re.fullmatch(r"nvidia\d+", n)), key=int)


def slurm_visible_gpus(
    environ: Mapping[str, str], tasks_per_node: int, gpu_devices: Sequence[str] | None = None,
) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` this SLURM task should run with, or None to leave it.

    With one task per node, or when SLURM bound GPUs to tasks itself (``--gpus-per-task``
    sets ``SLURM_GPUS_PER_TASK`` and implies ``--gpu-bind=per_task``), or on a node
    without GPUs, nothing changes (None). Otherwise the GPUs the task sees
    (``CUDA_VISIBLE_DEVICES`` as SLURM set it for ``--gres=gpu:K``, else the node's
    ``/dev/nvidiaN`` devices, or ``gpu_devices``) are split into ``tasks_per_node`` equal
    consecutive slices and the task gets slice ``SLURM_LOCALID``: one task per GPU when
    there are as many GPUs as tasks.

    Raises:
      TFConfigError: when the GPUs cannot be split evenly among the node's tasks.
    """
    if tasks_per_node <= 1 or environ.get("SLURM_GPUS_PER_TASK"):
        return None
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g for g in visible.split(",") if g.strip()]
    else:
        gpus = list(_gpu_device_files() if gpu_devices is None else gpu_devices)
    if not gpus:
        return None
    if len(gpus) % tasks_per_node:
        raise TFConfigError(
            f"this node has {len(gpus)} GPU(s) ({','.join(gpus)}) for {tasks_per_node} tasks; "
            f"they cannot be split evenly. Ask for a multiple of {tasks_per_node} GPUs per node "
            f"(e.g. #SBATCH --gres=gpu:{tasks_per_node}), or --gpus-per-task."
        )
    per_task = len(gpus) // tasks_per_node
    local = int(environ.get("SLURM_LOCALID", "0"))
    return ",".join(gpus[local * per_task:(local + 1) * per_task])


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m launch.tf_config", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true",
                      help="validate $TF_CONFIG, print this task and probe the peers' ports")
    mode.add_argument("--from_slurm", action="store_true",
                      help="print the TF_CONFIG of this SLURM task")
    parser.add_argument("--timeout_s", type=float, default=1.0, help="per-peer connect timeout")
    parser.add_argument("--port", type=int, default=12345,
                        help="--from_slurm: base port; local task i listens on port + i")
    parser.add_argument("--tasks_per_node", type=int, default=1,
                        help="--from_slurm: tasks per node in the step (one per GPU is usual)")
    parser.add_argument("--chief", action="store_true", help="--from_slurm: task 0 is the chief")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="--from_slurm: after '--', a command to exec with TF_CONFIG set")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if command and not args.from_slurm:
        parser.error(f"unexpected arguments {command}; only --from_slurm takes a command.")
    if args.from_slurm:
        try:
            tf_config = json.dumps(tf_config_from_slurm(
                os.environ, args.port, chief=args.chief, tasks_per_node=args.tasks_per_node))
            gpus = slurm_visible_gpus(os.environ, args.tasks_per_node)
        except (TFConfigError, subprocess.SubprocessError) as error:
            print(f"launch.tf_config: {error}", file=sys.stderr)
            return 1
        if not command:
            print(tf_config)
            return 0
        env = {**os.environ, "TF_CONFIG": tf_config}
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
            print(f"launch.tf_config: SLURM task {os.environ.get('SLURM_PROCID')} (local "
                  f"{os.environ.get('SLURM_LOCALID')}) gets CUDA_VISIBLE_DEVICES={gpus}",
                  file=sys.stderr, flush=True)
        os.execvpe(command[0], command, env)
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        print("launch.tf_config: TF_CONFIG is not set; this process would train alone. Set it, "
              "or start workers with `python -m launch.multiworker`.", file=sys.stderr)
        return 1
    try:
        tf_config = json.loads(raw)
        validate_tf_config(tf_config)
    except json.JSONDecodeError as error:
        print(f"launch.tf_config: TF_CONFIG is not valid JSON: {error}", file=sys.stderr)
        return 1
    except TFConfigError as error:
        print(f"launch.tf_config: {error}", file=sys.stderr)
        return 1
    return check(tf_config, timeout_s=args.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
