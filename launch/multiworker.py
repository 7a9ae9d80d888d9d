"""``python -m launch.multiworker``: a local multi-worker group, or a cluster's configs.

Local group (every task on this machine, loopback only)::

    python -m launch.multiworker --workers 4 [--chief] [--evaluator] [--max_restarts R] \\
        [--start_timeout S] [--hang_timeout S] [--frozen_timeout S] [--grace_s G] \\
        [--collective_timeout_s S] --config=models/configs/digits.py --workdir=/tmp/run

``--data_service_workers K`` adds a tf.data service to the group: a dispatcher and K
service workers (:mod:`launch.data_service`), stopped with it; the training tasks get
``--config.data.service=127.0.0.1:PORT`` (they need ``--config.train.deterministic=False``,
see :mod:`trainer.data`). A service process that dies stops the group like a task.

``--workers N`` is the number of training processes; with ``--chief`` the first one is
the ``chief`` task, the others ``worker:0..N-2``. Every training task runs
``python -m trainer.main FLAGS --config.distribute.strategy=multi_worker`` with its own
TF_CONFIG on free 127.0.0.1 ports, and its output lines are prefixed ``[worker:1] ``.
``--evaluator`` adds an ``evaluator`` task running ``python -m trainer.main FLAGS
--mode=continuous_eval`` (one device, outside the training collectives): it evaluates
each checkpoint the chief writes and exits once it evaluated the final one, and the
group waits for it (``--mode`` in FLAGS is refused: it is set per task).
Every argument the launcher does not know is passed to the trainer unchanged (after
``--`` everything is).

The launcher owns the tasks' lives (see :mod:`launch._process`): when one fails, hangs
or freezes the others are stopped (SIGTERM, SIGKILL after ``--grace_s``) and, with
``--max_restarts R``, the whole group is restarted up to R times on new ports (a task
that exits 143, preempted after saving a checkpoint, restarts it without counting); the
trainer resumes from the latest checkpoint in its workdir if there is one. A port taken
between the pick and TensorFlow's bind restarts the group on new ports without counting
as a restart. SIGINT / SIGTERM / SIGHUP to the launcher stop every task the same way;
a second one sends SIGKILL at once.

Exit status: 0 when every training task exited 0; otherwise the failing task's status
(``128 + N`` if it was killed by signal N), 124 when a task was declared hung, ``128 + N``
when the launcher itself got signal N, 2 for a usage error. Before starting any task the
launcher runs ``trainer.main``'s TensorFlow-free checks once (``--check_only``: flags,
config file, workdir) and reports a failure once, with that check's status (2 or 1).

Cluster mode prints instead of spawning (see :mod:`launch.cluster`)::

    python -m launch.multiworker --hosts 10.0.0.1:2222,10.0.0.2:2222 --emit tf_config
    python -m launch.multiworker --workers 4 --emit slurm [--tasks_per_node 2] [--port 12345] \\
        [--time T] [--partition P] [--account A] [--warning_s S] [--no_requeue] FLAGS > job.sbatch
    python -m launch.multiworker --workers 4 --chief --evaluator --emit tfjob --image IMG \\
        --volume CLAIM:/mnt/runs [--gpus_per_worker N] [--cpu C] [--memory M] \\
        FLAGS --workdir=/mnt/runs/run1 > tfjob.yaml

Public host addresses are refused unless ``--allow_public_bind``: TensorFlow's gRPC has
no authentication or encryption. Local tasks have 127.0.0.1 addresses, but TensorFlow's
gRPC server listens on ``0.0.0.0:PORT`` whatever the address (it has no bind option), so
a host firewall is what keeps a local group's ports off other networks.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

from launch import cluster as cluster_lib
from launch import data_service
from launch._process import Bounds, GroupResult, ProcessGroup, StopSignals, TaskSpec
from launch.tf_config import build_tf_config, cluster_tasks, task_name

EXIT_USAGE = 2
_PORT_RETRIES = 3
_RESTART_PAUSE_S = 1.0
_STRATEGY_FLAG = "--config.distribute.strategy"


def pick_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Returns ``count`` distinct ports that were free on ``host`` a moment ago.

    All sockets are held open until every port is picked, so the ports are distinct;
    another process may still take one before the task binds it (the group then retries
    on new ports).
    """
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def local_cluster(workers: int, chief: bool, evaluator: bool, ports: Sequence[int]) -> dict:
    """The cluster dict of a local group on 127.0.0.1 ``ports`` (chief, workers, evaluator)."""
    addresses = [f"127.0.0.1:{port}" for port in ports]
    if len(addresses) != workers + int(evaluator):
        raise ValueError(f"need {workers + int(evaluator)} ports, got {len(addresses)}.")
    return cluster_lib.cluster_from_addresses(addresses, chief=chief, evaluator=evaluator)


