"""Sparse gradients across 2 Mirrored replicas: the dense all-reduce vs gathered rows.

    python -m benchmarks.parallel.sparse_reduce [--rounds 7] [--steps 20] [--small_steps 400]
                                                [--sizes large,small] [--json out.json]

The text classifier (:mod:`models.text_classifier`: ``Embedding(vocab, dim,
mask_zero=True)`` over padded variable-length batches, its config
``models/configs/text_classifier.py``) on 2 Mirrored replicas over virtual CPU devices
(``distribute.strategy="mirrored"``, ``distribute.virtual_devices=2``), trained by
``Trainer.fit`` with ``perf.sparse_reduce`` = ``dense`` (the embedding's gradient made
dense, ``[V, D]``, and all-reduced), ``gather`` (only the rows touched) and ``auto``
(the default: gather for a dynamic row count, which padded batches have), per table size:

  large  vocab 200,000 x dim 64 (51 MB of float32 per replica: what dense moves per step)
  small  vocab 2,000 x dim 16 (the config's own size: dense is cheap)

Everything else is the config file's (batch 32, ``steps_per_loop`` 20, Adam), with
``perf.plan="fixed"``, no workdir (no checkpoints, no metric files),
``checkpoint.every_steps=0``, no evaluation (the Trainer used here does not override
``build_eval_dataset``, so fit() does not evaluate at its end) and minimal telemetry
(no progress line, no probes, no gradient norm, one logging window per fit).

All Trainers live in ONE process (one Mirrored group size; they share the strategy).
Each is warmed up when built (traced, ``--warmup`` steps), and once all are built each
trains one untimed round: by then every Trainer has passed once over the 2,048 training
sequences (64 steps) and seen every padded length (the first fits after a short warm-up
were several times slower in trial runs). Then every round trains ``--steps`` more steps
of each large-table Trainer and ``--small_steps`` of each small-table one (its step is
~100x cheaper; a chunk of well over 0.1 s), one ``fit()`` each (through
:class:`benchmarks.common.throughput_impls.Framework`'s ``run``), the policies in rotating order
per round. Printed per size and policy: median examples/s over rounds, min, max, and the
median per-round ratio to ``dense`` with its [min..max]. ``resolved`` is what the
gradient path decided when it traced the step (read from
:func:`trainer.step.sparse_gradients.chooses_dense`, wrapped to record its answer): ``auto``
must resolve to ``gather`` here, the row count being dynamic.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import table
from benchmarks.common.table import Row
from benchmarks.common.throughput_impls import Framework

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

POLICIES = ("dense", "gather", "auto")  # dense first: the reference of the ratios
SIZES = {"large": (200_000, 64), "small": (2_000, 16)}  # vocab, dim


class _TextFramework(Framework):
    """:class:`Framework`'s ``run`` / ``warm_up`` (chunks of ``fit()``) on a Trainer
    built here instead of from a :mod:`benchmarks.common.workloads` workload."""

    def __init__(self, trainer):  # not Framework.__init__: there is no workload
        self.auto = False  # perf.plan="fixed": no plan to measure in the warm-up
        self.trainer = trainer
        self.xla = trainer.steps.jit_compiled


def _config(vocab: int, dim: int, policy: str):
    from models.configs.text_classifier import get_config

    config = get_config()
    config.model.vocab, config.model.dim = vocab, dim
    config.perf.sparse_reduce = policy
    config.perf.plan = "fixed"
    config.distribute.strategy = "mirrored"
    config.distribute.virtual_devices = 2
    config.eval.every_steps = 0  # and no eval dataset (_trainer)
    config.checkpoint.every_steps = 0  # and no workdir
    config.train.log_every_steps = 10**9  # one window per fit()
    config.telemetry.progress = "off"
    config.telemetry.probe_every_windows = 0
    config.telemetry.grad_norm = False
    config.telemetry.loggers = ()
    # train.steps: each chunk sets it to the step it trains to (Framework.run).
    return config


def _trainer(vocab: int, dim: int, policy: str):
    """A TextClassifierTrainer without evaluation: ``build_eval_dataset`` is the base
    class's again, so ``has_eval_dataset()`` is False and fit() does not evaluate."""
    import trainer
    from models.text_classifier import TextClassifierTrainer

    class NoEval(TextClassifierTrainer):
        build_eval_dataset = trainer.Trainer.build_eval_dataset

    return NoEval(_config(vocab, dim, policy), None)


def _record_decisions() -> list[tuple[str, bool, bool]]:
    """Wraps ``trainer.step.sparse_gradients.chooses_dense`` (looked up at trace time by
    ``all_reduce_sum``): every call appends ``(policy, dense?, row count static?)``."""
    from trainer.step import sparse_gradients

    decisions: list[tuple[str, bool, bool]] = []
    original = sparse_gradients.chooses_dense

    def recorded(policy, grad, variable, strategy):
        dense = original(policy, grad, variable, strategy)
        decisions.append((policy, dense, grad.indices.shape[0] is not None))
        return dense

    sparse_gradients.chooses_dense = recorded
    return decisions


