"""Cluster outputs for existing schedulers: per-host TF_CONFIG, a SLURM script, a TFJob.

The launcher does not schedule anything on other machines. For a real cluster it
prints what an existing engine needs:

* :func:`emit_tf_config`: one TF_CONFIG per host of ``--hosts`` (a JSON object keyed by
  task name, one task per line), for hosts you start yourself;
* :func:`emit_slurm`: an sbatch script; each SLURM task (one or several per node)
  derives its TF_CONFIG from the job's environment (``python -m launch.tf_config
  --from_slurm``) and execs the trainer; a warning signal before the time limit makes
  the tasks checkpoint, and the job requeues itself to resume;
* :func:`emit_tfjob`: a Kubeflow ``TFJob`` manifest (the training operator sets
  TF_CONFIG in every pod) whose pods are recreated after a preemption (exit 143). It is
  JSON, which is valid YAML: ``kubectl apply -f`` takes it.

Security: TensorFlow's worker-to-worker gRPC has no authentication and no encryption;
anyone who reaches a worker's port can run ops in it. :func:`check_private_hosts`
refuses host addresses that are public unless the caller explicitly allows them.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import json
import posixpath
import re
import shlex
import socket
from typing import Callable, Sequence

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


def evaluator_command(module: str, trainer_flags: Sequence[str], python: str = "python") -> list[str]:
    """The argv of the evaluator task: ``module`` with ``trainer_flags`` in
    ``--mode=continuous_eval`` (it watches the workdir's checkpoints and evaluates each).

    No ``--config.distribute.strategy=multi_worker``: the evaluator uses one device and
    does not join the training collectives.
    """
    return [python, "-m", module, *trainer_flags, "--mode=continuous_eval"]


# trainer.main's exit status after a preemption save (trainer.checkpoint.preemption.EXIT_PREEMPTED;
# not imported: launch/ does not import TensorFlow). 143 = 128 + SIGTERM: what a process
# killed by SIGTERM reports, and a code schedulers retry (the Kubeflow training operator's
# ExitCode policy retries 128-255 and treats 1-127 as permanent).
EXIT_PREEMPTED = 143
DEFAULT_WARNING_S = 300
# The training operator counts every failed pod, retryable or not, against
# runPolicy.backoffLimit; without --max_restarts a TFJob survives this many.
DEFAULT_TFJOB_BACKOFF_LIMIT = 10
_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.:,+/@%=-]+$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
_REMOTE_WORKDIR = re.compile(r"^[a-z][a-z0-9+.-]*://")


def _sbatch_value(flag: str, value: str) -> str:
    if not _SBATCH_VALUE.match(value):
        raise ClusterError(f"{flag}={value!r} cannot go on an #SBATCH line (spaces, quotes or "
                           f"newlines); give a plain value such as '1-00:00:00' or 'gpu'.")
    return value


def emit_slurm(
    num_tasks: int, trainer_flags: Sequence[str], port: int = 12345, chief: bool = False,
    job_name: str = "tf-trainer", module: str = "trainer.main", tasks_per_node: int = 1,
    time_limit: str | None = None, partition: str | None = None, account: str | None = None,
    warning_s: int = DEFAULT_WARNING_S, requeue: bool = True, gpus_per_task: int = 0,
) -> str:
    """An sbatch script for ``num_tasks`` training tasks, ``tasks_per_node`` per node.

    ``num_tasks`` must be a multiple of ``tasks_per_node``; the job asks for
    ``num_tasks / tasks_per_node`` nodes. Each task runs ``python -m launch.tf_config
    --from_slurm --port P --tasks_per_node T -- python -m MODULE FLAGS``: its TF_CONFIG
    comes from the step's environment (local task i listens on ``P + i``) and, on GPU
    nodes with several tasks, it sees only its own GPU(s). ``time_limit``, ``partition``,
    ``account`` become ``--time``, ``--partition``, ``--account``; ``gpus_per_task``
    ``--gpus-per-task`` (SLURM then binds each task to its GPUs).

    Preemption and time limits: the job asks for ``USR1`` ``warning_s`` seconds before
    its time limit (``--signal=B:USR1@S``; ``scancel --batch --signal=USR1 JOB`` does the
    same by hand). The script then sends SIGTERM to the tasks through SLURM (``scancel
    --signal=TERM``; signalling ``srun`` itself would make SLURM kill the tasks before
    they save), the tasks checkpoint and exit with :data:`EXIT_PREEMPTED`, and, with
    ``requeue``, the script requeues the job (``scontrol requeue``), which resumes from
    that checkpoint. A job that ends for any other reason is not requeued and keeps its
    exit status. ``srun`` runs in the background so that bash can run the trap while it
    waits (bash runs traps only between foreground commands).

    Raises:
      ClusterError: for counts that do not fit or values that cannot go on an
        ``#SBATCH`` line.
    """
    if num_tasks < 1:
        raise ClusterError(f"--workers={num_tasks} must be >= 1.")
    if tasks_per_node < 1:
        raise ClusterError(f"--tasks_per_node={tasks_per_node} must be >= 1.")
    if num_tasks % tasks_per_node:
        raise ClusterError(f"--workers={num_tasks} is not a multiple of --tasks_per_node="
                           f"{tasks_per_node}; every node runs the same number of tasks.")
    if warning_s < 1:
        raise ClusterError(f"--warning_s={warning_s} must be >= 1 (seconds before the time "
                           f"limit at which SLURM sends the warning signal).")
    if gpus_per_task < 0:
        raise ClusterError(f"--gpus_per_worker={gpus_per_task} must be >= 0.")
    nodes = num_tasks // tasks_per_node
    tf_config_cmd = ["python", "-m", "launch.tf_config", "--from_slurm", f"--port={port}",
                     f"--tasks_per_node={tasks_per_node}"]
    if chief:
        tf_config_cmd.append("--chief")
    srun = shlex.join(["srun", "--kill-on-bad-exit=1", "--distribution=block", *tf_config_cmd,
                       "--", *trainer_command(module, trainer_flags)])
    header = [
        f"#SBATCH --job-name={_sbatch_value('--job_name', job_name)}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={tasks_per_node}",
        f"#SBATCH --output={job_name}-%j.out",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=B:USR1@{warning_s}",
        "#SBATCH --requeue" if requeue else "#SBATCH --no-requeue",
    ]
    for flag, name, value in (("--time", "time", time_limit), ("--partition", "partition", partition),
                              ("--account", "account", account)):
        if value:
            header.append(f"#SBATCH --{name}={_sbatch_value(flag, value)}")
    if gpus_per_task:
        header.append(f"#SBATCH --gpus-per-task={gpus_per_task}")
    body = _SLURM_BODY.format(exit_preempted=EXIT_PREEMPTED, requeue=int(requeue), srun=srun)
    return "\n".join([
        "#!/bin/bash",
        "# Generated by `python -m launch.multiworker --emit slurm`. Add your site's",
        "# #SBATCH lines (--gres=gpu:N, --mem, ...) right after the generated ones: sbatch",
        "# reads them only above the first command.",
        f"# {SECURITY_NOTE}",
        *header,
        body,
    ])


_SLURM_BODY = r"""set -uo pipefail
if [ -z "${{SLURM_JOB_ID:-}}" ]; then
  echo "this is a SLURM batch script: submit it with sbatch (SLURM_JOB_ID is not set)" >&2
  exit 2
fi
# A task that saved a checkpoint after SIGTERM exits with this (trainer.checkpoint.preemption.EXIT_PREEMPTED).
EXIT_PREEMPTED={exit_preempted}
REQUEUE={requeue}
log() {{ echo "[slurm-job $(date -u +%Y-%m-%dT%H:%M:%S.%3NZ)] $*"; }}
warned=0
interrupted=0
on_warning() {{
  interrupted=1
  [ "$warned" = 1 ] && return
  warned=1
  log "warning signal (USR1): SIGTERM to the tasks; they checkpoint and exit with $EXIT_PREEMPTED"
  # Through SLURM, not to srun: SIGTERM to srun makes SLURM kill the tasks before they save.
  scancel --signal=TERM "$SLURM_JOB_ID" || log "scancel --signal=TERM failed; the tasks were not asked to save"
}}
trap on_warning USR1
log "job $SLURM_JOB_ID, run $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )), nodes $SLURM_JOB_NODELIST"
# In the background: bash runs the trap only once the foreground command has ended.
{srun} &
srun_pid=$!
last=
while :; do
  interrupted=0
  wait "$srun_pid"; code=$?
  if [ "$code" = 127 ] && [ -n "$last" ]; then status=$last; break; fi  # already reaped
  if [ "$interrupted" = 0 ]; then status=$code; break; fi
  last=$code  # the trap interrupted wait; srun may still run
done
if [ "$warned" = 1 ] && [ "$status" = "$EXIT_PREEMPTED" ]; then
  if [ "$REQUEUE" = 1 ]; then
    log "the tasks saved a checkpoint (exit $status): requeueing job $SLURM_JOB_ID; it resumes from that checkpoint"
    if scontrol requeue "$SLURM_JOB_ID"; then
      exit 0
    fi
    log "scontrol requeue failed: submit this script again to resume from the checkpoint"
  else
    log "the tasks saved a checkpoint (exit $status); not requeued (--no_requeue): submit this script again to resume"
  fi
elif [ "$warned" = 1 ]; then
  log "after the warning signal the tasks ended with exit $status, not $EXIT_PREEMPTED: not requeued; see the task output above"
elif [ "$status" != 0 ]; then
  log "the tasks failed (exit $status): not requeued"
else
  log "done"
fi
exit "$status"
"""


def parse_volume(text: str) -> tuple[str, str]:
    """Splits ``--volume CLAIM:MOUNT`` into ``(claim, mount_path)``.

    Raises:
      ClusterError: when either part is missing or the mount path is not absolute.
    """
    claim, sep, mount = text.partition(":")
    if not sep or not claim or not mount.startswith("/"):
        raise ClusterError(f"--volume={text!r} is not CLAIM:MOUNT; give the name of a "
                           f"PersistentVolumeClaim and an absolute mount path, e.g. "
                           f"'runs:/mnt/runs'.")
    if not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", claim):
        raise ClusterError(f"--volume claim {claim!r} is not a valid Kubernetes name "
                           f"(lower-case letters, digits, '-' and '.').")
    return claim, mount.rstrip("/") or "/"


def _workdir_findings(workdir: str | None, mount: str | None) -> tuple[str | None, str | None]:
    """(error, warning) about ``workdir`` being on storage every pod shares."""
    if workdir is None:
        return None, ("no --workdir in the trainer flags: trainer.main needs one, on storage "
                      "every pod shares (--volume CLAIM:MOUNT and --workdir=MOUNT/run).")
    if _REMOTE_WORKDIR.match(workdir):
        return None, None  # a bucket (gs://, s3://, ...): shared by construction
    if mount is None:
        return None, (f"--workdir={workdir} is a path inside each pod's own filesystem: "
                      f"checkpoints are lost when a pod restarts and the evaluator never sees "
                      f"them. Add --volume CLAIM:MOUNT (a shared PersistentVolumeClaim) and a "
                      f"--workdir under MOUNT, or use a bucket (gs://...).")
    norm = posixpath.normpath(workdir)
    if mount != "/" and not (norm == mount or norm.startswith(mount + "/")):
        return (f"--workdir={workdir} is not under the volume mounted at {mount}: the pods "
                f"would not share checkpoints. Use --workdir={mount}/<run>."), None
    return None, None


def emit_tfjob(
    num_tasks: int, trainer_flags: Sequence[str], image: str, chief: bool = False,
    evaluator: bool = False, name: str = "tf-trainer", module: str = "trainer.main",
    backoff_limit: int | None = None, volume: str | None = None, gpus_per_worker: int = 0,
    cpu: str | None = None, memory: str | None = None,
    warn: Callable[[str], None] | None = None,
) -> str:
    """A Kubeflow ``TFJob`` manifest (JSON, valid YAML) for ``num_tasks`` training tasks.

    With ``chief`` one of them is the ``Chief`` replica and ``num_tasks - 1`` are
    ``Worker`` replicas; ``evaluator`` adds one ``Evaluator`` that runs
    :func:`evaluator_command` (``--mode=continuous_eval``, one device). The operator
    sets TF_CONFIG in each pod.

    Restarts: every replica has ``restartPolicy: ExitCode``, under which the training
    operator recreates a pod whose container exited with 128-255 (signals, and
    :data:`EXIT_PREEMPTED` = 143 after a preemption checkpoint) and fails the job on
    1-127 (a configuration or code error). Each failed pod counts against
    ``runPolicy.backoffLimit``: ``backoff_limit`` (``--max_restarts``), by default
    :data:`DEFAULT_TFJOB_BACKOFF_LIMIT` so that a job survives several preemptions.

    ``volume`` (``"CLAIM:MOUNT"``) mounts that PersistentVolumeClaim at MOUNT in every
    replica; the trainer's ``--workdir`` must lie under it (or be a bucket URL), since
    every pod writes or reads the same checkpoints. ``gpus_per_worker`` sets the
    ``nvidia.com/gpu`` limit of training replicas (the evaluator gets one GPU when it is
    > 0); ``cpu`` / ``memory`` are every container's resource requests (``"4"``,
    ``"16Gi"``). Warnings (a workdir that is not shared) go to ``warn``.

    Raises:
      ClusterError: for a missing image, a bad count, volume or quantity, a workdir
        outside the mounted volume, or a ``--mode`` flag (set per replica here).
    """
    if num_tasks < 1:
        raise ClusterError(f"--workers={num_tasks} must be >= 1.")
    if not image:
        raise ClusterError("--emit tfjob needs --image: the container image with this package "
                           "and your model installed.")
    if backoff_limit is None:
        backoff_limit = DEFAULT_TFJOB_BACKOFF_LIMIT
    if backoff_limit < 0:
        raise ClusterError(f"--max_restarts={backoff_limit} must be >= 0.")
    if gpus_per_worker < 0:
        raise ClusterError(f"--gpus_per_worker={gpus_per_worker} must be >= 0.")
    for flag, value in (("--cpu", cpu), ("--memory", memory)):
        if value is not None and not _QUANTITY.match(value):
            raise ClusterError(f"{flag}={value!r} is not a Kubernetes quantity; write e.g. "
                               f"'4' or '500m' for CPUs, '16Gi' for memory.")
    if any(f == "--mode" or f.startswith("--mode=") for f in trainer_flags):
        raise ClusterError("--mode is set per replica in a TFJob (training replicas train, the "
                           "evaluator runs --mode=continuous_eval); remove it from the flags.")
    claim, mount = parse_volume(volume) if volume else (None, None)
    error, warning = _workdir_findings(_flag_value(trainer_flags, "--workdir"), mount)
    if error:
        raise ClusterError(error)
    if warning and warn is not None:
        warn(warning)

    def replica(count: int, command: list[str], gpus: int) -> dict:
        container: dict = {"name": "tensorflow", "image": image, "command": command}
        resources: dict = {}
        requests = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
        if requests:
            resources["requests"] = requests
        if gpus:
            resources["limits"] = {"nvidia.com/gpu": gpus}
        if resources:
            container["resources"] = resources
        pod: dict = {"containers": [container]}
        if claim:
            container["volumeMounts"] = [{"name": "workdir", "mountPath": mount}]
            pod["volumes"] = [{"name": "workdir", "persistentVolumeClaim": {"claimName": claim}}]
        return {"replicas": count, "restartPolicy": "ExitCode", "template": {"spec": pod}}

    train = trainer_command(module, trainer_flags)
    specs = {}
    if chief:
        specs["Chief"] = replica(1, train, gpus_per_worker)
    if num_tasks - int(chief):
        specs["Worker"] = replica(num_tasks - int(chief), train, gpus_per_worker)
    if evaluator:
        specs["Evaluator"] = replica(1, evaluator_command(module, trainer_flags),
                                     min(gpus_per_worker, 1))
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


def _flag_value(flags: Sequence[str], name: str) -> str | None:
    """The value of ``--name=V`` or ``--name V`` in ``flags`` (the last one wins), or None."""
    value = None
    for i, flag in enumerate(flags):
        if flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
        elif flag == name and i + 1 < len(flags):
            value = flags[i + 1]
    return value