def task_specs(
    cluster: dict, module: str, trainer_flags: Sequence[str], collective_timeout_s: int = 0,
    environ: dict[str, str] | None = None,
) -> list[TaskSpec]:
    """One :class:`TaskSpec` per task of ``cluster``, each with its own TF_CONFIG: the
    training tasks run :func:`launch.cluster.trainer_command`, the evaluator
    :func:`launch.cluster.evaluator_command` (``--mode=continuous_eval``, one device)."""
    argv = cluster_lib.trainer_command(module, trainer_flags, python=sys.executable)
    if collective_timeout_s:
        argv.append(f"--config.distribute.collective_timeout_s={collective_timeout_s}")
    evaluator_argv = cluster_lib.evaluator_command(module, trainer_flags, python=sys.executable)
    base_env = dict(os.environ if environ is None else environ, PYTHONUNBUFFERED="1")
    return [
        TaskSpec(
            name=task_name(kind, index),
            argv=evaluator_argv if kind == "evaluator" else argv,
            env={**base_env, "TF_CONFIG": json.dumps(build_tf_config(cluster, kind, index))},
        )
        for kind, index, _ in cluster_tasks(cluster)
    ]


def _flag_value(flags: Sequence[str], name: str) -> str | None:
    for i, flag in enumerate(flags):
        if flag.startswith(name + "="):
            return flag.split("=", 1)[1]
        if flag == name and i + 1 < len(flags):
            return flags[i + 1]
    return None


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default in ``--help``
    (not the None/False of options that are off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


# The trainer module whose flags the launcher checks once before starting any task.
CHECKED_MODULE = "trainer.main"
_CHECK_TIMEOUT_S = 120.0


def preflight(module: str, trainer_flags: Sequence[str], log,
              environ: dict[str, str] | None = None) -> int:
    """Checks the tasks' shared flags once, before any task starts; returns 0 or the
    check's exit status (2 usage, 1 config/workdir) after logging its message once.

    For ``trainer.main`` (:data:`CHECKED_MODULE`) this runs ``python -m trainer.main
    FLAGS --config.distribute.strategy=multi_worker --check_only``: the trainer's own
    TensorFlow-free checks of the flags, config file and workdir (about a second; this
    package never imports ``trainer``). Other modules are not checked.
    """
    if module != CHECKED_MODULE:
        return 0
    argv = [*cluster_lib.trainer_command(module, trainer_flags, python=sys.executable),
            "--check_only"]
    env = {k: v for k, v in (os.environ if environ is None else environ).items()
           if k != "TF_CONFIG"}
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log(f"[launcher] warning: the flag check did not finish in {_CHECK_TIMEOUT_S:g} s; "
            f"starting the tasks anyway.")
        return 0
    if proc.returncode == 0:
        return 0
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()][-3:]
    log("[launcher] no task was started: the trainer flags fail " + module + "'s checks.")
    for line in lines:
        log(line)
    return proc.returncode


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launch.multiworker", description=__doc__, allow_abbrev=False,
        formatter_class=_HelpFormatter,
        usage="%(prog)s --workers N [options] TRAINER_FLAGS...")
    group = parser.add_argument_group("local group")
    group.add_argument("--workers", type=int, help="number of training processes")
    group.add_argument("--chief", action="store_true", help="the first task is the chief")
    group.add_argument("--evaluator", action="store_true", help="add an evaluator task")
    group.add_argument("--max_restarts", type=int, default=None,
                       help="restart the whole group up to R times after a failure (default "
                            "0); --emit tfjob: runPolicy.backoffLimit (default "
                            f"{cluster_lib.DEFAULT_TFJOB_BACKOFF_LIMIT})")
    group.add_argument("--start_timeout", type=float, default=300.0, metavar="S",
                       help="a task that writes nothing within S s of its start is hung (0: off)")
    group.add_argument("--hang_timeout", type=float, default=0.0, metavar="S",
                       help="the group is hung when no task writes anything for S s (0: off)")
    group.add_argument("--frozen_timeout", type=float, default=30.0, metavar="S",
                       help="a task stopped (SIGSTOP) for S s is hung (0: off)")
    group.add_argument("--grace_s", type=float, default=10.0,
                       help="seconds between SIGTERM and SIGKILL when stopping tasks")
    group.add_argument("--collective_timeout_s", type=int, default=0,
                       help="pass --config.distribute.collective_timeout_s=S to the tasks "
                            "(0: leave the config's value)")
    group.add_argument("--data_service_workers", type=int, default=0, metavar="K",
                       help="also start a tf.data service (a dispatcher and K workers, "
                            "owned by the group) and pass --config.data.service=ADDRESS "
                            "to the training tasks (0: no service)")
    group.add_argument("--module", default="trainer.main",
                       help="the entry point each task runs with `python -m` (it must accept "
                            "trainer.main's flags)")
    emit = parser.add_argument_group("cluster outputs (print, do not spawn)")
    emit.add_argument("--emit", choices=("tf_config", "slurm", "tfjob"))
    emit.add_argument("--hosts", help="--emit tf_config: 'h1:port,h2:port,...' in task order")
    emit.add_argument("--port", type=int, default=12345,
                      help="port for --hosts entries without one; --emit slurm: base port "
                           "(local task i of a node listens on port + i)")
    emit.add_argument("--tasks_per_node", type=int, default=1,
                      help="--emit slurm: tasks per node (one per GPU is usual); --workers "
                           "must be a multiple")
    emit.add_argument("--nodes", type=int, default=None,
                      help="--emit slurm: number of nodes (default --workers / --tasks_per_node; "
                           "with --nodes alone, --workers = nodes x tasks_per_node)")
    emit.add_argument("--time", default=None, help="--emit slurm: #SBATCH --time (time limit)")
    emit.add_argument("--partition", default=None, help="--emit slurm: #SBATCH --partition")
    emit.add_argument("--account", default=None, help="--emit slurm: #SBATCH --account")
    emit.add_argument("--warning_s", type=int, default=cluster_lib.DEFAULT_WARNING_S,
                      help="--emit slurm: SLURM sends the warning signal (USR1) this many "
                           "seconds before the time limit; the tasks then checkpoint")
    emit.add_argument("--requeue", dest="requeue", action="store_true", default=True,
                      help="--emit slurm: requeue the job after a preemption checkpoint (default)")
    emit.add_argument("--no_requeue", dest="requeue", action="store_false",
                      help="--emit slurm: do not requeue; resubmit by hand to resume")
    emit.add_argument("--image", default="", help="--emit tfjob: the container image")
    emit.add_argument("--volume", default=None, metavar="CLAIM:MOUNT",
                      help="--emit tfjob: PersistentVolumeClaim mounted at MOUNT in every "
                           "replica; --workdir must be under MOUNT")
    emit.add_argument("--gpus_per_worker", type=int, default=0,
                      help="--emit tfjob: nvidia.com/gpu limit per training replica; "
                           "--emit slurm: #SBATCH --gpus-per-task")
    emit.add_argument("--cpu", default=None, help="--emit tfjob: CPU request per replica ('4')")
    emit.add_argument("--memory", default=None,
                      help="--emit tfjob: memory request per replica ('16Gi')")
    emit.add_argument("--job_name", default="tf-trainer", help="SLURM job / TFJob name")
    emit.add_argument("--output", default="-", help="file to write the output to ('-': stdout)")
    emit.add_argument("--allow_public_bind", action="store_true",
                      help="accept public addresses in --hosts (gRPC is unauthenticated!)")
    return parser


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = _parser()
    argv = list(argv)
    tail = []
    if "--" in argv:
        cut = argv.index("--")
        argv, tail = argv[:cut], argv[cut + 1:]
    args, trainer_flags = parser.parse_known_args(argv)
    args.trainer_flags = trainer_flags + tail
    if any(f == _STRATEGY_FLAG or f.startswith(_STRATEGY_FLAG + "=") for f in args.trainer_flags):
        parser.error(f"{_STRATEGY_FLAG} is set by this launcher (multi_worker); remove it.")
    if args.emit is None and any(f == "--mode" or f.startswith("--mode=")
                                 for f in args.trainer_flags):
        parser.error("--mode is set per task by this launcher (training tasks train, the "
                     "--evaluator task runs --mode=continuous_eval); remove it.")
    max_restarts_given = args.max_restarts is not None
    if args.max_restarts is None:
        args.max_restarts = 0
    if args.data_service_workers < 0:
        parser.error(f"--data_service_workers={args.data_service_workers} must be >= 0.")
    if args.data_service_workers:
        if args.emit is not None:
            parser.error("--data_service_workers starts local processes; with --emit, start "
                         "the service on its machines with `python -m launch.data_service` "
                         "and pass --config.data.service=HOST:PORT.")
        if _flag_value(args.trainer_flags, data_service.SERVICE_FLAG) is not None:
            parser.error(f"{data_service.SERVICE_FLAG} is set by this launcher with "
                         f"--data_service_workers; remove one of them.")
    if args.emit is None:
        if args.hosts:
            parser.error("--hosts describes other machines, which this launcher does not start; "
                         "add --emit tf_config (or --emit slurm / tfjob for a scheduler).")
        if args.workers is None or args.workers < 1:
            parser.error("--workers N (N >= 1 training processes) is required.")
        if args.max_restarts < 0:
            parser.error(f"--max_restarts={args.max_restarts} must be >= 0.")
        try:
            args.bounds = Bounds(args.start_timeout, args.hang_timeout, args.frozen_timeout,
                                 args.grace_s)
        except ValueError as error:
            parser.error(str(error))
    elif args.emit == "tf_config":
        if not args.hosts:
            parser.error("--emit tf_config needs --hosts h1:port,h2:port,...")
    else:
        if args.hosts:
            parser.error(f"--emit {args.emit}: the scheduler picks the hosts; drop --hosts and "
                         f"give --workers N.")
        if args.emit == "slurm":
            if args.evaluator:
                parser.error("--emit slurm has no evaluator task; run it as its own job (one "
                             "task): python -m trainer.main FLAGS --mode=continuous_eval.")
            if args.tasks_per_node < 1:
                parser.error(f"--tasks_per_node={args.tasks_per_node} must be >= 1.")
            if args.nodes is not None:
                if args.nodes < 1:
                    parser.error(f"--nodes={args.nodes} must be >= 1.")
                if args.workers is None:
                    args.workers = args.nodes * args.tasks_per_node
                elif args.workers != args.nodes * args.tasks_per_node:
                    parser.error(f"--workers={args.workers} but --nodes={args.nodes} x "
                                 f"--tasks_per_node={args.tasks_per_node} makes "
                                 f"{args.nodes * args.tasks_per_node} tasks; give two of them.")
        if args.workers is None or args.workers < 1:
            parser.error(f"--emit {args.emit} needs --workers N (N >= 1).")
    args.backoff_limit = args.max_restarts if max_restarts_given else None
    return args


