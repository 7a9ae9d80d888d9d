"""Checkpoint cost on a ~50M-parameter model: save / restore times and the training stall.

    python -m benchmarks.checkpoints.checkpoint [--width 2048 --layers 12] [--interval 25]
                                                [--rounds 3] [--pairs 8]
                                                [--json benchmarks/results/checkpoint.json]

Model: an MLP of ``layers`` Dense(width) layers (50.4M parameters at the defaults),
Adam (so the saved state is 3x the parameters: weights, two slots), fp32, batch 32,
synthetic in-memory data, one device. Everything runs in ONE process through the
public path: ``Trainer.fit`` with ``config.checkpoint.*``, ``Trainer.restore`` and
(for 1.) ``trainer.checkpoint.service.Checkpointer.save``.

The two array writers are compared through ``config.checkpoint.fast_io``: the
O_DIRECT ``.npy`` files of ``trainer.checkpoint.storage.array_files`` (``fast_io=True``: the "sync" and
"async" arms) and orbax's stock tensorstore handler (``fast_io=False``, the default:
the "async_tensorstore" arm).

1. Save and restore times, median over rounds, for a synchronous save
   (``async_save=False``), an asynchronous one, and an asynchronous one whose arrays
   are written by orbax's stock tensorstore handler: the time the train loop is held
   (snapshot to host + dispatch; all of it for sync), the time until committed, and
   the process CPU until committed (every thread): what one async save can take from a
   training that keeps every core busy (memory-bandwidth and cache effects come on
   top). The timed save starts ``PAUSE_S`` after the previous one, as in a run: a VM
   that returns freed memory to its host has done so by then, which matters for
   page-cache writes. Then a restore of the latest step (read + assign).
2. Training stall of one async save, side by side: each round runs, in rotating order,
   ``fit()`` over ``R = 3`` save intervals of ``interval`` steps with a checkpoint
   every ``interval`` steps (async; async with the arrays written by orbax's stock
   tensorstore handler; sync for contrast)
   and the same ``fit()`` with ``every_steps=0``. Both end with one (waited-for) save, so the difference is
   ``R - 1`` mid-run saves; divided by ``R - 1`` it is the stall of one save, and
   divided by the baseline time of one interval it is the overhead averaged over a
   save interval (the goal: < 2% for async). Differences are paired within a round
   (the arms of one round run back to back) and the median over rounds is reported,
   so a slow drift of the machine between rounds cancels. The process CPU time of the
   same runs is reported too: the extra CPU one save costs.
3. The same stall from adjacent windows of ONE run, which is far less noisy: ``fit()``
   over ``2 * --pairs`` intervals with one logging window per interval and an async
   save every second interval, so windows alternate between "the save's background
   write runs during it" and "clean". The loop time of each such pair differs by the
   CPU the background write took from training; the stall of one save is that
   difference (median over pairs, from ``metrics.jsonl``) plus the time the save held
   the loop (1., measured directly). Run for both array writers; the last lines
   print the ratio of their stalls.
4. The cost of the checksums (``trainer/checkpoint/storage/checksums.py``), per array writer:
   see ``benchmarks/common/checkpoint_checksums.py``. ``--only checksums`` runs the warm-up
   and this part alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

from benchmarks.common import checkpoint_checksums
from benchmarks.common.checkpoint_checksums import PAUSE_S, WRITERS
from benchmarks.common.table import Row, format_table

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

INTERVALS_PER_RUN = 3
ARMS = ("async", "async_tensorstore", "sync")  # the arms with saves, besides "baseline"
SAVES = (("sync", False, False), ("async", True, False),  # (name, async_save, tensorstore)
         ("async_tensorstore", True, True))


def _trainer(args, workdir: str):
    import keras
    import numpy as np

    from benchmarks.common.arrays_trainer import ArraysTrainer
    from trainer import config as config_lib

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, args.width)).astype(np.float32)
    y = rng.integers(0, 10, size=(1024,)).astype(np.int32)

    class MLPTrainer(ArraysTrainer):
        def build_model(self):
            layers = [keras.Input((args.width,))]
            layers += [keras.layers.Dense(args.width, activation="relu")
                       for _ in range(args.layers)]
            return keras.Sequential(layers + [keras.layers.Dense(10)])

        def arrays(self):
            return x, y

    config = config_lib.get_config()
    config.train.global_batch_size = 32
    config.train.steps_per_loop = args.interval
    config.train.log_every_steps = 10**9
    config.train.steps = 1
    config.optimizer.name = "adam"
    config.distribute.strategy = "one_device"
    config.checkpoint.max_to_keep = 1
    config.checkpoint.fast_io = True  # the .npy writer unless an arm asks for tensorstore
    config.telemetry.progress = "off"
    config.telemetry.probe_every_windows = 0  # no input probes inside the timed windows
    return MLPTrainer(config, workdir)


def _fit(trainer, steps: int, every: int, async_save: bool,
         tensorstore: bool = False) -> tuple[float, float]:
    """Wall and process-CPU seconds of ``fit()`` over ``steps`` more steps; with
    ``tensorstore`` the arrays are written by orbax's stock handler (``fast_io=False``)."""
    cfg = trainer.config
    cfg.train.steps = trainer.step + steps
    cfg.checkpoint.every_steps = every
    cfg.checkpoint.async_save = async_save
    cfg.checkpoint.fast_io = not tensorstore
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit()
    return time.perf_counter() - start, time.process_time() - cpu


