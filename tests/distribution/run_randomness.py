"""Subprocess entry of the randomness tests: one replica count per process.

    python -m tests.distribution.run_randomness --replicas N --workdir DIR --out runs.npz

Trains :class:`tests.support.random_trainers.RandomTrainer` to step 8 straight, then to
step 4 and resumed (a new Trainer in the same workdir) to step 8. Saves the weights and
random states of each (``straight/<i>``, ``resumed/<i>``) and the last step's share of
equal dropout-mask entries across the two halves of the global batch (``equal_share``).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from tests.support import random_trainers

    straight, results = random_trainers.train(args.replicas, 8)
    random_trainers.train(args.replicas, 4, args.workdir)
    resumed, _ = random_trainers.train(args.replicas, 8, args.workdir)
    out = {"equal_share": np.float64(results["train/equal_share"])}
    out.update({f"straight/{i}": w for i, w in enumerate(straight)})
    out.update({f"resumed/{i}": w for i, w in enumerate(resumed)})
    np.savez(args.out, **out)


if __name__ == "__main__":
    from trainer.runtime.fast_exit import exit_now

    main()
    exit_now(0)  # no teardown of distributed iterators
