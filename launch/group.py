"""Running a group of training tasks with restarts: what every spawning launcher shares.

The local group (:mod:`launch.local_group`, every task on this machine) and the per-host
launcher (:mod:`launch.hosts`, this host's tasks of a cluster) both:

* check the trainer flags once before any task starts (:func:`preflight`);
* give every task of a cluster its own TF_CONFIG (:func:`task_specs`);
* supervise the tasks as one :class:`~launch.supervision.ProcessGroup` and, with
  ``max_restarts``, restart the whole group after a failure
  (:func:`run_with_restarts`).

Restart rules (``--max_restarts R``): a task that exits
:data:`~tf_cluster.exit_codes.EXIT_PREEMPTED` (143, it saved a checkpoint after SIGTERM)
restarts the group without counting against R; one that exits
:data:`~tf_cluster.exit_codes.EXIT_PEER_LOST` (170, a peer task or host was lost)
restarts it and counts, since a lost host may not come back; any other failure counts.
With R = 0 nothing restarts and the launcher exits with the failing task's status.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from typing import Callable, Sequence

from launch.cluster import evaluator_command, trainer_command
from launch.flags import flag_value
from launch.supervision import Bounds, GroupResult, ProcessGroup, TaskSpec
from tf_cluster.exit_codes import EXIT_PEER_LOST, EXIT_PREEMPTED
from tf_cluster.tf_config import build_tf_config, cluster_tasks, task_name

# The trainer module whose flags the launcher checks once before starting any task.
CHECKED_MODULE = "trainer.main"
_CHECK_TIMEOUT_S = 120.0


class StartError(Exception):
    """The group cannot start (e.g. a port of this host is taken); the launcher logs the
    message and exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """``max_restarts``: counted restarts after a failure (``--max_restarts``).
    ``port_retries``: restarts, not counted, after a task's port was taken between the
    pick and its bind (only a launcher that picks new ports each time may use them).
    ``pause_s``: the pause before a restart."""

    max_restarts: int = 0
    port_retries: int = 0
    pause_s: float = 1.0


def preflight(module: str, trainer_flags: Sequence[str], log: Callable[[str], None],
              environ: dict[str, str] | None = None, replicas: int = 0,
              tf_config: dict | None = None, refused: str = "no task was started",
              hint: str = "") -> int:
    """Checks the tasks' shared flags once, before any task starts; returns 0 or the
    check's exit status (2 usage, 1 config/workdir) after logging its message once.

    For ``trainer.main`` (:data:`CHECKED_MODULE`) this runs ``python -m trainer.main
    FLAGS --config.distribute.strategy=multi_worker --check_only``: the trainer's own
    TensorFlow-free checks of the flags, config file and workdir (about a second; this
    package never imports ``trainer``); with ``replicas`` (the number of training tasks
    the launcher will start) also ``--check_replicas=N``: the global batch sizes must
    divide over them. The check runs without TF_CONFIG, or with ``tf_config``. Other
    modules are not checked. ``refused`` (what did not happen) and ``hint`` shape the
    log line before the check's message.
    """
    if module != CHECKED_MODULE:
        return 0
    env = {k: v for k, v in (os.environ if environ is None else environ).items()
           if k != "TF_CONFIG"}
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return check_trainer_command(trainer_command(module, trainer_flags, python=sys.executable),
                                 env, log, replicas, refused=refused, hint=hint)


def check_trainer_command(command: Sequence[str], env: dict[str, str],
                          log: Callable[[str], None], replicas: int = 0,
                          refused: str = "no task was started", hint: str = "",
                          prefix: str = "[launcher]") -> int:
    """Runs ``command`` (the argv of a :data:`CHECKED_MODULE` run) with ``--check_only``
    (and ``--check_replicas=N`` when ``replicas``) in ``env``: the trainer's
    TensorFlow-free checks, about a second. Returns 0, or the check's exit status after
    logging ``PREFIX REFUSED: ...`` and the check's message (its last lines) once. A
    check that does not finish in time is logged and passes (the trainer checks again)."""
    argv = [*command, "--check_only"]
    if replicas:
        argv.append(f"--check_replicas={replicas}")
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log(f"{prefix} warning: the flag check did not finish in {_CHECK_TIMEOUT_S:g} s; "
            f"starting anyway.")
        return 0
    if proc.returncode == 0:
        return 0
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()][-3:]
    log(f"{prefix} {refused}: the trainer flags fail {CHECKED_MODULE}'s checks{hint}.")
    for line in lines:
        log(line)
    return proc.returncode