def _emit(args: argparse.Namespace, log) -> str:
    if args.emit == "tf_config":
        addresses = cluster_lib.parse_hosts(args.hosts, args.port)
        for warning in cluster_lib.check_private_hosts(addresses, args.allow_public_bind):
            log(f"[launcher] warning: {warning}")
        cluster = cluster_lib.cluster_from_addresses(addresses, args.chief, args.evaluator)
        training = len(cluster.get("chief", [])) + len(cluster.get("worker", []))
        if args.workers is not None and args.workers != training:
            raise cluster_lib.ClusterError(
                f"--workers={args.workers} but --hosts gives {training} training task(s); "
                f"drop --workers or list one host per task.")
        log(f"[launcher] {cluster_lib.SECURITY_NOTE}")
        return cluster_lib.emit_tf_config(cluster)
    if args.emit == "slurm":
        return cluster_lib.emit_slurm(
            args.workers, args.trainer_flags, port=args.port, chief=args.chief,
            job_name=args.job_name, module=args.module, tasks_per_node=args.tasks_per_node,
            time_limit=args.time, partition=args.partition, account=args.account,
            warning_s=args.warning_s, requeue=args.requeue, gpus_per_task=args.gpus_per_worker)
    return cluster_lib.emit_tfjob(
        args.workers, args.trainer_flags, image=args.image, chief=args.chief,
        evaluator=args.evaluator, name=args.job_name, module=args.module,
        backoff_limit=args.backoff_limit, volume=args.volume,
        gpus_per_worker=args.gpus_per_worker, cpu=args.cpu, memory=args.memory,
        warn=lambda message: log(f"[launcher] warning: {message}"))


