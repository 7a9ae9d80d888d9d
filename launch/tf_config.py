"""``python -m launch.tf_config``: check this process's ``TF_CONFIG``, or derive it in SLURM.

Command line::

    python -m launch.tf_config --check          # what this process will be; do peers answer?
    python -m launch.tf_config --from_slurm --port 12345 [--tasks_per_node N] [--chief]
    python -m launch.tf_config --from_slurm --port 12345 [...] -- CMD ARGS...  # exec CMD

``--from_slurm`` derives TF_CONFIG from the SLURM step (local task i of a node listens on
``port + i``) and, with several tasks per node on a GPU node, gives each task its own
GPU(s) through ``CUDA_VISIBLE_DEVICES`` (see :mod:`launch.slurm`).

``--check`` exits 0 when TF_CONFIG is valid and every peer's port answers, 3 when it is
valid but some peer does not answer (not started yet, wrong address or a firewall), and
1 when TF_CONFIG is unset or invalid. The format itself (build, validate) is
:mod:`tf_cluster.tf_config`. This module never imports TensorFlow.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
from typing import Sequence

from launch.slurm import slurm_visible_gpus, tf_config_from_slurm
from tf_cluster.ports import port_free_here, probe_address
from tf_cluster.tf_config import (TRAINING_TASK_TYPES, TFConfigError, cluster_tasks,
                                  parse_address, task_name, validate_tf_config)


def check(tf_config: dict, timeout_s: float = 1.0, out=sys.stdout) -> int:
    """Reports what this process is and whether its peers answer; returns an exit code.

    Prints one line per task. The process's own port is checked for being free to bind
    (TensorFlow's server listens on it); every other task's port gets a TCP connect with
    ``timeout_s``. Returns 0 when every peer answers, 3 otherwise. ``tf_config`` must
    already be valid (see :func:`validate_tf_config`).
    """
    cluster, task = tf_config["cluster"], tf_config["task"]
    tasks = cluster_tasks(cluster)
    me = task_name(task["type"], task["index"])
    training = sum(len(cluster.get(t, ())) for t in TRAINING_TASK_TYPES)
    print(f"this process is {me} of a cluster of {len(tasks)} task(s) ({training} training), "
          f"rpc_layer {tf_config.get('rpc_layer', 'grpc')}", file=out)
    peers = [(name, address) for kind, index, address in tasks
             if (name := task_name(kind, index)) != me]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(peers)))) as pool:
        results = dict(zip([n for n, _ in peers],
                           pool.map(lambda p: probe_address(p[1], timeout_s), peers)))
    width = max(len(task_name(k, i)) for k, i, _ in tasks)
    for kind, index, address in tasks:
        name = task_name(kind, index)
        if name == me:
            port = parse_address(address)[1]
            state = ("this process; port free to bind" if port_free_here(port) else
                     "this process; port IN USE here, TensorFlow's server will fail to start")
        elif results[name] is None:
            state = "answers"
        else:
            state = f"does not answer ({results[name]})"
        print(f"  {name:<{width}}  {address:<24} {state}", file=out)
    silent = [name for name, reason in results.items() if reason is not None]
    if silent:
        print(f"{len(silent)} peer(s) do not answer: not started yet, a wrong address, or a "
              f"firewall between the hosts.", file=out)
        return 3
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m launch.tf_config", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true",
                      help="validate $TF_CONFIG, print this task and probe the peers' ports")
    mode.add_argument("--from_slurm", action="store_true",
                      help="print the TF_CONFIG of this SLURM task")
    parser.add_argument("--timeout_s", type=float, default=1.0, help="per-peer connect timeout")
    parser.add_argument("--port", type=int, default=12345,
                        help="--from_slurm: base port; local task i listens on port + i")
    parser.add_argument("--tasks_per_node", type=int, default=1,
                        help="--from_slurm: tasks per node in the step (one per GPU is usual)")
    parser.add_argument("--chief", action="store_true", help="--from_slurm: task 0 is the chief")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="--from_slurm: after '--', a command to exec with TF_CONFIG set")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if command and not args.from_slurm:
        parser.error(f"unexpected arguments {command}; only --from_slurm takes a command.")
    if args.from_slurm:
        try:
            tf_config = json.dumps(tf_config_from_slurm(
                os.environ, args.port, chief=args.chief, tasks_per_node=args.tasks_per_node))
            gpus = slurm_visible_gpus(os.environ, args.tasks_per_node)
        except (TFConfigError, subprocess.SubprocessError) as error:
            print(f"launch.tf_config: {error}", file=sys.stderr)
            return 1
        if not command:
            print(tf_config)
            return 0
        env = {**os.environ, "TF_CONFIG": tf_config}
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
            print(f"launch.tf_config: SLURM task {os.environ.get('SLURM_PROCID')} (local "
                  f"{os.environ.get('SLURM_LOCALID')}) gets CUDA_VISIBLE_DEVICES={gpus}",
                  file=sys.stderr, flush=True)
        os.execvpe(command[0], command, env)
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        print("launch.tf_config: TF_CONFIG is not set; this process would train alone. Set it, "
              "or start workers with `python -m launch.multiworker`.", file=sys.stderr)
        return 1
    try:
        tf_config = json.loads(raw)
        validate_tf_config(tf_config)
    except json.JSONDecodeError as error:
        print(f"launch.tf_config: TF_CONFIG is not valid JSON: {error}", file=sys.stderr)
        return 1
    except TFConfigError as error:
        print(f"launch.tf_config: {error}", file=sys.stderr)
        return 1
    return check(tf_config, timeout_s=args.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
