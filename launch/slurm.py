"""Everything SLURM: the sbatch script this launcher emits, and what its tasks run inside.

* :func:`emit_slurm` (``launch.multiworker --emit slurm``): an sbatch script. Each SLURM
  task (one or several per node) derives its TF_CONFIG from the job's environment
  (``python -m launch.tf_config --from_slurm``, i.e. :func:`tf_config_from_slurm` and
  :func:`slurm_visible_gpus`) and execs the trainer. A warning signal before the time
  limit makes the tasks checkpoint and the job requeues itself to resume; a task that
  lost a peer (a node failed or became unreachable, exit
  :data:`~tf_cluster.exit_codes.EXIT_PEER_LOST`) requeues it too.
* :func:`slurm_nodes`: the node count (or min-max range) of ``--workers``, ``--nodes``,
  ``--min_nodes`` and ``--tasks_per_node``. With a range (``--nodes 1-2`` or
  ``--min_nodes 1 --nodes 2``) SLURM starts the job on as many nodes as it can give
  within it, and the script computes the worker count at run time from
  ``SLURM_NNODES``: a requeued job that comes back on fewer nodes resumes on fewer
  workers (elastic by restart).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from typing import Mapping, Sequence

from launch.cluster import SECURITY_NOTE, ClusterError, trainer_command
from launch.gpus import gpu_device_files
from tf_cluster.batch_script import wait_for_child, warning_trap
from tf_cluster.exit_codes import EXIT_PEER_LOST, EXIT_PREEMPTED
from tf_cluster.tf_config import TFConfigError, build_tf_config

DEFAULT_WARNING_S = 300
_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.:,+/@%=-]+$")
_NODE_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
# sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; or no limit.
_TIME = re.compile(r"^(\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|UNLIMITED|INFINITE)$")
TIME_FORMS = ("'minutes', 'minutes:seconds', 'hours:minutes:seconds', 'days-hours', "
              "'days-hours:minutes' or 'days-hours:minutes:seconds' (e.g. 90, 4:00:00, "
              "1-00:00:00), or UNLIMITED")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def _sbatch_value(flag: str, value: str) -> str:
    if not _SBATCH_VALUE.match(value):
        raise ClusterError(f"{flag}={value!r} cannot go on an #SBATCH line (spaces, quotes or "
                           f"newlines); give a plain value such as '1-00:00:00' or 'gpu'.")
    return value


def check_site_values(time_limit: str | None, partition: str | None,
                      account: str | None) -> None:
    """Raises ClusterError for a ``--time``, ``--partition`` or ``--account`` that sbatch
    would reject, saying the accepted forms (after the characters no ``#SBATCH`` line
    can hold)."""
    for flag, value in (("--time", time_limit), ("--partition", partition),
                        ("--account", account)):
        if value is not None:
            _sbatch_value(flag, value)
    if time_limit is not None and not _TIME.match(time_limit):
        raise ClusterError(f"--time={time_limit!r} is not a SLURM time limit; give "
                           f"{TIME_FORMS}.")
    if partition is not None and not all(_NAME.match(p) for p in partition.split(",")):
        raise ClusterError(f"--partition={partition!r} is not a SLURM partition name or a "
                           f"comma-separated list of them (letters, digits, '_', '-', '.'; "
                           f"e.g. gpu or gpu,cpu).")
    if account is not None and not _NAME.match(account):
        raise ClusterError(f"--account={account!r} is not a SLURM account name (letters, "
                           f"digits, '_', '-', '.'; e.g. ml-team).")


def slurm_nodes(workers: int | None, nodes: str | None, min_nodes: int | None,
                tasks_per_node: int) -> tuple[int, int]:
    """``(min_nodes, max_nodes)`` of the job; equal for a fixed size.

    ``nodes`` is ``"N"`` or ``"M-N"`` (``--nodes``); without it the node count is
    ``workers / tasks_per_node``. ``min_nodes`` (``--min_nodes``) lowers the minimum.
    ``workers``, when given with a node count, must equal ``max_nodes x tasks_per_node``.

    Raises:
      ClusterError: a count below 1, a range the wrong way round, or counts that do not
        fit together; the message names the flags.
    """
    if tasks_per_node < 1:
        raise ClusterError(f"--tasks_per_node={tasks_per_node} must be >= 1.")
    if nodes is None:
        if workers is None or workers < 1:
            raise ClusterError("--emit slurm needs --workers N (N >= 1).")
        if workers % tasks_per_node:
            raise ClusterError(f"--workers={workers} is not a multiple of --tasks_per_node="
                               f"{tasks_per_node}; every node runs the same number of tasks.")
        low = high = workers // tasks_per_node
    else:
        match = _NODE_RANGE.match(nodes.strip())
        if not match:
            raise ClusterError(f"--nodes={nodes!r} is not a node count N or a range M-N "
                               f"(e.g. 2 or 1-2).")
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if low < 1 or high < low:
            raise ClusterError(f"--nodes={nodes} must be >= 1 (a range M-N needs 1 <= M <= N).")
        if workers is not None and workers != high * tasks_per_node:
            raise ClusterError(f"--workers={workers} but --nodes={high} x --tasks_per_node="
                               f"{tasks_per_node} makes {high * tasks_per_node} tasks; give "
                               f"two of them.")
    if min_nodes is not None:
        if not 1 <= min_nodes <= high:
            raise ClusterError(f"--min_nodes={min_nodes} must be in 1..{high} (the job's "
                               f"largest node count).")
        low = min(low, min_nodes)
    return low, high


def emit_slurm(
    trainer_flags: Sequence[str], nodes: int, tasks_per_node: int = 1,
    min_nodes: int | None = None, port: int = 12345, chief: bool = False,
    job_name: str = "tf-trainer", module: str = "trainer.main",
    time_limit: str | None = None, partition: str | None = None, account: str | None = None,
    warning_s: int = DEFAULT_WARNING_S, requeue: bool = True, gpus_per_task: int = 0,
) -> str:
    """An sbatch script for ``nodes`` nodes (``min_nodes``-``nodes`` when given) with
    ``tasks_per_node`` training tasks on each.

    The script computes the worker count at run time (``SLURM_NNODES x tasks_per_node``)
    and runs ``srun --ntasks=WORKERS python -m launch.tf_config --from_slurm --port P
    --tasks_per_node T -- python -m MODULE FLAGS``: each task's TF_CONFIG comes from the
    step's environment (local task i listens on ``P + i``) and, on GPU nodes with
    several tasks, it sees only its own GPU(s). ``time_limit``, ``partition``,
    ``account`` become ``--time``, ``--partition``, ``--account``; ``gpus_per_task``
    ``--gpus-per-task`` (SLURM then binds each task to its GPUs). A node range asks for
    ``--mincpus=T`` (and ``--gpus-per-node``) per node instead of ``--ntasks-per-node``
    (``--gpus-per-task``), which SLURM would turn into a fixed task count at the first
    start: a requeued job could then never come back on fewer nodes.

    Preemption and time limits: the job asks for ``USR1`` ``warning_s`` seconds before
    its time limit (``--signal=B:USR1@S``; ``scancel --batch --signal=USR1 JOB`` does the
    same by hand). The script then sends SIGTERM to the tasks through SLURM (``scancel
    --signal=TERM``; signalling ``srun`` itself would make SLURM kill the tasks before
    they save), the tasks checkpoint and exit with :data:`EXIT_PREEMPTED`, and, with
    ``requeue``, the script requeues the job (``scontrol requeue``), which resumes from
    that checkpoint. Tasks that end with :data:`EXIT_PEER_LOST` (a node failed or became
    unreachable) requeue it the same way; with a node range the job may come back on
    fewer nodes. A job that ends for any other reason is not requeued and keeps its exit
    status. ``srun`` runs in the background so that bash can run the trap while it waits
    (bash runs traps only between foreground commands).

    Raises:
      ClusterError: for counts that do not fit, ports beyond 65535, values sbatch
        would reject (:func:`check_site_values`) or that cannot go on an ``#SBATCH``
        line.
    """
    min_nodes = nodes if min_nodes is None else min_nodes
    if not 1 <= min_nodes <= nodes or tasks_per_node < 1:
        raise ClusterError(f"--nodes={min_nodes}-{nodes} x --tasks_per_node={tasks_per_node}: "
                           f"every count must be >= 1 and the minimum <= the maximum.")
    if warning_s < 1:
        raise ClusterError(f"--warning_s={warning_s} must be >= 1 (seconds before the time "
                           f"limit at which SLURM sends the warning signal).")
    if gpus_per_task < 0:
        raise ClusterError(f"--gpus_per_worker={gpus_per_task} must be >= 0.")
    if not 1 <= port <= 65535 - (tasks_per_node - 1):
        raise ClusterError(f"--port={port}: the tasks of a node listen on ports {port}.."
                           f"{port + tasks_per_node - 1}, which must lie in 1..65535; give "
                           f"--port in 1..{65535 - (tasks_per_node - 1)}.")
    check_site_values(time_limit, partition, account)
    tf_config_cmd = ["python", "-m", "launch.tf_config", "--from_slurm", f"--port={port}",
                     f"--tasks_per_node={tasks_per_node}"]
    if chief:
        tf_config_cmd.append("--chief")
    elastic = min_nodes < nodes
    srun = 'srun --ntasks="$WORKERS" ' + shlex.join(
        [f"--ntasks-per-node={tasks_per_node}", "--kill-on-bad-exit=1", "--distribution=block",
         *([f"--gpus-per-task={gpus_per_task}"] if elastic and gpus_per_task else []),
         *tf_config_cmd, "--", *trainer_command(module, trainer_flags)])
    body = _SLURM_BODY.format(exit_preempted=EXIT_PREEMPTED, exit_peer_lost=EXIT_PEER_LOST,
                              requeue=int(requeue), srun=srun, tasks_per_node=tasks_per_node,
                              trap=_WARNING_TRAP, wait=wait_for_child("srun_pid"))
    return "\n".join([
        "#!/bin/bash",
        "# Generated by `python -m launch.multiworker --emit slurm`. Add your site's",
        "# #SBATCH lines (--gres=gpu:N, --mem, ...) right after the generated ones: sbatch",
        "# reads them only above the first command.",
        f"# {SECURITY_NOTE}",
        *_sbatch_header(job_name, min_nodes, nodes, tasks_per_node, warning_s, requeue,
                        {"time": time_limit, "partition": partition, "account": account},
                        gpus_per_task),
        body,
    ])


def _sbatch_header(job_name: str, min_nodes: int, nodes: int, tasks_per_node: int,
                   warning_s: int, requeue: bool, site: Mapping[str, str | None],
                   gpus_per_task: int) -> list[str]:
    elastic = min_nodes < nodes
    # A node range asks for CPUs per node, not tasks: SLURM fixes a job's task count at
    # its first start (nodes x --ntasks-per-node), so a requeued job with a task count
    # would wait for all its nodes again instead of coming back on fewer. srun asks for
    # the tasks of each run (--ntasks-per-node); GPUs likewise per node, bound per task.
    header = [
        f"#SBATCH --job-name={_sbatch_value('--job_name', job_name)}",
        f"#SBATCH --nodes={f'{min_nodes}-{nodes}' if elastic else nodes}",
        f"#SBATCH --{'mincpus' if elastic else 'ntasks-per-node'}={tasks_per_node}",
        f"#SBATCH --output={job_name}-%j.out",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=B:USR1@{warning_s}",
        "#SBATCH --requeue" if requeue else "#SBATCH --no-requeue",
    ]
    for name, value in site.items():
        if value:
            header.append(f"#SBATCH --{name}={_sbatch_value('--' + name, value)}")
    if gpus_per_task:
        header.append(f"#SBATCH --gpus-per-node={gpus_per_task * tasks_per_node}" if elastic
                      else f"#SBATCH --gpus-per-task={gpus_per_task}")
    return header


# Through SLURM, not to srun: SIGTERM to srun makes SLURM kill the tasks before they save.
_WARNING_TRAP = warning_trap(
    "warning signal (USR1): SIGTERM to the tasks; they checkpoint and exit with $EXIT_PREEMPTED",
    'scancel --signal=TERM "$SLURM_JOB_ID" || log "scancel --signal=TERM failed; the tasks '
    'were not asked to save"')

_SLURM_BODY = r"""set -uo pipefail
if [ -z "${{SLURM_JOB_ID:-}}" ]; then
  echo "this is a SLURM batch script: submit it with sbatch (SLURM_JOB_ID is not set)" >&2
  exit 2
