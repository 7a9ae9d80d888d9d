"""The small-model regression check: the framework's default config vs the hand-written
loop on the rows where the host work around each loop call shows.

    python -m benchmarks.speed.small_model_regression [--rounds 9] [--seconds 2]
                                                      [--rows mlp/default,mlp/mirrored2]

Run it before you stop when you changed anything a ``fit()`` does per loop call or at
its start and end (the loop, the callbacks and services, the input, the plan). A row
is the MLP 784-256-10 at global batch 64 with the DEFAULT config (``perf.plan="auto"``)
on one device (``mlp/default``) or on 2 Mirrored replicas of virtual CPU devices
(``mlp/mirrored2``); each row runs in its own process (a process hosts one device
layout) the paired interleaved rounds of :func:`benchmarks.speed.throughput.measure`: the
framework (``a``: one short ``fit()`` per round) and the hand-written K-step in-graph
loop (``c``, and ``c+xla`` where XLA compiles; the per-round faster is the reference,
``best``). Per row it prints the median [min..max] of the per-round ratios a / best:

* ``per fit``: a's whole ``fit()``, its start (the iterator: the one the last fit kept,
  or a new one; the services' ``on_fit_start``) and end (final callbacks, the iterator
  kept) included;
* ``in fit``: a's loop calls and the host work between them, after the first call
  (:func:`benchmarks.common.throughput_impls.fit_clock`): a fit that builds a new iterator
  skips the batches consumed before it in its first call, which grows with the step the
  fit starts from (a's fits continue the kept iterator: no skip);

then a per-call cost table of one more ``fit()`` of a (4 rounds long): the compiled
call (median seconds per step, next to best's), the host work between two calls
(median) and the parts of it that can be timed alone (each called ``--repeats`` times
on the fitted Trainer; the rest is the services' ``on_loop_end``, the planner's
bookkeeping after a call and the loop's own lines); that fit's first call, start and
end; and the start + end of the rounds' fits (per-fit minus in-fit seconds).
benchmarks/README.md says how to read a slide.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from benchmarks.common import table
from benchmarks.common.table import Row
from benchmarks.speed.throughput import measure

ROWS = ("mlp/default", "mlp/mirrored2")


def _us_per_call(fn: Callable[[], object], repeats: int) -> float:
    """Microseconds per call of ``fn``: the median of 5 timings of ``repeats`` calls."""
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        times.append((time.perf_counter() - start) / repeats)
    return 1e6 * statistics.median(times)


def host_parts(trainer, repeats: int) -> dict[str, float]:
    """Microseconds per loop call of the host work the loop does around each call that
    can be called alone on a fitted Trainer (host, cross-replica context; nothing
    changes: the watch is a fresh one, the plan is decided, the loops are traced)."""
    import numpy as np
    import tensorflow as tf

    from trainer.distribution import host_collectives
    from trainer.loop.compiled_loops import TrainableWatch

    watch, driver, flags = TrainableWatch(), trainer.driver, np.zeros(2, np.int32)
    return {
        "callbacks.next_boundary": _us_per_call(
            lambda: trainer.callbacks.next_boundary(trainer.step), repeats),
        "TrainableWatch.changed": _us_per_call(
            lambda: watch.changed(trainer.model, trainer.step), repeats),
        "planner.next_plan": _us_per_call(lambda: driver.planner.next_plan(), repeats),
        "loops (plan's) + prepare (traced)": _us_per_call(
            lambda: driver.loops.prepare(None), repeats),
        "step count tensor": _us_per_call(lambda: tf.constant(50, tf.int64), repeats),
        "stop agreement (sum_over_workers)": _us_per_call(
            lambda: host_collectives.sum_over_workers(trainer.strategy, flags), repeats),
    }


def call_costs(framework, steps: int, best_step_s: float, repeats: int) -> dict:
    """The per-call cost table of ``framework`` (a built, warmed-up ``a``): one fit of
    ``steps`` steps timed per loop call by its clock (its first call apart: a new
    iterator would skip the batches consumed before it there), the parts of the host work timed
    alone, and the reference's (best: c or c+xla) median seconds per step."""
    start_step, clock = framework.trainer.step, framework.clock
    begin = time.perf_counter()
    framework.run(steps)
    returned = time.perf_counter()
    first, *calls = clock.calls  # the first: where a new iterator skips
    host_s = statistics.median(h for _, _, h in calls)
    return {"calls": len(calls), "steps_per_call": statistics.median(n for n, _, _ in calls),
            "start_step": start_step, "first_call_s": first[1],
            "start_s": clock.start - begin, "end_s": returned - clock.end,
            "call_step_s": statistics.median(s / n for n, s, _ in calls),
            "best_step_s": best_step_s, "host_us": 1e6 * host_s,
            "call_s": statistics.median(s for _, s, _ in calls),
            "parts_us": host_parts(framework.trainer, repeats)}