def _save_times(trainer, rounds: int) -> dict[str, list[float]]:
    """Per kind of save (:data:`SAVES`): seconds the loop is held, seconds until
    committed, process CPU seconds until committed (all threads); and restore seconds.

    Each save is the second of one ``Checkpointer`` (its host buffers already filled),
    as every save of a run but its first is.
    """
    from trainer.checkpoint.service import Checkpointer

    out: dict[str, list[float]] = {f"{name}_{what}": [] for name, _, _ in SAVES
                                   for what in ("hold_s", "total_s", "cpu_s")}
    out["restore_s"] = []
    for _ in range(rounds):
        _fit(trainer, 1, 0, True)  # one more step (its own save is not timed)
        for name, async_save, tensorstore in SAVES:
            cfg = trainer.config.checkpoint
            cfg.async_save, cfg.fast_io = async_save, not tensorstore
            kind = f"bench_{name}"  # a directory of its own
            # Its store reads checkpoint.async_save / fast_io when it opens a directory.
            saver = Checkpointer(trainer.config, trainer.workdir, trainer.is_chief)
            saver.save(trainer.context, kind=kind, wait=True)  # fills the host buffers
            # So the step saves again: close the store (it remembers the step), delete
            # the step and reopen the directory outside the timed save.
            saver.writer.close()
            shutil.rmtree(os.path.join(trainer.workdir, kind, str(trainer.step)))
            if saver.writer.has(kind, trainer.step):
                raise RuntimeError(f"step {trainer.step} is still in {kind} after deleting it")
            time.sleep(PAUSE_S)  # the freed pages go back to the host, as between saves
            start, cpu = time.perf_counter(), time.process_time()
            saver.save(trainer.context, kind=kind)
            out[f"{name}_hold_s"].append(time.perf_counter() - start)
            saver.on_fit_end(trainer.context, {})  # waits for the commit, closes the store
            out[f"{name}_total_s"].append(time.perf_counter() - start)
            out[f"{name}_cpu_s"].append(time.process_time() - cpu)
            shutil.rmtree(os.path.join(trainer.workdir, kind))
        start = time.perf_counter()
        trainer.restore(trainer.step)
        out["restore_s"].append(time.perf_counter() - start)
    return out


