"""``TF_CONFIG``: the cluster description of a multi-worker run; build, parse, validate.

``TF_CONFIG`` is a JSON object in each process's environment::

    {"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"],
                 "evaluator": ["h3:2222"]},
     "task": {"type": "worker", "index": 1},
     "rpc_layer": "grpc"}

Every process of a cluster gets the same ``cluster`` and its own ``task``. This module
owns the format: :func:`build_tf_config` makes one, :func:`validate_tf_config` rejects a
broken one with a message that names the field and the fix (the trainer calls it before
creating ``MultiWorkerMirroredStrategy``; the launchers build with it), and
:func:`parse_address` / :func:`cluster_tasks` / :func:`task_name` are the shared
vocabulary of addresses and task names. Pure Python: no TensorFlow, no launcher.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from typing import Any, Mapping, Sequence

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


def format_address(host: str, port: int) -> str:
    """``"host:port"``, with an IPv6 host in brackets: the inverse of :func:`parse_address`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
