"""Training throughput: the framework vs the loops a user would write instead.

    python -m benchmarks.speed.throughput --workload mlp --strategy default [--rounds 3]
                                          [--impls a,a-fixed,c] [--seconds 2]
    python -m benchmarks.speed.throughput --all [--json benchmarks/results/throughput.json]

Implementations (same model, Adam, same synthetic in-memory data, same global batch;
classes in :mod:`benchmarks.common.throughput_impls`):

  a        this framework's ``Trainer.fit`` with its DEFAULT config (``perf.plan="auto"``,
           default ``train.steps_per_loop``): the planner times candidate plans (XLA
           on/off, steps per loop) on real steps of the first fit and keeps the fastest
  a-short  a new ``Trainer`` of a's config run in short fits only (never measured), as a
           user iterating runs them: it adopts the plan a measured from the plan cache
           (this process's own, empty at start; list a before it), else keeps the config
  a-fixed  ``Trainer.fit`` with ``perf.plan="fixed"``, ``steps_per_loop=K``: the config
           as written, no XLA (``a+xla``: the same with ``perf.jit_compile=True``)
  b        a hand-written ``tf.function`` called once per step
  c        a hand-written ``tf.function`` running K steps in-graph (``c+xla``: its
           replica step, forward + backward + update, is ``jit_compile=True``)
  d        ``keras.Model.fit`` at its defaults
  e        ``keras.Model.fit(steps_per_execution=K)``

They run interleaved in rotating order over rounds in ONE process (warm-up excluded);
the table shows median examples/s, min/max, ``vs c`` (the median of the per-round
ratio to c) and ``vs best`` (the median of the per-round ratio to the faster of c and
c+xla in that round: the ``best`` row; c alone where c+xla failed). c and c+xla always
run. A failing implementation is reported in its row, not fatal.

The plan's measuring is in a's warm-up, not in the timed rounds. The timed rounds are
short fits (about ``--seconds`` each); the planner does not measure a fit whose remaining
time is below ``perf.plan_min_run_s`` (30 s) and sizes its trials by the run's length.
So a's warm-up starts ONE fit declared ``PLANNED_RUN_S`` (600 s) long at the
reference's step time, as a real run would be, and a callback stops it at the first
loop end after the plan event (``trainer.request_stop``); the config stays the default
and the timed fits reuse the plan. Below the table, one line per workload x strategy
gives the plan a chose, its measured ratio to the baseline (the configured plan) and
the measuring time, read from a's ``kind == "plan"`` event (``trainer.events.records``).

Cold start (process start to first step done) and peak RSS come from separate
processes, one per implementation and repetition (median of ``--cold_runs``); each
trains 1 + K steps, too short for the planner to measure (a keeps its configured plan).
``--all`` runs each workload x strategy in its own process (a process hosts one
device layout) and prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import table
from benchmarks.common.table import Row
from benchmarks.common.throughput_impls import (IMPLEMENTATIONS, K, PLANNED_RUN_S, REFERENCES,
                                                build, setup_devices)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

STRATEGIES = ("default", "mirrored2")
COLD_START = ("a", "b", "d")
HEADER = ("a: default config (perf.plan='auto'); its warm-up starts a fit declared "
          "{planned:g} s long at the reference's step time and stops it once the plan is "
          "decided: the planner measures there, outside the timed rounds. a-fixed: "
          "perf.plan='fixed'. vs best: per-round ratio to the faster of c and c+xla.")


def _short(error: BaseException) -> str:
    """The error's first line, or TensorFlow's first root error when there is one
    (without its ``(defined @ file:line)`` notes)."""
    lines = [" ".join(line.split()) for line in str(error).splitlines() if line.strip()]
    root = next((line[4:] for line in lines if line.startswith("(0) ")), None)
    text = re.sub(r" \(defined @ [^)]*\)", "", root or (lines or [""])[0])
    return f"{type(error).__name__}: {text}"[:200]


def _seconds_per_step(impl) -> float:
    start = time.perf_counter()
    impl.run(K)
    return (time.perf_counter() - start) / K


def _warm_up(selected: list[str], workload, strategy) -> tuple[dict, dict, float | None]:
    """Builds and warms up ``selected``: ``(impls, errors, c's seconds per step)``.

    The references go first: their step time (the faster one's) sizes the auto
    trainer's warm-up fit, in which the planner measures.
    """
    impls, errors, step_s = {}, {}, {}
    for name in sorted(selected, key=lambda n: n not in REFERENCES):
        try:
            impl = build(name, workload, strategy)
            impl.warm_up(2 * K, min(step_s.values(), default=None))
            if name in REFERENCES:
                step_s[name] = _seconds_per_step(impl)
            impls[name] = impl
        except Exception as error:  # reported in the table, not fatal
            errors[name] = _short(error)
    return impls, errors, step_s.get("c")


def _best_of_references(rates: dict[str, list[float]]) -> list[float]:
    """Per round: the faster of c and c+xla (c alone where c+xla has no value)."""
    with_xla = rates.get("c+xla", [])
    return [max(c, with_xla[i]) if i < len(with_xla) else c
            for i, c in enumerate(rates.get("c", []))]


def _summary(values: list[float], c: list[float], best: list[float]) -> dict:
    ratios_c = [v / r for v, r in zip(values, c)]
    ratios_best = [v / r for v, r in zip(values, best)]
    return {"examples_per_s": statistics.median(values), "min": min(values),
            "max": max(values), "per_round": values,
            "ratio_to_c": statistics.median(ratios_c) if ratios_c else None,
            "ratio_to_best": statistics.median(ratios_best) if ratios_best else None,
            "ratios_to_c": ratios_c, "ratios_to_best": ratios_best}


def measure(workload_name: str, strategy_name: str, rounds: int, seconds: float,
            only: tuple[str, ...] = IMPLEMENTATIONS, built: dict | None = None) -> dict:
    """Interleaved rounds in this process; returns per-implementation results.

    ``only``: the implementations to run (the references c and c+xla are always
    included). ``best`` is the per-round faster of c and c+xla. The framework's
    results also hold ``in_fit``: the same summary of its rates inside each ``fit()``
    (without the fit's start and end; :func:`benchmarks.common.throughput_impls.fit_clock`).
    ``built``: when given, receives the implementations that ran, by name (to look
    into after the rounds).
    """
    from benchmarks.common.workloads import WORKLOADS

    strategy = setup_devices(strategy_name)
    workload = WORKLOADS[workload_name]
    selected = [n for n in IMPLEMENTATIONS if n in only or n in REFERENCES]
    impls, errors, step_s = _warm_up(selected, workload, strategy)
    # Steps per timed run: about `seconds` of the reference (c), a multiple of K.
    steps = max(K, int(seconds / step_s) // K * K) if step_s else K
    rates: dict[str, list[float]] = {name: [] for name in impls}
    in_fit: dict[str, list[float]] = {name: [] for name in impls}  # rates inside fit()
    names = list(impls)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            try:
                start = time.perf_counter()
                impls[name].run(steps)
                rates[name].append(steps * workload.batch_size / (time.perf_counter() - start))
                if impls[name].in_fit_s is not None:
                    in_fit[name].append(steps * workload.batch_size / impls[name].in_fit_s)
            except Exception as error:
                errors[name] = _short(error)
                impls.pop(name)
                names.remove(name)
                rates.pop(name)
    best = _best_of_references(rates)
    if built is not None:
        built.update(impls)
    results = {}
    for name in selected:
        if name in errors:
            results[name] = {"error": errors[name]}
        else:
            results[name] = dict(_summary(rates[name], rates.get("c", []), best),
                                 xla=impls[name].xla)
            if in_fit[name]:
                results[name]["in_fit"] = _summary(in_fit[name], rates.get("c", []), best)
        if name == "c+xla" and best:
            with_xla = rates.get("c+xla", [])
            results["best"] = dict(_summary(best, rates["c"], best), xla=None, xla_rounds=sum(
                i < len(with_xla) and with_xla[i] > c for i, c in enumerate(rates["c"])))
    plan = impls["a"].plan() if "a" in impls else None
    return {"workload": workload_name, "strategy": strategy_name, "steps_per_round": steps,
            "rounds": rounds, "implementations": results, "plan": plan}


def _peak_rss_mb() -> float:
    """This process's own peak resident memory (MB).

    Linux's ``ru_maxrss`` keeps the high-water mark of the process image before
    ``exec`` (here: the benchmark parent that forked it), so ``VmHWM`` is read instead.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cold_start_child(impl: str, workload_name: str, strategy_name: str) -> None:
    """Runs in a fresh process: first step, then K more; prints one JSON line."""
    from benchmarks.common.workloads import WORKLOADS

    strategy = setup_devices(strategy_name)
    implementation = build(impl, WORKLOADS[workload_name], strategy)
    implementation.run(1)
    first_step_done = time.time()
    implementation.run(K)
    print(json.dumps({"first_step_done": first_step_done,
                      "peak_rss_mb": _peak_rss_mb()}))


def cold_start(workload_name: str, strategy_name: str, names=COLD_START,
               runs: int = 3) -> dict:
    """Process start -> first step done, and peak RSS, per implementation.

    Each measurement is its own process; the implementations alternate over ``runs``
    repetitions and the medians are reported (one process start varies by 10-20%).
    """
    samples: dict[str, list[tuple[float, float]]] = {impl: [] for impl in names}
    errors: dict[str, str] = {}
    for _ in range(runs):
        for impl in names:
            started = time.time()
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.speed.throughput", "--cold_start_child", impl,
                 "--workload", workload_name, "--strategy", strategy_name],
                capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
            try:
                line = json.loads(proc.stdout.strip().splitlines()[-1])
                samples[impl].append((line["first_step_done"] - started, line["peak_rss_mb"]))
            except (IndexError, json.JSONDecodeError, KeyError):
                errors[impl] = (proc.stderr.strip().splitlines() or ["no output"])[-1][:120]
    out = {}
    for impl in names:
        if not samples[impl]:
            out[impl] = {"error": errors[impl]}
            continue
        seconds = [s for s, _ in samples[impl]]
        out[impl] = {"seconds": statistics.median(seconds), "runs_s": seconds,
                     "peak_rss_mb": statistics.median(r for _, r in samples[impl])}
    return out


def _row(run: dict, name: str, res: dict) -> Row:
    """One implementation's row: examples/s, the median per-round ratio to best and its
    range; the note holds the ratio to c, the XLA state, cold start and peak RSS."""
    if "error" in res:
        return Row(name, None, "ex/s", note=f"failed: {res['error']}")
    cold = run.get("cold_start", {}).get(name, {})
    notes = [] if res["ratio_to_c"] is None else [f"vs c {res['ratio_to_c']:.2f}"]
    notes.append(f"c+xla faster in {res['xla_rounds']}/{len(res['per_round'])} rounds"
                 if name == "best" else f"xla {res['xla']}")
    if "seconds" in cold:
        notes.append(f"cold start {cold['seconds']:.1f} s, peak RSS {cold['peak_rss_mb']:.0f} MB")
    ratios = res["ratios_to_best"]
    return Row(name, res["examples_per_s"], "ex/s", res["ratio_to_best"],
               (min(ratios), max(ratios)) if ratios else None, (res["min"], res["max"]),
               "; ".join(notes))


def format_plan(run: dict) -> str:
    """One line: the plan the default config (a) chose, from its plan event."""
    where = f"{run['workload']}/{run['strategy']}"
    plan = run.get("plan")
    if plan is None:
        return f"plan {where}: no plan event (a not run, failed, or no decision in its warm-up fit)"

    def shown(p: dict) -> str:
        return f"xla={p['xla']} steps_per_loop={p['steps_per_loop']}"

    timed = ", ".join(f"xla={p['xla']}/{p['steps_per_loop']} "
                      + (f"{p['vs_baseline']:.2f}" if p["vs_baseline"] is not None
                         else "not timed")
                      for p in plan["plans"])
    return (f"plan {where}: {plan['source']} at step {plan['step']}, chosen "
            f"{shown(plan['chosen'])}, {plan['ratio']:.2f}x the baseline "
            f"{shown(plan['baseline'])}; measuring {plan['measure_s']:.1f} s; "
            f"timed (xla/steps_per_loop, vs baseline): {timed or '-'}")


def format_table(runs: list[dict]) -> str:
    """One table per workload x strategy, ratios to ``best`` (per round the faster of c
    and c+xla; its row says in how many rounds c+xla was it), each followed by the line
    of the plan a chose."""
    return "\n\n".join(
        table.format_table(f"throughput: {run['workload']} / {run['strategy']}, "
                           f"{run['rounds']} rounds x {run['steps_per_round']} steps",
                           [_row(run, name, res) for name, res in run["implementations"].items()],
                           "best") + "\n" + format_plan(run)
        for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="mlp", choices=("mlp", "cnn", "transformer"))
    parser.add_argument("--strategy", default="default", choices=STRATEGIES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="target duration of one timed run of the reference")
    parser.add_argument("--all", action="store_true", help="every workload x strategy")
    parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS),
                        help="comma-separated subset of " + ",".join(IMPLEMENTATIONS)
                        + " (c and c+xla always run: the references)")
    parser.add_argument("--no_cold_start", action="store_true")
    parser.add_argument("--cold_runs", type=int, default=3,
                        help="processes per implementation for the cold start (median)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--cold_start_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = tuple(args.impls.split(","))
    unknown = sorted(set(names) - set(IMPLEMENTATIONS))
    if unknown:
        parser.error(f"--impls: unknown {unknown}; choose from {','.join(IMPLEMENTATIONS)}")

    if args.cold_start_child:
        cold_start_child(args.cold_start_child, args.workload, args.strategy)
        return
    # A plan cache of this run's own (trainer/loop/plan_cache.py; its children inherit
    # it): results never depend on plans measured before, and a-short adopts only a's.
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="throughput-plans-")
    if args.all:
        runs = []
        for workload in ("mlp", "cnn", "transformer"):
            for strategy in STRATEGIES:
                cmd = [sys.executable, "-m", "benchmarks.speed.throughput", "--workload", workload,
                       "--strategy", strategy, "--rounds", str(args.rounds),
                       "--seconds", str(args.seconds), "--impls", args.impls,
                       "--json", "/dev/stdout"]
                cmd += ["--no_cold_start"] if args.no_cold_start else [
                    "--cold_runs", str(args.cold_runs)]
                print(f"running {workload} / {strategy} ...", file=sys.stderr, flush=True)
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      cwd=Path(__file__).resolve().parents[2])
                try:
                    runs.append(json.loads(proc.stdout.split("\n%%JSON%%\n")[-1]))
                except json.JSONDecodeError:
                    print(proc.stderr[-2000:], file=sys.stderr)
                    raise
    else:
        run = measure(args.workload, args.strategy, args.rounds, args.seconds, names)
        if not args.no_cold_start:
            run["cold_start"] = cold_start(args.workload, args.strategy,
                                           [n for n in COLD_START if n in names],
                                           args.cold_runs)
        runs = [run]
    machine = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    import tensorflow as tf

    machine["tensorflow"] = tf.__version__
    report = {"machine": machine, "runs": runs}
    if args.json == "/dev/stdout":
        print("\n%%JSON%%\n" + json.dumps(runs[0]))
        return
    print(HEADER.format(planned=PLANNED_RUN_S))
    print(format_table(runs))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
