"""Subprocess entry of the randomness tests: one replica count per process.

    python -m tests.distribution.run_randomness --replicas N --workdir DIR --out runs.npz
    python -m tests.distribution.run_randomness --manual 2 --workdir DIR --out runs.npz
    python -m tests.distribution.run_randomness --replicas 4 --draws global --workdir DIR \
        --out runs.npz
    python -m launch.multiworker --workers 2 --module tests.distribution.run_randomness \
        --replicas 2 \
        --workdir DIR --out runs.npz

Trains :class:`tests.distribution.random_trainers.RandomTrainer` to step 8 straight, then to
step 4 and resumed (a new Trainer in the same workdir) to step 8: on N Mirrored
replicas, or with ``--manual N`` on one replica under ``distribute.strategy=manual`` over N
virtual CPU devices, or on each worker of a group the launcher started (TF_CONFIG set;
each writes ``runs-<task>.npz``, e.g. ``runs-worker-1.npz``). Saves the weights and
random states of each (``straight/<i>``, ``resumed/<i>``) and the last step's share of
equal dropout-mask entries across the two halves of the global batch (``equal_share``).
``--draws global`` (or ``per_replica,global``: both, in one process) trains to step 8
straight with ``distribute.random_draws="global"`` instead (``global/<i>``,
``global_equal_share``). With ``per_replica`` on Mirrored replicas, also
:class:`tests.distribution.random_trainers.UnseededLossTrainer`'s weights with the
telemetry's compute probe after every window and without (``probed/<i>``,
``unprobed/<i>``).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--manual", type=int, default=0)
    parser.add_argument("--draws", default="per_replica")  # comma-separated: which runs
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    args, _ = parser.parse_known_args()  # the launcher adds trainer.main's flags

    from tests.distribution import random_trainers
    from tests.support.helpers import task_name

    manual = ({"distribute.strategy": "manual", "distribute.virtual_devices": args.manual}
              if args.manual else {})
    out_path = args.out
    if os.environ.get("TF_CONFIG"):
        manual = {"distribute.strategy": "multi_worker", "distribute.virtual_devices": 1}
        out_path = args.out.removesuffix(".npz") + f"-{task_name()}.npz"
    out = {}
    draws = args.draws.split(",")
    if "per_replica" in draws:
        straight, results = random_trainers.train(args.replicas, 8, **manual)
        random_trainers.train(args.replicas, 4, args.workdir, **manual)
        resumed, _ = random_trainers.train(args.replicas, 8, args.workdir, **manual)
        out["equal_share"] = np.float64(results["train/equal_share"])
        out.update({f"straight/{i}": w for i, w in enumerate(straight)})
        out.update({f"resumed/{i}": w for i, w in enumerate(resumed)})
    if "per_replica" in draws and args.replicas > 1 and not manual:
        # the compute probe puts back what it changes
        out.update({f"probed/{i}": w for i, w in enumerate(random_trainers.probed_weights(
            args.replicas, 1))})
        out.update({f"unprobed/{i}": w for i, w in enumerate(random_trainers.probed_weights(
            args.replicas, 0))})
    if "global" in draws:
        weights, results = random_trainers.train(args.replicas, 8, **{
            **manual, "distribute.random_draws": "global"})
        out["global_equal_share"] = np.float64(results["train/equal_share"])
        out.update({f"global/{i}": w for i, w in enumerate(weights)})
    np.savez(out_path, **out)


if __name__ == "__main__":
    from trainer.runtime.fast_exit import exit_now

    main()
    exit_now(0)  # no teardown of distributed iterators
