"""Subprocess entry of the model-family tests: one replica count per process.

    python -m tests.distribution.run_families --replicas N --out weights.npz [--families a,b]

Trains every family of :mod:`tests.support.families` on N virtual CPU devices and saves each
final weight as ``<family>/<i>`` (its initial value as ``<family>_initial/<i>``), or ``<family>/error`` (the error's text) when a family
failed to train.
"""

from __future__ import annotations

import argparse
import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--families", default="")
    args = parser.parse_args()

    from tests.support import families

    names = args.families.split(",") if args.families else families.FAMILIES
    out = {}
    for name in names:
        try:
            initial, weights = families.train_family(name, args.replicas)
        except Exception as error:  # noqa: BLE001 - recorded; the test names it
            out[f"{name}/error"] = np.array(f"{type(error).__name__}: {error}")
            continue
        finally:
            gc.collect()  # each trainer's iterators freed now (tests/support/run_models.py)
        for i, (w0, w) in enumerate(zip(initial, weights)):
            out[f"{name}/{i}"] = w
            out[f"{name}_initial/{i}"] = w0
    np.savez(args.out, **out)


if __name__ == "__main__":
    from trainer.runtime.fast_exit import exit_now

    main()
    exit_now(0)  # no teardown of distributed iterators (up to 60 s each)