def run_row(row: str, rounds: int, seconds: float, repeats: int) -> dict:
    """One row in this process: the paired rounds, then the cost table."""
    from benchmarks.common.workloads import WORKLOADS

    workload, strategy = row.split("/")
    built: dict = {}
    run = measure(workload, strategy, rounds, seconds, ("a",), built)
    a, best = run["implementations"]["a"], run["implementations"].get("best")
    reference = best or run["implementations"]["c"]
    batch, steps = WORKLOADS[workload].batch_size, run["steps_per_round"]
    best_step_s = batch / reference["examples_per_s"]
    return {"row": row, "rounds": rounds, "steps_per_round": steps,
            "a_per_round": a["per_round"], "a_in_fit_per_round": a["in_fit"]["per_round"],
            "per_fit": [v / r for v, r in zip(a["per_round"], reference["per_round"])],
            "in_fit": [v / r for v, r in zip(a["in_fit"]["per_round"],
                                              reference["per_round"])],
            "start_end_s": [steps * batch * (1 / whole - 1 / inside) for whole, inside
                            in zip(a["per_round"], a["in_fit"]["per_round"])],
            "plan": run["plan"],
            "first_step": built["a"].trainer.step - rounds * steps,
            "costs": call_costs(built["a"], 4 * run["steps_per_round"], best_step_s, repeats)}


def _ratio_row(what: str, values: list[float], ratios: list[float]) -> Row:
    return Row(what, statistics.median(values), "ex/s", statistics.median(ratios),
               (min(ratios), max(ratios)), (min(values), max(values)))


def format_row(result: dict) -> str:
    """One row's table: a per fit and in fit against best, then the cost table of one
    more fit of a."""
    costs = result["costs"]
    parts = costs["parts_us"]
    rest = costs["host_us"] - sum(parts.values())
    plan = result["plan"]["chosen"] if result["plan"] else None
    start_end = result["start_end_s"]
    rows = [_ratio_row("a per fit", result["a_per_round"], result["per_fit"]),
            _ratio_row("a in fit", result["a_in_fit_per_round"], result["in_fit"]),
            Row(f"compiled call ({costs['steps_per_call']:.0f} steps, median of "
                f"{costs['calls']} calls)", 1e3 * costs["call_s"], "ms",
                costs["best_step_s"] / costs["call_step_s"],
                note=f"{1e6 * costs['call_step_s']:.1f} us/step, best's "
                     f"{1e6 * costs['best_step_s']:.1f}: the ratio is best's step time "
                     "over the call's"),
            Row("host work between two calls", costs["host_us"], "us",
                note=f"{100 * costs['host_us'] / (1e6 * costs['call_s']):.2f} % of the call")]
    rows += [Row(f"- {name}", us, "us") for name, us in parts.items()]
    rows += [Row("- the rest (services on_loop_end, ...)", rest, "us"),
             Row("first call of the fit", 1e3 * costs["first_call_s"], "ms",
                 note=f"from step {costs['start_step']}: a new iterator would skip that "
                      "many batches first; the kept one does not"),
             Row("this fit's start", 1e3 * costs["start_s"], "ms",
                 note="fit() to the end of on_fit_start"),
             Row("this fit's end", 1e3 * costs["end_s"], "ms",
                 note="the last on_loop_end to fit()'s return"),
             Row("per fit of a: start + end", statistics.median(start_end), "s",
                 spread=(min(start_end), max(start_end)),
                 note=f"the iterator continued from step {result['first_step']}+")]
    title = (f"small_model_regression: {result['row']}, {result['rounds']} rounds of "
             f"{result['steps_per_round']} steps; a's plan: " + (
                 f"xla {plan['xla']}, {plan['steps_per_loop']} steps per call" if plan
                 else "no plan event"))
    return table.format_table(title, rows, "best")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="target duration of one timed run of the reference")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--repeats", type=int, default=2000,
                        help="calls per timing of a host part")
    parser.add_argument("--row_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row_child:
        print(json.dumps(run_row(args.row_child, args.rounds, args.seconds, args.repeats)))
        return
    rows = args.rows.split(",")
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {','.join(ROWS)}")
    for row in rows:
        print(f"running {row} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.speed.small_model_regression", "--row_child", row,
             "--rounds", str(args.rounds), "--seconds", str(args.seconds),
             "--repeats", str(args.repeats)],
            capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{row}: the child process failed ({proc.returncode})")
        print(format_row(json.loads(proc.stdout.strip().splitlines()[-1])) + "\n", flush=True)


if __name__ == "__main__":
    main()