def _window_stall(trainer, interval: int, pairs: int, tensorstore: bool) -> list[float]:
    """Per pair of adjacent windows: loop seconds after an async save minus clean."""
    cfg = trainer.config
    period = 2 * interval
    first = trainer.step + interval  # the first save comes after one clean window
    first += -first % period
    _fit(trainer, first - trainer.step, period, True,  # aligned: the next saves at k * period
         tensorstore)
    start = trainer.step
    cfg.train.log_every_steps = interval
    try:
        _fit(trainer, (pairs + 1) * period, period, True, tensorstore)
    finally:
        cfg.train.log_every_steps = 10**9
    seconds = {}
    with open(os.path.join(trainer.workdir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record["kind"] == "train" and record["step"] > start + interval:
                seconds[record["step"]] = record["perf/step_time_mean_s"] * interval
    # The window ending at s + interval follows the save at s (a multiple of period);
    # the window ending at s + period is clean (the write took less than an interval).
    return [seconds[s + interval] - seconds[s + period]
            for s in range(start + period, trainer.step, period)]


def _side_by_side(trainer, args) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Part 2: per arm (``baseline`` and :data:`ARMS`), the wall and process-CPU seconds
    of one ``fit()`` over ``INTERVALS_PER_RUN`` intervals in each round, the arms in a
    rotating order."""
    steps = INTERVALS_PER_RUN * args.interval
    arms = {"baseline": (0, True), "async": (args.interval, True),
            "async_tensorstore": (args.interval, True, True),
            "sync": (args.interval, False)}
    runs: dict[str, list[float]] = {name: [] for name in arms}
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        names = list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]
        for name in names:
            wall, cpu_s = _fit(trainer, steps, *arms[name])
            runs[name].append(wall)
            cpu[name].append(cpu_s)
    return runs, cpu


def _measure(args) -> dict:
    """Parts 1 to 4 on one Trainer in a temporary workdir (deleted after): the model's
    size, the save times (``times``), the side-by-side fits (``runs``, ``cpu``), the
    one-run window stalls per writer (``window``) and the checksums' costs (``costs``)."""
    workdir = tempfile.mkdtemp(prefix="ckpt_bench_")
    try:
        trainer = _trainer(args, workdir)
        _fit(trainer, 2 * args.interval, 0, True)  # warm-up: trace, build, first save
        params = trainer.model.count_params()
        state_bytes = sum(v.numpy().nbytes for v in trainer.model.variables
                          + trainer.optimizer.variables)
        times = _save_times(trainer, args.rounds)
        runs, cpu = _side_by_side(trainer, args)
        window = {writer: _window_stall(trainer, args.interval, args.pairs, writer == "tensorstore")
                  for writer in WRITERS}
        costs = checkpoint_checksums.cost(trainer, args.rounds, _fit)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"params": params, "state_bytes": state_bytes, "times": times, "runs": runs,
            "cpu": cpu, "window": window, "costs": costs}


def _summarise(args, measured: dict) -> tuple[dict, dict[str, float]]:
    """``(result, median)``: the figures the table and ``--json`` report (result), and
    the median of each save time and side-by-side arm (median)."""
    times, runs, cpu, window = (measured[k] for k in ("times", "runs", "cpu", "window"))
    median = {k: statistics.median(v) for k, v in {**times, **runs}.items()}
    interval_s = median["baseline"] / INTERVALS_PER_RUN
    saves = INTERVALS_PER_RUN - 1
    result = {
        "params": measured["params"], "state_mb": measured["state_bytes"] / 2**20,
        "interval_steps": args.interval, "step_ms": 1000 * interval_s / args.interval,
        **{k: median[k] for k in times}, "rounds": args.rounds, "runs_s": runs,
        "runs_cpu_s": cpu,
    }
    for name in ARMS:
        stalls = [(t - b) / saves for t, b in zip(runs[name], runs["baseline"])]
        result[f"{name}_stall_s_per_round"] = stalls
        result[f"{name}_stall_s"] = statistics.median(stalls)
        result[f"{name}_stall_pct_of_interval"] = 100 * result[f"{name}_stall_s"] / interval_s
        result[f"{name}_extra_cpu_s_per_save"] = statistics.median(
            (t - b) / saves for t, b in zip(cpu[name], cpu["baseline"]))
    for writer in WRITERS:
        result[f"{writer}_window_contention_s_per_pair"] = window[writer]
        stall = median["async_hold_s"] + statistics.median(window[writer])
        result[f"{writer}_async_window_stall_s"] = stall
        result[f"{writer}_async_window_stall_pct_of_interval"] = 100 * stall / interval_s
    for name in ("async", "async_tensorstore"):
        result[f"{name}_cpu_pct_of_interval"] = 100 * median[f"{name}_cpu_s"] / interval_s
    return result, median


def _rows(args, result: dict, median: dict[str, float], window: dict) -> list[Row]:
    """The table of parts 1 to 3; ratios: the .npy writer over the tensorstore writer."""
    interval_s = median["baseline"] / INTERVALS_PER_RUN
    rows = [Row("step", result["step_ms"], "ms",
                note=f"a save every {args.interval} steps ({interval_s:.1f} s)")]
    for name, _, _ in SAVES:  # one save, not a run's first
        rows += [Row(f"{name} save: loop held", median[f"{name}_hold_s"], "s"),
                 Row(f"{name} save: committed after", median[f"{name}_total_s"], "s"),
                 Row(f"{name} save: process CPU", median[f"{name}_cpu_s"], "s",
                     note="every thread, until committed")]
    rows.append(Row("restore (read + assign)", median["restore_s"], "s"))
    rows.append(Row("process CPU of one async save, .npy writer", median["async_cpu_s"], "s",
                    median["async_cpu_s"] / median["async_tensorstore_cpu_s"],
                    note=f"{result['async_cpu_pct_of_interval']:.1f}% of the interval (what it "
                         "can take from a training that keeps every core busy)"))
    for name in ARMS:
        rows.append(Row(
            f"{name} stall per save, side by side", result[f"{name}_stall_s"], "s",
            _ratio(result["async_stall_s"], result["async_tensorstore_stall_s"])
            if name == "async" else None,
            note=f"{result[f'{name}_stall_pct_of_interval']:.1f}% of the interval (goal for "
                 f"async: < 2%); extra CPU per save {result[f'{name}_extra_cpu_s_per_save']:.2f}"
                 f" s; per round {[round(x, 2) for x in result[f'{name}_stall_s_per_round']]}"))
    for writer in WRITERS:
        rows.append(Row(
            f"async stall per save, one run, {writer} writer",
            result[f"{writer}_async_window_stall_s"], "s",
            _ratio(result["npy_async_window_stall_s"], result["tensorstore_async_window_stall_s"])
            if writer == "npy" else None,
            note=f"{result[f'{writer}_async_window_stall_pct_of_interval']:.1f}% of the interval"
                 f" (hold {median['async_hold_s']:.2f} s + background-write contention, median "
                 f"of {len(window[writer])} window pairs: "
                 f"{[round(x, 2) for x in window[writer]]})"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--interval", type=int, default=25, help="steps between saves")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=8,
                        help="window pairs (after a save / clean) for the one-run estimate")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--only", choices=("all", "checksums"), default="all",
                        help="checksums: the warm-up and part 4 only")
    args = parser.parse_args()
    if args.only == "checksums":
        return _checksums_only(args)

    measured = _measure(args)
    result, median = _summarise(args, measured)
    print(format_table(
        f"checkpoint: {measured['params'] / 1e6:.1f}M parameters, saved state "
        f"{result['state_mb']:.0f} MB (weights + Adam slots), median of {args.rounds} rounds; "
        "ratios: the .npy O_DIRECT writer over orbax's tensorstore writer",
        _rows(args, result, median, measured["window"]), "tensorstore writer"))
    print("fit() times per round: " + ", ".join(
        f"{k} {[round(t, 1) for t in v]}" for k, v in measured["runs"].items()))
    result.update(checkpoint_checksums.report(measured["costs"], result["state_mb"]))
    _write_json(args.json, result)


def _ratio(new: float, old: float) -> float | None:
    return new / old if old > 0 else None


def _write_json(path: str | None, result: dict) -> None:
    """Writes ``result`` to ``path`` (its directory made), when a path is given."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def _checksums_only(args) -> None:
    workdir = tempfile.mkdtemp(prefix="ckpt_bench_")
    try:
        trainer = _trainer(args, workdir)
        _fit(trainer, 2 * args.interval, 0, True)  # warm-up: trace, build, first save
        state_mb = sum(v.numpy().nbytes for v in trainer.model.variables
                       + trainer.optimizer.variables) / 2**20
        costs = checkpoint_checksums.cost(trainer, args.rounds, _fit)
        result = checkpoint_checksums.report(costs, state_mb)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    _write_json(args.json, result)


if __name__ == "__main__":
    main()
