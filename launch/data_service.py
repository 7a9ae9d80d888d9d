"""``python -m launch.data_service``: a local tf.data service (dispatcher + K workers).

    python -m launch.data_service --port P --workers K [--grace_s G]

starts one dispatcher on ``127.0.0.1:P`` and K service workers, each its own process
(``python -m launch.data_service_server``, which imports TensorFlow; this launcher
does not), supervised like a training group (:mod:`launch.supervision`): lines prefixed
``[data_service_worker:1] ``; one dies, the others are stopped (SIGTERM, SIGKILL after
``--grace_s``); SIGINT / SIGTERM stop all. Point training at it with
``--config.data.service=127.0.0.1:P --config.train.deterministic=False`` (see
:mod:`trainer.data` for what the service guarantees on resume).

``python -m launch.multiworker --workers N --data_service_workers K ...`` starts the
same processes inside the training group (as sidecars: the group ends when training
does) and passes the dispatcher address to every training task; the per-host launcher
(``--hosts ... --node_rank I``) starts them on host 0 and points every host's tasks at
it.

What it buys: the input's preprocessing runs in the service workers' processes. On one
machine they share its cores with training, so it helps only when training leaves
cores idle; service workers on other machines add their cores (start the dispatcher
and workers there with ``python -m launch.data_service_server``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from launch.supervision import Bounds, ProcessGroup, StopSignals, TaskSpec

DISPATCHER = "data_service_dispatcher"
WORKER = "data_service_worker"
SERVICE_FLAG = "--config.data.service"


def service_specs(port: int, workers: int, sidecar: bool,
                  environ: dict[str, str] | None = None,
                  host: str | None = None) -> list[TaskSpec]:
    """The dispatcher on ``port`` of this machine and ``workers`` service workers as
    TaskSpecs.

    ``sidecar``: True inside a training group (the group does not wait for them).
    ``host``: the address other machines reach this one at; the service workers then
    tell the dispatcher to send clients there (by default they say ``localhost``, which
    only serves clients on this machine).
    """
    if workers < 1:
        raise ValueError(f"a tf.data service needs at least 1 worker, got {workers}.")
    env = dict(os.environ if environ is None else environ, PYTHONUNBUFFERED="1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    base = [sys.executable, "-m", "launch.data_service_server"]
    specs = [TaskSpec(DISPATCHER, [*base, "dispatcher", "--port", str(port)], env, sidecar)]
    for i in range(workers):
        argv = [*base, "worker", "--dispatcher", address(port)]
        if host is not None:
            argv += ["--address", host]
        specs.append(TaskSpec(f"{WORKER}:{i}", argv, env, sidecar))
    return specs


def address(port: int, host: str = "127.0.0.1") -> str:
    """The dispatcher address training tasks use (``config.data.service``)."""
    return f"{host}:{port}"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the service until it is stopped or a process of it dies; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m launch.data_service", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True, help="the dispatcher's port")
    parser.add_argument("--workers", type=int, default=1, help="service workers (K >= 1)")
    parser.add_argument("--grace_s", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when stopping")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.port < 1:
        parser.error("--port P (> 0) and --workers K (>= 1) are required.")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    specs = service_specs(args.port, args.workers, sidecar=False)
    log(f"[launcher] tf.data service: dispatcher at {address(args.port)}, "
        f"{args.workers} worker(s); train with {SERVICE_FLAG}={address(args.port)} "
        f"--config.train.deterministic=False")
    with StopSignals() as stop:
        try:
            result = ProcessGroup(specs, Bounds(start_timeout_s=300.0, grace_s=args.grace_s),
                                  stop_requested=stop, log=log).run()
        except KeyboardInterrupt:
            log("[launcher] second stop signal: the service processes were killed.")
            return 128 + (stop() or 2)
    log(f"[launcher] tf.data service ended: {result.reason}.")
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