fi
# A task that saved a checkpoint after SIGTERM exits with this (tf_cluster.exit_codes.EXIT_PREEMPTED).
EXIT_PREEMPTED={exit_preempted}
# A task that lost a peer (a node died or became unreachable) exits with this (EXIT_PEER_LOST).
EXIT_PEER_LOST={exit_peer_lost}
REQUEUE={requeue}
TASKS_PER_NODE={tasks_per_node}
log() {{ echo "[slurm-job $(date -u +%Y-%m-%dT%H:%M:%S.%3NZ)] $*"; }}
# The workers of this run: every node SLURM gave the job (a range --nodes M-N may give
# fewer nodes after a requeue; training resumes on fewer workers).
NODES=${{SLURM_NNODES:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | wc -l)}}
WORKERS=$(( NODES * TASKS_PER_NODE ))
{trap}
requeue() {{  # $1: what happened
  if [ "$REQUEUE" = 1 ]; then
    log "$1: requeueing job $SLURM_JOB_ID; it resumes from the last checkpoint"
    if scontrol requeue "$SLURM_JOB_ID"; then
      exit 0
    fi
    log "scontrol requeue failed: submit this script again to resume from the checkpoint"
  else
    log "$1; not requeued (--no_requeue): submit this script again to resume"
  fi
}}
log "job $SLURM_JOB_ID, run $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )), nodes $SLURM_JOB_NODELIST ($NODES node(s) x $TASKS_PER_NODE task(s) = $WORKERS workers)"
# In the background: bash runs the trap only once the foreground command has ended.
{srun} &
srun_pid=$!
{wait}
if [ "$warned" = 1 ] && [ "$status" = "$EXIT_PREEMPTED" ]; then
  requeue "the tasks saved a checkpoint (exit $status)"
elif [ "$status" = "$EXIT_PEER_LOST" ]; then
  requeue "a task lost a peer (exit $status: a node failed or became unreachable)"
elif [ "$warned" = 1 ]; then
  log "after the warning signal the tasks ended with exit $status, not $EXIT_PREEMPTED: not requeued; see the task output above"
elif [ "$status" != 0 ]; then
  log "the tasks failed (exit $status): not requeued"
else
  log "done"
fi
exit "$status"
"""


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
        gpus = list(gpu_device_files() if gpu_devices is None else gpu_devices)
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
