"""``python -m launch.multiworker``: a local group, one host's tasks of a cluster, or configs.

This module parses the command line and hands over to :mod:`launch.local_group`,
:mod:`launch.hosts` (per-host launcher, ``--emit tf_config``), :mod:`launch.slurm` or
:mod:`launch.tfjob`.

Local group (every task on this machine, loopback only)::

    python -m launch.multiworker --workers 4 [--chief] [--evaluator] [--max_restarts R] \\
        [--start_timeout S] [--hang_timeout S] [--frozen_timeout S] [--grace_s G] \\
        [--collective_timeout_s S] --config=models/configs/digits.py --workdir=/tmp/run

``--data_service_workers K`` adds a tf.data service to the group: a dispatcher and K
service workers (:mod:`launch.data_service`), stopped with it; the training tasks get
``--config.data.service=127.0.0.1:PORT``. The service delivers batches in no fixed order,
so the launcher also passes ``--config.train.deterministic=False`` (one log line says so)
unless the flags set it; ``--config.train.deterministic=True`` with the service is
refused (see :mod:`trainer.data`). A service process that dies stops the group like a task.

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

The launcher owns the tasks' lives (see :mod:`launch.supervision`, :mod:`launch.group`): when one fails, hangs
or freezes the others are stopped (SIGTERM, SIGKILL after ``--grace_s``) and, with
``--max_restarts R``, the whole group is restarted up to R times on new ports (a task
that exits 143, preempted after saving a checkpoint, restarts it without counting; one
that exits 170, a lost peer, counts); the
trainer resumes from the latest checkpoint in its workdir if there is one. A port taken
between the pick and TensorFlow's bind restarts the group on new ports without counting
as a restart. SIGINT / SIGTERM / SIGHUP to the launcher stop every task the same way;
a second one sends SIGKILL at once.

Exit status: 0 when every training task exited 0; otherwise the failing task's status
(``128 + N`` if it was killed by signal N; 143 preempted, 170 a peer lost), 124 when a
task was declared hung, ``128 + N`` when the launcher itself got signal N, 2 for a usage
error. Before starting any task the
launcher runs ``trainer.main``'s TensorFlow-free checks once (``--check_only``: flags,
config file, workdir, and ``--check_replicas=N``: the global batch sizes divide over the
N training tasks of the cluster) and reports a failure once, with that check's status
(2 or 1). Values a scheduler would reject (a ``--time`` SLURM cannot read, an image
reference or a job name Kubernetes cannot take, a port outside 1..65535) are refused
with exit 2 and the accepted forms, before anything is written.

Per-host launcher, once on every host of a cluster (see :mod:`launch.hosts`; tasks on
ports ``--port`` (default 23456) .. ``--port + K - 1`` of each host)::

    python -m launch.multiworker --hosts 10.0.0.1,10.0.0.2 --node_rank I \\
        --tasks_per_node K [--port P] [--chief] [--evaluator] [--data_service_workers S] \\
        [--max_restarts R] --config=... --workdir=/shared/run

Cluster outputs print instead of spawning (default ``--port`` 12345)::

    python -m launch.multiworker --hosts 10.0.0.1:2222,10.0.0.2:2222 --emit tf_config
    python -m launch.multiworker --workers 4 --emit slurm [--tasks_per_node 2] [--port 12345] \\
        [--time T] [--partition P] [--account A] [--warning_s S] [--no_requeue] FLAGS > job.sbatch
    python -m launch.multiworker --nodes 1-2 --tasks_per_node 2 --emit slurm FLAGS > job.sbatch
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
import signal
import sys
from typing import Sequence

from launch import data_service, emit, hosts, local_group, slurm, tfjob
from launch.cluster import ClusterError, check_private_hosts
from launch.emit import EMIT_PORT
from launch.flags import flag_value, sets_flag, with_absolute_paths
from launch.supervision import Bounds, StopSignals

EXIT_USAGE = 2
_STRATEGY_FLAG = "--config.distribute.strategy"
DETERMINISTIC_FLAG = "--config.train.deterministic"
_FALSE = ("false", "f", "0", "no")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default in ``--help``
    (not the None/False of options that are off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def _group_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("local group and per-host launcher")
    group.add_argument("--workers", type=int, help="number of training processes")
    group.add_argument("--chief", action="store_true", help="the first task is the chief")
    group.add_argument("--evaluator", action="store_true",
                       help="add an evaluator task (per-host: on the last host)")
    group.add_argument("--max_restarts", type=int, default=None,
                       help="restart the whole group up to R times after a failure (default "
                            "0); --emit tfjob: runPolicy.backoffLimit (default "
                            f"{tfjob.DEFAULT_TFJOB_BACKOFF_LIMIT})")
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
                            "owned by the group; per-host: on host 0) and pass "
                            "--config.data.service=ADDRESS to the training tasks (0: no service)")
    group.add_argument("--module", default="trainer.main",
                       help="the entry point each task runs with `python -m` (it must accept "
                            "trainer.main's flags)")


def _host_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("hosts (per-host launcher, --emit tf_config)")
    group.add_argument("--hosts", help="per-host launcher: 'ADDR0,ADDR1,...', one entry per "
                                       "host (ADDR:P sets that host's base port); --emit "
                                       "tf_config: 'h1:port,h2:port,...' in task order")
    group.add_argument("--node_rank", type=int, default=None, metavar="I",
                       help="per-host launcher: this host's place in --hosts (0-based); "
                            "starts this host's --tasks_per_node tasks")
    group.add_argument("--port", type=int, default=None,
                       help=f"per-host launcher: base port, task i of a host listens on port "
                            f"+ i (default {hosts.DEFAULT_PORT}); --emit: port for --hosts "
                            f"entries without one, --emit slurm: base port (default "
                            f"{EMIT_PORT})")
    group.add_argument("--tasks_per_node", type=int, default=1,
                       help="per-host launcher and --emit slurm: tasks per host (one per "
                            "GPU is usual)")
    group.add_argument("--allow_public_bind", action="store_true",
                       help="accept public addresses in --hosts (gRPC is unauthenticated!)")


def _emit_flags(parser: argparse.ArgumentParser) -> None:
    emit = parser.add_argument_group("cluster outputs (print, do not spawn)")
    emit.add_argument("--emit", choices=("tf_config", "slurm", "tfjob"))
    emit.add_argument("--nodes", default=None, metavar="N|M-N",
                      help="--emit slurm: number of nodes, or a range M-N (the worker count "
                           "is then SLURM_NNODES x --tasks_per_node at run time); default "
                           "--workers / --tasks_per_node; with --nodes alone, --workers = "
                           "nodes x tasks_per_node")
    emit.add_argument("--min_nodes", type=int, default=None, metavar="M",
                      help="--emit slurm: start (or resume after a requeue) on as few as M nodes")
    emit.add_argument("--time", default=None, help="--emit slurm: #SBATCH --time (time limit)")
    emit.add_argument("--partition", default=None, help="--emit slurm: #SBATCH --partition")
    emit.add_argument("--account", default=None, help="--emit slurm: #SBATCH --account")
    emit.add_argument("--warning_s", type=int, default=slurm.DEFAULT_WARNING_S,
                      help="--emit slurm: SLURM sends the warning signal (USR1) this many "
                           "seconds before the time limit; the tasks then checkpoint")
    emit.add_argument("--requeue", dest="requeue", action="store_true", default=True,
                      help="--emit slurm: requeue the job after a preemption checkpoint or a "
                           "lost peer (default)")
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
    emit.add_argument("--no_check", dest="check", action="store_false",
                      help="--emit slurm / tfjob: do not run trainer.main's checks of the "
                           "flags here (for a config or Trainer that exists only in the image)")
    emit.add_argument("--output", default="-", help="file to write the output to ('-': stdout)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launch.multiworker", description=__doc__, allow_abbrev=False,
        formatter_class=_HelpFormatter,
        usage="%(prog)s --workers N | --hosts H0,H1,... --node_rank I [options] "
              "TRAINER_FLAGS...")
    _group_flags(parser)
    _host_flags(parser)
    _emit_flags(parser)
    return parser


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The launcher's options, with ``trainer_flags`` (everything it does not know, and
    all after ``--``) and ``mode`` (``"local"``, ``"hosts"`` or ``"emit"``).

    Raises:
      SystemExit: a usage error (status 2), after printing the reason; or ``--help``.
    """
    parser = _parser()
    argv = list(argv)
    tail = []
    if "--" in argv:
        cut = argv.index("--")
        argv, tail = argv[:cut], argv[cut + 1:]
    args, trainer_flags = parser.parse_known_args(argv)
    args.trainer_flags = trainer_flags + tail
    args.mode = "emit" if args.emit else "hosts" if args.node_rank is not None else "local"
    if args.emit != "tfjob":  # a TFJob's paths are the containers', not this machine's
        args.trainer_flags = with_absolute_paths(args.trainer_flags)
    try:
        _check_common(args)
        if args.mode == "emit":
            _check_emit(args)
        else:
            _check_spawning(args)
    except (ClusterError, ValueError) as error:
        parser.error(str(error))
    return args