# trainer.main's exit status after a preemption save (trainer.checkpoint.preemption.EXIT_PREEMPTED;
# not imported: launch/ does not import TensorFlow): 143 = 128 + SIGTERM, which schedulers
# retry (see launch.cluster.EXIT_PREEMPTED).
EXIT_PREEMPTED = cluster_lib.EXIT_PREEMPTED


def run_group(args: argparse.Namespace, stop: StopSignals, log) -> int:
    """Runs the local group with restarts; returns the launcher's exit status."""
    workdir = _flag_value(args.trainer_flags, "--workdir")
    resume = (f"the trainer resumes from the latest checkpoint in {workdir} if there is one"
              if workdir else "the trainer resumes from its workdir's latest checkpoint if any")
    checked = preflight(args.module, args.trainer_flags, log)
    if checked:
        return checked
    restarts = port_retries = 0
    while True:
        if stop() is not None:
            return 128 + stop()
        service = int(args.data_service_workers > 0)
        ports = pick_free_ports(args.workers + int(args.evaluator) + service)
        cluster = local_cluster(args.workers, args.chief, args.evaluator, ports[service:])
        flags = list(args.trainer_flags)
        if service:
            flags.append(f"{data_service.SERVICE_FLAG}={data_service.address(ports[0])}")
        specs = task_specs(cluster, args.module, flags, args.collective_timeout_s)
        log(f"[launcher] starting {len(specs)} task(s) on 127.0.0.1: " + ", ".join(
            f"{task_name(k, i)}={a.rsplit(':', 1)[1]}" for k, i, a in cluster_tasks(cluster)))
        if service:
            specs += data_service.service_specs(ports[0], args.data_service_workers, True)
            log(f"[launcher] tf.data service: dispatcher at {data_service.address(ports[0])}, "
                f"{args.data_service_workers} worker(s), stopped with the group")
        result: GroupResult = ProcessGroup(specs, args.bounds, stop_requested=stop, log=log).run()
        if result.exit_code == 0:
            log(f"[launcher] done: {result.reason}.")
            return 0
        if stop() is not None:
            return result.exit_code
        if result.port_clash and port_retries < _PORT_RETRIES:
            port_retries += 1
            log(f"[launcher] {result.failed_task}'s port was taken before it could bind; "
                f"restarting the group on new ports (port retry {port_retries} of {_PORT_RETRIES}).")
            continue
        if args.max_restarts and result.exit_code == EXIT_PREEMPTED:
            log(f"[launcher] {result.reason}: preempted after saving a checkpoint; restarting "
                f"the whole group (not counted against --max_restarts); {resume}.")
            time.sleep(_RESTART_PAUSE_S)
            continue
        if restarts < args.max_restarts:
            restarts += 1
            log(f"[launcher] {result.reason}; restarting the whole group (restart {restarts} of "
                f"{args.max_restarts}); {resume}.")
            time.sleep(_RESTART_PAUSE_S)
            continue
        if args.max_restarts:
            log(f"[launcher] giving up after {restarts} restart(s): {result.reason}.")
        else:
            log(f"[launcher] failed: {result.reason} (exit status {result.exit_code}).")
        return result.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        args = _parse(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if args.emit:
        try:
            text = _emit(args, log)
        except (cluster_lib.ClusterError, ValueError) as error:
            log(f"launch.multiworker: {error}")
            return EXIT_USAGE
        if args.output == "-":
            sys.stdout.write(text)
        else:
            with open(args.output, "w") as f:
                f.write(text)
            log(f"[launcher] wrote {args.output}")
        return 0
    with StopSignals() as stop:
        try:
            return run_group(args, stop, log)
        except KeyboardInterrupt:
            log("[launcher] second stop signal: the tasks were killed.")
            return 128 + (stop() or signal.SIGINT)


def run() -> None:
    """Console-script entry point (``tf-launch-multiworker``)."""
    sys.exit(main())


if __name__ == "__main__":
    run()
