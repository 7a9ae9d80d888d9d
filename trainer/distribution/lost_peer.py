"""A peer task lost in the middle of a multi-worker run, told in one line.

When a task of a ``MultiWorkerMirroredStrategy`` group dies (killed, its host down or
cut off the network), the collectives of every surviving task fail with a TensorFlow
error (``UnavailableError``, ``AbortedError``, ``DeadlineExceededError``...) whose
message names the lost task by its device path, e.g. (measured, one of 3 local workers
SIGKILLed)::

    Collective ops is aborted by: recvmsg:Connection reset by peer
    Additional GRPC error information from remote target /job:worker/replica:0/task:2 ...
    The error could be from a previous operation. Restart your program to reset.

or ``The following tasks are unhealthy (stopped sending heartbeats):
/job:worker/replica:0/task:2``. :func:`translate` turns such an error into a
:class:`trainer.errors.PeerLostError` naming the task, its address from ``TF_CONFIG``,
the step and the last checkpoint; the command line prints it as its last line (no
traceback; ``--traceback`` shows it) and exits with :data:`trainer.errors.EXIT_PEER_LOST`
(170, retryable: restart the group, it resumes from that checkpoint).

Which task is named: the tasks an "unhealthy" list names; else the first task named
as a "remote target" (an abort relayed by a surviving peer quotes the original error,
and so the lost task, first); else, when TensorFlow names none (a deadline), the peers
whose address no longer accepts a TCP connection.

Pure Python (no TensorFlow import): errors are recognised by their class name and
message, so this module sits at the bottom of the layers.
"""

from __future__ import annotations

import json
import os
import re
import socket

from trainer.errors import EXIT_PEER_LOST, PeerLostError

# TensorFlow's errors that a lost peer raises in the survivors' collectives.
_ERROR_TYPES = {"UnavailableError", "AbortedError", "DeadlineExceededError",
                "CancelledError", "InternalError", "UnknownError", "FailedPreconditionError"}
# Phrases of those messages that mean "a peer is gone" (not a bug of the step itself).
_SIGNS = ("stopped sending heartbeats", "are unhealthy", "Collective ops is aborted by",
          "Connection reset by peer", "Socket closed", "failed to connect",
          "Connection refused", "connections to all backends failing",
          "DEADLINE_EXCEEDED", "Deadline Exceeded", "deadline exceeded", "peer is not alive")
_TASK = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")
_REMOTE = re.compile(r"remote target /job:(\w+)/replica:\d+/task:(\d+)")
_UNHEALTHY = re.compile(r"unhealthy[^:]*:((?:\s*/job:\w+/replica:\d+/task:\d+,?)+)")
_PROBE_TIMEOUT_S = 1.0


def _tf_config() -> dict:
    try:
        config = json.loads(os.environ.get("TF_CONFIG") or "{}")
        return config if isinstance(config, dict) else {}
    except ValueError:
        return {}


def _own_task(config: dict) -> tuple[str, int] | None:
    task = config.get("task") or {}
    try:
        return str(task["type"]), int(task.get("index", 0))
    except (KeyError, TypeError, ValueError):
        return None


def address(job: str, index: int, config: dict | None = None) -> str:
    """TF_CONFIG's address of task ``job:index`` ("?" when TF_CONFIG does not name it)."""
    cluster = (_tf_config() if config is None else config).get("cluster") or {}
    tasks = cluster.get(job) or []
    return str(tasks[index]) if 0 <= index < len(tasks) else "?"


def _peer_error(error: BaseException) -> BaseException | None:
    """The first error of ``error``'s chain that looks like a lost peer, or None."""
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        if type(error).__name__ in _ERROR_TYPES and any(s in str(error) for s in _SIGNS):
            return error
        seen.append(error)
        error = error.__cause__ or error.__context__
    return None


def _named_tasks(message: str, own: tuple[str, int] | None) -> list[tuple[str, int]]:
    """The lost tasks a TensorFlow message names (see the module docstring), in order."""
    unhealthy = _UNHEALTHY.search(message)
    found = ([(j, int(i)) for j, i in _TASK.findall(unhealthy.group(1))] if unhealthy
             else [(j, int(i)) for j, i in _REMOTE.findall(message)][:1])
    if not found:
        found = [(j, int(i)) for j, i in _TASK.findall(message)]
        found = found[:1] if len({t for t in found if t != own}) == 1 else []
    return [t for t in dict.fromkeys(found) if t != own]


def _unreachable_peers(config: dict, own: tuple[str, int] | None) -> list[tuple[str, int]]:
    """The training peers whose TF_CONFIG address refuses (or times out) a TCP connection."""
    lost = []
    for job in ("chief", "worker"):
        for index, addr in enumerate((config.get("cluster") or {}).get(job) or []):
            host, _, port = str(addr).rpartition(":")
            if (job, index) == own or not port.isdigit():
                continue
            try:
                socket.create_connection((host.strip("[]"), int(port)),
                                         timeout=_PROBE_TIMEOUT_S).close()
            except OSError:
                lost.append((job, index))
    return lost


def translate(error: BaseException, step: int, last_checkpoint: int | None,
              phase: str = "training") -> PeerLostError | None:
    """A :class:`PeerLostError` for ``error`` when it means a peer task was lost; None
    for anything else (no TF_CONFIG group, or another error: keep its traceback).

    ``step``: the steps done when it happened; ``last_checkpoint``: the newest committed
    checkpoint step in the workdir (None: none yet); ``phase`` says what was running.
    """
    config = _tf_config()
    cluster = config.get("cluster") or {}
    if len(cluster.get("chief") or []) + len(cluster.get("worker") or []) < 2:
        return None
    cause = _peer_error(error)
    if cause is None:
        return None
    own = _own_task(config)
    lost = _named_tasks(str(cause), own) or _unreachable_peers(config, own)
    if lost:
        who = " and ".join(f"{job}:{index} ({address(job, index, config)})"
                           for job, index in lost)
        what = f"{who} stopped responding"
    else:
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        what = f"a peer task stopped responding (TensorFlow: {type(cause).__name__}: {first})"
    checkpoint = (f"The last checkpoint is step {last_checkpoint}"
                  if last_checkpoint is not None else
                  "There is no checkpoint yet (the restart begins at step 0)")
    return PeerLostError(
        f"{what} during {phase} at step {step}; the run cannot continue without it. "
        f"{checkpoint}: restart the group (exit status {EXIT_PEER_LOST} is retryable).")
