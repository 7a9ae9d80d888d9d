"""Ports of this machine: is a task's port free, who holds it, does a peer answer.

TensorFlow's gRPC server binds ``0.0.0.0:PORT`` whatever the task's address (it has no
bind option), so "free" means free on every address of this machine. Used by the
trainer before it creates ``MultiWorkerMirroredStrategy`` (:func:`check_own_port`) and
by the launchers before they start tasks and when they look for a lost peer
(:func:`probe_address`).
"""

from __future__ import annotations

import socket

import psutil

from tf_cluster.tf_config import TFConfigError, parse_address, task_name

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


def port_free_here(port: int) -> bool:
    """True when nothing holds TCP ``port`` on this machine, not even a connection in
    TIME_WAIT (a plain bind, without SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def port_bindable(port: int) -> bool:
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
    if port_bindable(port):
        return
    holder = port_holder(port)
    held = f", held by {holder}" if holder else ""
    raise TFConfigError(
        f"TF_CONFIG task {task_name(task['type'], task['index'])} listens on {address}, but "
        f"port {port} is taken on this machine (Address already in use{held}). Stop that "
        f"process, or give this task a free port in TF_CONFIG (the local launcher picks "
        f"free ports itself).")
