"""``launch.multiworker --emit tfjob``: a Kubeflow ``TFJob`` manifest.

The training operator sets TF_CONFIG in every pod. Every replica has ``restartPolicy:
ExitCode``: the operator recreates a pod whose container exited 128-255 (signals, and
the retryable statuses of :mod:`tf_cluster.exit_codes`: 143 after a preemption
checkpoint, 170 when a task lost a peer) and fails the job on 1-127 (a configuration or
code error). The manifest is JSON, which is valid YAML: ``kubectl apply -f`` takes it.
"""

from __future__ import annotations

import json
import posixpath
import re
from typing import Callable, Sequence

from launch.cluster import SECURITY_NOTE, ClusterError, evaluator_command, trainer_command
from launch.flags import flag_value, sets_flag
from tf_cluster.storage_schemes import unreachable_scheme

# The training operator counts every failed pod, retryable or not, against
# runPolicy.backoffLimit; without --max_restarts a TFJob survives this many.
DEFAULT_TFJOB_BACKOFF_LIMIT = 10
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
_REMOTE_WORKDIR = re.compile(r"^[a-z][a-z0-9+.-]*://")
# A container image reference: [registry[:port]/]path[:tag][@digest] (the OCI grammar).
_DOMAIN_PART = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE = re.compile(
    rf"^(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*(?::[0-9]+)?/)?{_PATH_PART}(?:/{_PATH_PART})*"
    r"(?::[\w][\w.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


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
    if len(claim) > 253 or not _DNS_SUBDOMAIN.match(claim):
        raise ClusterError(f"--volume claim {claim!r} is not a valid Kubernetes name "
                           f"(lower-case letters, digits, '-' and '.', starting and ending "
                           f"with a letter or digit, at most 253 characters).")
    return claim, mount.rstrip("/") or "/"


def _workdir_findings(workdir: str | None, mount: str | None) -> tuple[str | None, str | None]:
    """(error, warning) about ``workdir`` being on storage every pod shares."""
    if workdir is None:
        return None, ("no --workdir in the trainer flags: trainer.main needs one, on storage "
                      "every pod shares (--volume CLAIM:MOUNT and --workdir=MOUNT/run).")
    if _REMOTE_WORKDIR.match(workdir):
        # A gs:// bucket is shared by construction; a URL TensorFlow cannot write
        # (s3://) fails every pod: the trainer's own line, before any pod starts.
        return unreachable_scheme(workdir, "--workdir"), None
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
    operator recreates a pod whose container exited with 128-255 (signals, 143 after a
    preemption checkpoint, 170 when a task lost a peer) and fails the job on 1-127 (a
    configuration or code error). Each failed pod counts against
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
    if backoff_limit is None:
        backoff_limit = DEFAULT_TFJOB_BACKOFF_LIMIT
    _check_values(num_tasks, trainer_flags, image, backoff_limit, gpus_per_worker, cpu, memory)
    check_job_name(name, num_tasks, chief, evaluator)
    claim, mount = parse_volume(volume) if volume else (None, None)
    error, warning = _workdir_findings(flag_value(trainer_flags, "--workdir"), mount)
    if error:
        raise ClusterError(error)
    if warning and warn is not None:
        warn(warning)
    resources = _Resources(image, cpu, memory, claim, mount)
    train = trainer_command(module, trainer_flags)
    specs = {}
    if chief:
        specs["Chief"] = resources.replica(1, train, gpus_per_worker)
    if num_tasks - int(chief):
        specs["Worker"] = resources.replica(num_tasks - int(chief), train, gpus_per_worker)
    if evaluator:
        specs["Evaluator"] = resources.replica(1, evaluator_command(module, trainer_flags),
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


def check_job_name(name: str, num_tasks: int, chief: bool, evaluator: bool) -> None:
    """Raises ClusterError unless ``name`` makes valid names for the TFJob and for the
    services the operator creates, ``NAME-REPLICATYPE-INDEX`` (DNS-1123 labels: at most
    63 lower-case letters, digits and '-', starting and ending with a letter or digit)."""
    longest = max([f"worker-{num_tasks - 1}"] + ["chief-0"] * chief + ["evaluator-0"] * evaluator,
                  key=len)
    room = 63 - len(longest) - 1
    if not _DNS_LABEL.match(name) or len(name) > room:
        raise ClusterError(f"--job_name={name!r} cannot name a TFJob: it must be a DNS-1123 "
                           f"label (lower-case letters, digits and '-', starting and ending "
                           f"with a letter or digit) of at most {room} characters here (the "
                           f"operator names services {name}-{longest}), e.g. 'mnist-run1'.")


def _check_values(num_tasks: int, trainer_flags: Sequence[str], image: str,
                  backoff_limit: int, gpus_per_worker: int, cpu: str | None,
                  memory: str | None) -> None:
    if num_tasks < 1:
        raise ClusterError(f"--workers={num_tasks} must be >= 1.")
    if not image:
        raise ClusterError("--emit tfjob needs --image: the container image with this package "
                           "and your model installed.")
    if len(image) > 4096 or not _IMAGE.match(image):
        raise ClusterError(f"--image={image!r} is not a container image reference; write "
                           f"[REGISTRY[:PORT]/]PATH[:TAG][@sha256:DIGEST] with a lower-case "
                           f"PATH, e.g. 'registry.example:5000/team/trainer:1.2'.")
    if backoff_limit < 0:
        raise ClusterError(f"--max_restarts={backoff_limit} must be >= 0.")
    if gpus_per_worker < 0:
        raise ClusterError(f"--gpus_per_worker={gpus_per_worker} must be >= 0.")
    for flag, value in (("--cpu", cpu), ("--memory", memory)):
        if value is not None and not _QUANTITY.match(value):
            raise ClusterError(f"{flag}={value!r} is not a Kubernetes quantity; write e.g. "
                               f"'4' or '500m' for CPUs, '16Gi' for memory.")
    if sets_flag(trainer_flags, "--mode"):
        raise ClusterError("--mode is set per replica in a TFJob (training replicas train, the "
                           "evaluator runs --mode=continuous_eval); remove it from the flags.")


class _Resources:
    """What every replica's pod gets: the image, resource requests, the shared volume."""

    def __init__(self, image: str, cpu: str | None, memory: str | None,
                 claim: str | None, mount: str | None):
        self.image, self.claim, self.mount = image, claim, mount
        self.requests = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}

    def replica(self, count: int, command: list[str], gpus: int) -> dict:
        """One ``tfReplicaSpecs`` entry: ``count`` pods running ``command``."""
        container: dict = {"name": "tensorflow", "image": self.image, "command": command}
        resources: dict = {}
        if self.requests:
            resources["requests"] = dict(self.requests)
        if gpus:
            resources["limits"] = {"nvidia.com/gpu": gpus}
        if resources:
            container["resources"] = resources
        pod: dict = {"containers": [container]}
        if self.claim:
            container["volumeMounts"] = [{"name": "workdir", "mountPath": self.mount}]
            pod["volumes"] = [{"name": "workdir",
                               "persistentVolumeClaim": {"claimName": self.claim}}]
        return {"replicas": count, "restartPolicy": "ExitCode", "template": {"spec": pod}}