def _check_common(args: argparse.Namespace) -> None:
    if sets_flag(args.trainer_flags, _STRATEGY_FLAG):
        raise ClusterError(f"{_STRATEGY_FLAG} is set by this launcher (multi_worker); remove it.")
    if args.mode != "emit" and sets_flag(args.trainer_flags, "--mode"):
        raise ClusterError("--mode is set per task by this launcher (training tasks train, the "
                           "--evaluator task runs --mode=continuous_eval); remove it.")
    args.backoff_limit = args.max_restarts
    args.warnings = []
    if args.max_restarts is None:
        args.max_restarts = 0
    args.notes = []
    if args.port is not None and not 1 <= args.port <= 65535:
        raise ClusterError(f"--port={args.port} must be a TCP port in 1..65535.")
    if args.data_service_workers < 0:
        raise ClusterError(f"--data_service_workers={args.data_service_workers} must be >= 0.")
    if args.data_service_workers:
        if args.emit is not None:
            raise ClusterError(
                "--data_service_workers starts local processes; with --emit, start the "
                "service on its machines with `python -m launch.data_service` and pass "
                "--config.data.service=HOST:PORT.")
        if flag_value(args.trainer_flags, data_service.SERVICE_FLAG) is not None:
            raise ClusterError(f"{data_service.SERVICE_FLAG} is set by this launcher with "
                               f"--data_service_workers; remove one of them.")
        _nondeterministic_input(args)


