"""``python -m launch.multiworker --emit tf_config|slurm|tfjob``: a cluster's files.

Builds the file an existing scheduler needs from the parsed command line (per-host
TF_CONFIG: :mod:`launch.hosts`; the sbatch script: :mod:`launch.slurm`; the TFJob
manifest: :mod:`launch.tfjob`), runs ``trainer.main``'s TensorFlow-free check once where
the job's size is fixed, and writes it. Spawns nothing.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from launch import hosts, slurm, tfjob
from launch.cluster import (SECURITY_NOTE, ClusterError, check_private_hosts,
                            cluster_from_addresses, parse_hosts)
from launch.group import preflight_elsewhere

EXIT_USAGE = 2
EMIT_PORT = 12345  # --port's default for --emit (the per-host launcher's is hosts.DEFAULT_PORT)


def emit_text(args: argparse.Namespace, log: Callable[[str], None]) -> str:
    """The file ``--emit tf_config|slurm|tfjob`` asks for, from the parsed flags."""
    port = EMIT_PORT if args.port is None else args.port
    if args.emit == "tf_config":
        addresses = parse_hosts(args.hosts, port)
        for warning in check_private_hosts(addresses, args.allow_public_bind):
            log(f"[launcher] warning: {warning}")
        cluster = cluster_from_addresses(addresses, args.chief, args.evaluator)
        training = len(cluster.get("chief", [])) + len(cluster.get("worker", []))
        if args.workers is not None and args.workers != training:
            raise ClusterError(
                f"--workers={args.workers} but --hosts gives {training} training task(s); "
                f"drop --workers or list one host per task.")
        log(f"[launcher] {SECURITY_NOTE}")
        return hosts.emit_tf_config(cluster)
    if args.emit == "slurm":
        min_nodes, nodes = args.node_range
        return slurm.emit_slurm(
            args.trainer_flags, nodes, args.tasks_per_node, min_nodes=min_nodes, port=port,
            chief=args.chief, job_name=args.job_name, module=args.module,
            time_limit=args.time, partition=args.partition, account=args.account,
            warning_s=args.warning_s, requeue=args.requeue, gpus_per_task=args.gpus_per_worker)
    return tfjob.emit_tfjob(
        args.workers, args.trainer_flags, image=args.image, chief=args.chief,
        evaluator=args.evaluator, name=args.job_name, module=args.module,
        backoff_limit=args.backoff_limit, volume=args.volume,
        gpus_per_worker=args.gpus_per_worker, cpu=args.cpu, memory=args.memory,
        warn=lambda message: log(f"[launcher] warning: {message}"))


def emitted_replicas(args: argparse.Namespace) -> int:
    """The replicas of the emitted job when its size is fixed (0 when not known): every
    training task has ``--gpus_per_worker`` GPUs, or one CPU."""
    if args.emit == "slurm":
        min_nodes, nodes = args.node_range
        if min_nodes != nodes:
            return 0
        workers = nodes * args.tasks_per_node
    else:
        workers = args.workers
    return workers * max(args.gpus_per_worker, 1)


def write(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    """Emits, checks the trainer flags once where the job's size is known, and writes
    to ``--output`` (``-``: stdout); returns the exit status (2 for a usage error)."""
    try:
        text = emit_text(args, log)
    except (ClusterError, ValueError) as error:
        log(f"launch.multiworker: {error}")
        return EXIT_USAGE
    if args.check and args.emit in ("slurm", "tfjob"):
        checked = preflight_elsewhere(args.module, args.trainer_flags, log,
                                      replicas=emitted_replicas(args))
        if checked:
            return checked
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
        log(f"[launcher] wrote {args.output}")
    return 0
