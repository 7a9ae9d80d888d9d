"""The local checkpoint tier's cost per step: the transformer trained with the tier off
and on at a few cadences, side by side in one process; prints examples/s, ratios to
"off", and the loop's blocked time (the local saves' host copy and waits) per step.

    python -m benchmarks.checkpoints.local_tier [--rounds 5] [--steps 100]
                                               [--every 10,25,50] [--json out.json]

The ``transformer`` workload (``benchmarks.common.workloads``: encoder classifier, seq
128, d 128, 2 layers, batch 32, Adam), one device, ``steps_per_loop`` 50. Each mode is
its own Trainer with its own workdir and local dir (``checkpoint.local_every_steps``
N; no workdir saves but the one at the end of each ``fit()``, the same in every mode);
each round runs ``--steps`` more steps of every mode, in a rotating order. "blocked" is
the saving services' ``blocking_s`` (the checkpoint service's and the local tier's
:class:`~trainer.checkpoint.local_saves.LocalSaves`: the part of a save the loop waits for: the
host copy, a previous local write still running) per step, as a share of the step
time: the cost the tier adds to the loop. The async write itself runs in orbax's
threads, competing for the cores: the end-to-end ratio shows it, noisily on a shared
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from benchmarks.common.table import Row, format_table

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _trainer(every: int, root: str):
    from benchmarks.common.workloads import WORKLOADS, framework_trainer

    name = f"every_{every}" if every else "off"
    return framework_trainer(
        WORKLOADS["transformer"], 50, workdir=os.path.join(root, name),
        **{"distribute.strategy": "one_device", "perf.plan": "fixed",
           "checkpoint.local_every_steps": every,
           "checkpoint.local_dir": os.path.join(root, "local")})


def run(rounds: int, steps: int, cadences: list[int]) -> dict:
    """Per mode: examples/s per round, its ratio to "off", the blocked share."""
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    root = tempfile.mkdtemp(prefix="local_tier_")
    modes = {0: _trainer(0, root), **{n: _trainer(n, root) for n in cadences}}
    fit_s = dict.fromkeys(modes, 0.0)
    blocked0 = {}

    def fit(every: int) -> float:
        t = modes[every]
        t.config.train.steps = t.step + steps
        start = time.perf_counter()
        t.fit()
        seconds = time.perf_counter() - start
        fit_s[every] += seconds
        return steps * 32 / seconds

    for every in modes:
        fit(every)  # trace, warm up
        fit_s[every] = 0.0
        blocked0[every] = _blocked(modes[every])
    rates = {every: [] for every in modes}
    order = list(modes)
    for r in range(rounds):
        for every in order[r % len(order):] + order[:r % len(order)]:
            rates[every].append(fit(every))
    result = {}
    for every, values in rates.items():
        ratios = [v / o for v, o in zip(values, rates[0])]
        blocked = _blocked(modes[every]) - blocked0[every]
        result["off" if not every else f"local every {every}"] = {
            "examples_per_s": statistics.median(values), "ratio_to_off":
            statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
            "spread": (min(values), max(values)),
            "blocked_share": blocked / fit_s[every] if fit_s[every] else 0.0}
    return {"workload": "transformer", "rounds": rounds, "steps_per_round": steps,
            "modes": result}


def _blocked(trainer) -> float:
    """The seconds the trainer's saving services (the checkpoint service, the local
    tier's) held the loop so far."""
    from trainer.checkpoint.local_saves import LocalSaves
    from trainer.checkpoint.service import Checkpointer

    return sum(s.blocking_s for s in trainer.callbacks.services
               if isinstance(s, (Checkpointer, LocalSaves)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", default="10,25,50")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    result = run(args.rounds, args.steps, [int(n) for n in args.every.split(",")])
    rows = [Row(mode, m["examples_per_s"], "ex/s", m["ratio_to_off"],
                (m["min_ratio"], m["max_ratio"]), m["spread"],
                note=f"blocked {m['blocked_share']:.2%} of the fit's time")
            for mode, m in result["modes"].items()]
    print(format_table(f"local_tier: transformer batch 32, {result['rounds']} rounds x "
                       f"{result['steps_per_round']} steps (50 per loop call)", rows, "off"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