def _resolved(decisions: list[tuple[str, bool, bool]]) -> str:
    if not decisions:
        return "no sparse gradient"
    kinds = sorted({"dense" if dense else "gather" for _, dense, _ in decisions})
    rows = sorted({"static" if static else "dynamic" for _, _, static in decisions})
    return f"{'+'.join(kinds)} ({'/'.join(rows)} rows)"


def _timed(impl: Framework, steps: int, batch: int) -> float:
    """Examples/s of ``steps`` more steps (one fit())."""
    start = time.perf_counter()
    impl.run(steps)
    return steps * batch / (time.perf_counter() - start)


def measure(sizes: list[str], rounds: int, steps: dict[str, int], warmup: int) -> dict:
    """``steps``: steps per policy and round, per size."""
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    decisions = _record_decisions()
    impls: dict[tuple[str, str], Framework] = {}
    resolved: dict[tuple[str, str], str] = {}
    batch = None
    for size in sizes:
        for policy in POLICIES:
            started = time.perf_counter()
            del decisions[:]
            impl = _TextFramework(_trainer(*SIZES[size], policy))
            batch = impl.trainer.config.train.global_batch_size
            impl.warm_up(warmup)
            impls[size, policy] = impl
            resolved[size, policy] = _resolved(decisions)
            print(f"  {size}/{policy}: built and warmed up in "
                  f"{time.perf_counter() - started:.1f} s ({resolved[size, policy]})",
                  file=sys.stderr, flush=True)
    for (size, _), impl in impls.items():  # an untimed round once all exist
        impl.run(steps[size])
    rates: dict[tuple[str, str], list[float]] = {key: [] for key in impls}
    for r in range(rounds):
        order = list(POLICIES[r % len(POLICIES):] + POLICIES[:r % len(POLICIES)])
        for size in sizes:
            for policy in order:
                rates[size, policy].append(_timed(impls[size, policy], steps[size], batch))
        print(f"  round {r + 1}/{rounds}: " + ", ".join(
            f"{s}/{p} {rates[s, p][-1]:,.0f}" for s in sizes for p in POLICIES),
            file=sys.stderr, flush=True)
    results: dict = {}
    for size in sizes:
        vocab, dim = SIZES[size]
        reference = rates[size, "dense"]
        for policy in POLICIES:
            values = rates[size, policy]
            ratios = [v / d for v, d in zip(values, reference)]
            results[f"{size}/{policy}"] = {
                "vocab": vocab, "dim": dim, "policy": policy,
                "resolved": resolved[size, policy],
                "examples_per_s": statistics.median(values), "min": min(values),
                "max": max(values), "per_round": values,
                "vs_dense": statistics.median(ratios), "vs_dense_min": min(ratios),
                "vs_dense_max": max(ratios)}
    return results


def format_table(title: str, results: dict) -> str:
    """One row per table size and policy, ratios to the same size's ``dense``."""
    return table.format_table(title, [
        Row(f"{r['vocab']:,}x{r['dim']} {r['policy']}", r["examples_per_s"], "ex/s",
            r["vs_dense"], (r["vs_dense_min"], r["vs_dense_max"]), (r["min"], r["max"]),
            note=f"resolved: {r['resolved']}") for r in results.values()], "dense")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20,
                        help="large table: steps per policy and round (a multiple of "
                             "train.steps_per_loop, 20)")
    parser.add_argument("--small_steps", type=int, default=400,
                        help="small table: steps per policy and round (the same)")
    parser.add_argument("--warmup", type=int, default=60,
                        help="steps of each Trainer after it is built (then one untimed "
                             "round of all)")
    parser.add_argument("--sizes", default="large,small", help=", ".join(SIZES))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    if unknown := set(sizes) - set(SIZES):
        parser.error(f"--sizes: unknown {sorted(unknown)}; known: {', '.join(SIZES)}")
    from models.configs.text_classifier import get_config

    per_loop = get_config().train.steps_per_loop
    for flag in ("steps", "small_steps", "warmup"):
        if getattr(args, flag) <= 0 or getattr(args, flag) % per_loop:
            parser.error(f"--{flag} must be a positive multiple of train.steps_per_loop "
                         f"({per_loop}): every timed fit() runs whole loops")
    started = time.perf_counter()
    steps = {"large": args.steps, "small": args.small_steps}
    results = measure(sizes, args.rounds, steps, args.warmup)
    print(format_table(f"sparse_reduce: perf.sparse_reduce, text classifier, Trainer.fit on 2 "
                       f"Mirrored replicas (virtual CPU devices), perf.plan='fixed', batch 32, "
                       f"Adam; {args.rounds} rounds x {args.steps} (large) / "
                       f"{args.small_steps} (small) steps per policy "
                       f"({time.perf_counter() - started:.0f} s in all)", results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
    # Without TensorFlow's object-by-object teardown: destroying the six Trainers'
    # distributed iterators stalled the exit by 2-3 minutes (trainer.runtime.fast_exit).
    from trainer.runtime.fast_exit import exit_now

    exit_now(0)