def preflight_elsewhere(module: str, trainer_flags: Sequence[str], log: Callable[[str], None],
                        replicas: int = 0) -> int:
    """:func:`preflight` for tasks that run on other machines (an emitted SLURM script or
    TFJob); returns 0 or the check's exit status.

    The check runs as a non-chief worker would (TF_CONFIG of a two-worker cluster):
    those write nothing, so the workdir, on the cluster's storage, is neither created
    nor checked here. Without a ``--config`` file on this machine (none given, or one
    only in the container image) nothing is checked: the job checks its flags when it
    starts (the launcher notes a config it cannot find).
    """
    config = flag_value(trainer_flags, "--config")
    if module != CHECKED_MODULE or config is None:
        return 0
    if not os.path.isfile(config):
        log(f"[launcher] note: --config={config} is not on this machine; the trainer flags "
            f"were not checked (the job checks them when it starts).")
        return 0
    worker = build_tf_config({"worker": ["checking-worker-0:1", "checking-worker-1:1"]},
                             "worker", 1)
    return preflight(module, trainer_flags, log, replicas=replicas, tf_config=worker,
                     refused="nothing was written",
                     hint=" (checked on this machine; --no_check skips the check)")


def task_specs(
    cluster: dict, module: str, trainer_flags: Sequence[str], collective_timeout_s: int = 0,
    environ: dict[str, str] | None = None, only: Sequence[str] | None = None,
) -> list[TaskSpec]:
    """One :class:`TaskSpec` per task of ``cluster`` (or per task named in ``only``),
    each with its own TF_CONFIG: the training tasks run
    :func:`launch.cluster.trainer_command`, the evaluator
    :func:`launch.cluster.evaluator_command` (``--mode=continuous_eval``, one device)."""
    argv = trainer_command(module, trainer_flags, python=sys.executable)
    if collective_timeout_s:
        argv.append(f"--config.distribute.collective_timeout_s={collective_timeout_s}")
    evaluator_argv = evaluator_command(module, trainer_flags, python=sys.executable)
    base_env = dict(os.environ if environ is None else environ, PYTHONUNBUFFERED="1")
    return [
        TaskSpec(
            name=task_name(kind, index),
            argv=evaluator_argv if kind == "evaluator" else argv,
            env={**base_env, "TF_CONFIG": json.dumps(build_tf_config(cluster, kind, index))},
        )
        for kind, index, _ in cluster_tasks(cluster)
        if only is None or task_name(kind, index) in only
    ]


def resume_note(trainer_flags: Sequence[str]) -> str:
    """Where a restarted group resumes from, for the launcher's restart messages."""
    workdir = flag_value(trainer_flags, "--workdir")
    if workdir:
        return f"the trainer resumes from the latest checkpoint in {workdir} if there is one"
    return "the trainer resumes from its workdir's latest checkpoint if any"


def run_with_restarts(
    build: Callable[[], list[TaskSpec]], bounds: Bounds, policy: RestartPolicy,
    stop: Callable[[], int | None], log: Callable[[str], None], resume: str,
    explain: Callable[[GroupResult], GroupResult] = lambda result: result,
    watch: re.Pattern[bytes] | None = None,
) -> int:
    """Runs the group that ``build`` describes (called again before every restart; it
    may log, and raise :class:`StartError`) until it succeeds, fails for good or the
    launcher is stopped; returns the launcher's exit status.

    ``explain`` may add to a failed result's reason (e.g. which peer host was lost) from
    the lines that matched ``watch``; the launcher's last line carries that reason.
    """
    restarts = port_retries = 0
    while True:
        if stop() is not None:
            return 128 + stop()
        try:
            specs = build()
        except StartError as error:
            log(f"[launcher] {error}")
            return error.exit_code
        result = ProcessGroup(specs, bounds, stop_requested=stop, log=log, watch=watch).run()
        if result.exit_code == 0:
            log(f"[launcher] done: {result.reason}.")
            return 0
        if stop() is not None:
            return result.exit_code
        result = explain(result)
        if result.port_clash and port_retries < policy.port_retries:
            port_retries += 1
            log(f"[launcher] {result.failed_task}'s port was taken before it could bind; "
                f"restarting the group on new ports (port retry {port_retries} of "
                f"{policy.port_retries}).")
            continue
        if policy.max_restarts and result.exit_code == EXIT_PREEMPTED:
            log(f"[launcher] {result.reason}: preempted after saving a checkpoint; restarting "
                f"the whole group (not counted against --max_restarts); {resume}.")
            time.sleep(policy.pause_s)
            continue
        if restarts < policy.max_restarts:
            restarts += 1
            lost = "; a lost peer counts" if result.exit_code == EXIT_PEER_LOST else ""
            log(f"[launcher] {result.reason}; restarting the whole group (restart {restarts} of "
                f"{policy.max_restarts}{lost}); {resume}.")
            time.sleep(policy.pause_s)
            continue
        if policy.max_restarts:
            log(f"[launcher] giving up after {restarts} restart(s): {result.reason} (exit "
                f"status {result.exit_code}).")
        else:
            log(f"[launcher] failed: {result.reason} (exit status {result.exit_code}).")
        return result.exit_code
