"""One tf.data service process: ``python -m launch.data_service_server ROLE ...``.

Started by :mod:`launch.data_service` (never imported by the launcher: this process
imports TensorFlow, the launcher does not)::

    python -m launch.data_service_server dispatcher --port P
    python -m launch.data_service_server worker --dispatcher HOST:P [--port Q] [--address A]

A dispatcher (``tf.data.experimental.service.DispatchServer``) hands out the input's
splits; a worker (``WorkerServer``) registers with it and runs the input pipelines
that training processes send. Each prints one ``... listening on port N`` line once
it serves, then serves until it is stopped (SIGTERM).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launch.data_service_server",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("dispatcher", "worker"))
    parser.add_argument("--port", type=int, default=0,
                        help="port to serve on (dispatcher: required; worker: 0 = any)")
    parser.add_argument("--dispatcher", default="",
                        help="worker: the dispatcher's HOST:PORT")
    parser.add_argument("--address", default="",
                        help="worker: the host clients reach this worker at (default "
                             "localhost: clients on this machine only)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Serves the role until stopped; returns 2 on a usage error."""
    args = _parser().parse_args(argv)
    if args.role == "dispatcher" and not args.port:
        print("data_service_server: a dispatcher needs --port P (P > 0).", file=sys.stderr)
        return 2
    if args.role == "worker" and not args.dispatcher:
        print("data_service_server: a worker needs --dispatcher HOST:PORT.", file=sys.stderr)
        return 2
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    service = tf.data.experimental.service
    if args.role == "dispatcher":
        server = service.DispatchServer(service.DispatcherConfig(port=args.port))
        port = args.port
    else:
        worker_address = f"{args.address}:%port%" if args.address else None
        server = service.WorkerServer(service.WorkerConfig(
            dispatcher_address=args.dispatcher, worker_address=worker_address,
            port=args.port))
        port = args.port or "(any)"
    print(f"tf.data service {args.role} listening on port {port}", flush=True)
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
