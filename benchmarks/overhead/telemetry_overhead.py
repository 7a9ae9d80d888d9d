"""Telemetry overhead: the same MLP run with telemetry off, on without probes, and on
(the default), side by side in one process; prints examples/s and ratios to "off".

    python -m benchmarks.overhead.telemetry_overhead [--rounds 7] [--steps 2000]
                                                     [--json out.json]

The MLP workload (``benchmarks.common.workloads``: 784 -> 256 -> 10, batch 64) has the
cheapest step, so per-window costs show most. Every mode is its own Trainer on the same
strategy; each round runs ``--steps`` more steps of every mode (``fit()`` again, in a
rotating order) with ``train.log_every_steps=100`` and ``steps_per_loop=50``; the "on"
modes have a workdir (TensorBoard and metrics.jsonl are written; checkpoints, if the
loop has them, are the same in every mode). "off" removes the
``Telemetry`` callback from the Trainer's services (``trainer.callbacks.services``; the
other services stay); "on" is the default (probes every
``telemetry.probe_every_windows`` windows, counted per fit()).

On a shared machine the end-to-end ratios are noisy, so the host time spent inside the
Telemetry callback's hooks is also measured directly (its bound methods wrapped with a
timer), as a share of the fit() wall time ("callbacks": everything but the probes;
"probes": the input/compute probes). The probes run inside ``on_log``; their time is
estimated as the ``on_log`` time of the windows that probed (``perf/probe_step`` is
the window's step) minus the median ``on_log`` time of the windows that did not.
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

MODES = ("off", "on_no_probes", "on")


def _trainer(workload, mode: str, steps_per_loop: int, log_every: int, workdir: str | None):
    from benchmarks.common.workloads import framework_trainer

    overrides = {"train.log_every_steps": log_every, "distribute.strategy": "one_device",
                 "perf.plan": "fixed"}  # the modes compare one plan
    if mode == "on_no_probes":
        overrides["telemetry.probe_every_windows"] = 0
    return framework_trainer(workload, steps_per_loop, workdir=workdir, **overrides)


def _timed(fn, clock: dict):
    """``fn``, its seconds added to ``clock["callbacks"]``."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock["callbacks"] += time.perf_counter() - start
    return wrapper


def _timed_on_log(part, clock: dict, windows: dict):
    """``part.on_log`` (the Telemetry service's), timed: its seconds added to
    ``clock["callbacks"]`` and filed in ``windows`` by whether the window probed."""
    on_log = part.on_log

    def wrapper(trainer, logs):
        start = time.perf_counter()
        try:
            return on_log(trainer, logs)
        finally:
            seconds = time.perf_counter() - start
            clock["callbacks"] += seconds
            probed = bool(part.records) and (
                part.records[-1].get("perf/probe_step") == trainer.step)
            windows["probed" if probed else "plain"].append(seconds)
    return wrapper


def _instrument(trainers: dict, spent: dict, on_log_s: dict) -> None:
    """Removes the Telemetry service of the ``off`` Trainer; times the hooks of the
    others' (into ``spent[mode]``, ``on_log`` also into ``on_log_s[mode]``)."""
    from trainer.telemetry.service import Telemetry

    for mode, t in trainers.items():
        services = t.callbacks.services
        part = next(p for p in services if isinstance(p, Telemetry))
        if mode == "off":
            services.remove(part)
            continue
        for name in ("on_fit_start", "on_loop_end", "on_eval_end", "on_fit_end"):
            setattr(part, name, _timed(getattr(part, name), spent[mode]))
        part.on_log = _timed_on_log(part, spent[mode], on_log_s[mode])


def _probe_seconds(windows: dict) -> float:
    """The probes' share of ``on_log``: probed windows minus the plain median."""
    if not windows["probed"]:
        return 0.0
    plain = statistics.median(windows["plain"]) if windows["plain"] else 0.0
    return max(0.0, sum(windows["probed"]) - plain * len(windows["probed"]))


def _summary(rates: dict[str, list[float]], spent: dict, on_log_s: dict) -> dict:
    """Per mode: examples/s (median, spread), the ratios to ``off``, and the shares of
    the fit's time spent in the callbacks and in the probes."""
    modes = {}
    for mode in MODES:
        ratios = [v / o for v, o in zip(rates[mode], rates["off"])]
        clock, probes = spent[mode], _probe_seconds(on_log_s[mode])
        modes[mode] = {"examples_per_s": statistics.median(rates[mode]),
                       "spread": (min(rates[mode]), max(rates[mode])),
                       "ratio_to_off": statistics.median(ratios),
                       "min_ratio": min(ratios), "max_ratio": max(ratios),
                       "callback_share": (clock["callbacks"] - probes) / clock["fit"],
                       "probe_share": probes / clock["fit"]}
    return modes


def run(rounds: int, steps: int) -> dict:
    from absl import logging

    from benchmarks.common.workloads import WORKLOADS

    logging.set_verbosity(logging.WARNING)
    workload = WORKLOADS["mlp"]
    root = tempfile.mkdtemp(prefix="telemetry_overhead_")
    trainers = {mode: _trainer(workload, mode, 50, 100,
                               os.path.join(root, mode))
                for mode in MODES}

    spent = {mode: {"fit": 0.0, "callbacks": 0.0} for mode in MODES}
    on_log_s = {mode: {"probed": [], "plain": []} for mode in MODES}
    _instrument(trainers, spent, on_log_s)

    def fit(mode: str, n: int) -> float:
        t = trainers[mode]
        t.config.train.steps = t.step + n
        start = time.perf_counter()
        t.fit()
        seconds = time.perf_counter() - start
        spent[mode]["fit"] += seconds
        return n * workload.batch_size / seconds

    for mode in MODES:
        fit(mode, steps)  # trace, build the probes, warm up
    for clock in spent.values():
        clock.update(fit=0.0, callbacks=0.0)
    for windows in on_log_s.values():
        windows.update(probed=[], plain=[])
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(rounds):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for mode in order:
            rates[mode].append(fit(mode, steps))
    return {"workload": "mlp", "batch": workload.batch_size, "steps_per_round": steps,
            "rounds": rounds, "log_every_steps": 100, "steps_per_loop": 50,
            "modes": _summary(rates, spent, on_log_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    result = run(args.rounds, args.steps)
    rows = [Row(mode, m["examples_per_s"], "ex/s", m["ratio_to_off"],
                (m["min_ratio"], m["max_ratio"]), m["spread"],
                note=f"callbacks {m['callback_share']:.2%}, probes {m['probe_share']:.2%} "
                     "of the fit's time") for mode, m in result["modes"].items()]
    print(format_table(f"telemetry_overhead: MLP batch {result['batch']}, "
                       f"{result['rounds']} rounds x {result['steps_per_round']} steps "
                       "(window 100 steps, 50 per loop call)", rows, "off"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