def _nondeterministic_input(args: argparse.Namespace) -> None:
    """The tf.data service needs ``train.deterministic=False``: the launcher passes it
    (with a note) unless the flags set it; an explicit True is refused."""
    if not sets_flag(args.trainer_flags, DETERMINISTIC_FLAG):
        args.trainer_flags.append(f"{DETERMINISTIC_FLAG}=False")
        args.notes.append(f"--data_service_workers: passing {DETERMINISTIC_FLAG}=False to the "
                          f"tasks (the tf.data service delivers batches in no fixed order; "
                          f"model, optimizer and step still resume exactly, the batch order "
                          f"does not).")
        return
    value = flag_value(args.trainer_flags, DETERMINISTIC_FLAG)
    if value is None or value.startswith("--"):
        value = "True"  # a bare --config.train.deterministic sets the bool field
    if value.strip().lower() not in _FALSE:
        raise ClusterError(f"--data_service_workers needs {DETERMINISTIC_FLAG}=False (the "
                           f"tf.data service delivers batches in no fixed order) but the flags "
                           f"set {DETERMINISTIC_FLAG}={value}; drop that flag (the launcher "
                           f"then sets False) or drop --data_service_workers.")


def _check_spawning(args: argparse.Namespace) -> None:
    """The local group and the per-host launcher: counts, restarts, bounds, the hosts."""
    if args.hosts and args.node_rank is None:
        raise ClusterError(
            "--hosts without --node_rank: to start this host's tasks give --node_rank I (its "
            "place in --hosts); to print per-task TF_CONFIGs add --emit tf_config (or --emit "
            "slurm / tfjob for a scheduler).")
    if args.node_rank is not None and not args.hosts:
        raise ClusterError("--node_rank I needs --hosts ADDR0,ADDR1,... (every host of the "
                           "cluster, in task order); without them the local group runs.")
    if args.max_restarts < 0:
        raise ClusterError(f"--max_restarts={args.max_restarts} must be >= 0.")
    args.bounds = Bounds(args.start_timeout, args.hang_timeout, args.frozen_timeout,
                         args.grace_s)
    if args.mode == "local":
        if args.workers is None or args.workers < 1:
            raise ClusterError("--workers N (N >= 1 training processes) is required.")
        return
    args.layout = hosts.host_layout(
        args.hosts or "", args.node_rank, args.tasks_per_node,
        port=hosts.DEFAULT_PORT if args.port is None else args.port, chief=args.chief,
        evaluator=args.evaluator, data_service_workers=args.data_service_workers)
    training = len(args.layout.hosts) * args.tasks_per_node
    if args.workers is not None and args.workers != training:
        raise ClusterError(f"--workers={args.workers} but --hosts x --tasks_per_node gives "
                           f"{training} training task(s); drop --workers.")
    args.warnings = check_private_hosts(args.layout.host_addresses, args.allow_public_bind)


def _check_emit(args: argparse.Namespace) -> None:
    if args.node_rank is not None:
        raise ClusterError("--node_rank starts this host's tasks; it does not go with --emit.")
    if args.emit == "tf_config":
        if not args.hosts:
            raise ClusterError("--emit tf_config needs --hosts h1:port,h2:port,...")
        return
    if args.hosts:
        raise ClusterError(f"--emit {args.emit}: the scheduler picks the hosts; drop --hosts "
                           f"and give --workers N.")
    if args.emit == "slurm":
        if args.evaluator:
            raise ClusterError("--emit slurm has no evaluator task; run it as its own job (one "
                               "task): python -m trainer.main FLAGS --mode=continuous_eval.")
        args.node_range = slurm.slurm_nodes(args.workers, args.nodes, args.min_nodes,
                                            args.tasks_per_node)
    elif args.workers is None or args.workers < 1:
        raise ClusterError(f"--emit {args.emit} needs --workers N (N >= 1).")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        args = parse(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if args.mode == "emit":
        return emit.write(args, log)
    for note in args.notes:
        log(f"[launcher] {note}")
    for warning in args.warnings:
        log(f"[launcher] warning: {warning}")
    with StopSignals() as stop:
        try:
            if args.mode == "hosts":
                return hosts.run_host_group(args, args.layout, stop, log)
            return local_group.run_local_group(args, stop, log)
        except KeyboardInterrupt:
            log("[launcher] second stop signal: the tasks were killed.")
            return 128 + (stop() or signal.SIGINT)


def run() -> None:
    """Console-script entry point (``tf-launch-multiworker``)."""
    sys.exit(main())


if __name__ == "__main__":
    run()
