"""The notebook pattern: several digits Trainers built and fitted one after another in
ONE Python process, against a fresh process's fit.

    python -m benchmarks.overhead.notebook_pattern [--trainers 4] [--steps 1000] [--runs 1]

Each run starts one child process that builds and fits ``--trainers`` digits Trainers
(default config, a fresh workdir each; the cell of a notebook run again) and a fresh
child that fits one. Per fit: seconds of ``fit()``; the longest garbage-collection
pause in the process (``gc.callbacks``); the process's thread count after the fit; the
seconds from the child's last line to its exit (interpreter teardown); whether its
stderr has TensorFlow's "triggered tf.function retracing" warning. Numbers, not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.common.table import Row, format_table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child(trainers: int, steps: int) -> None:
    """Fits ``trainers`` digits Trainers in this process; one JSON line per fit, then
    a ``done`` line (the parent times the exit from it)."""
    from models.configs import digits
    from trainer import trainer as trainer_lib

    pauses: list[float] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    gc.callbacks.append(on_gc)
    for i in range(trainers):
        config = digits.get_config()
        config.train.steps = steps
        pauses.clear()
        start = time.perf_counter()
        t = trainer_lib.resolve_trainer_class(config.trainer)(
            config, tempfile.mkdtemp(prefix="notebook_pattern-"))
        results = t.fit()
        close = getattr(t, "close", None)
        if close is not None:
            close()
        seconds = time.perf_counter() - start
        print(json.dumps({"fit": i, "seconds": seconds, "gc_max_s": max(pauses, default=0.0),
                          "threads": threading.active_count(),
                          "keys": sorted(results)}), flush=True)
    print("done", flush=True)


def run_child(trainers: int, steps: int) -> dict:
    """Runs one child; returns its fits, exit seconds and retracing warnings."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    env.setdefault("TFDS_DATA_DIR", os.path.join(tempfile.gettempdir(), "notebook_pattern_tfds"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.overhead.notebook_pattern", "--child", str(trainers),
         "--steps", str(steps)], cwd=REPO, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    fits, done_at = [], None
    for line in proc.stdout:
        if line.startswith("{"):
            fits.append(json.loads(line))
        elif line.strip() == "done":
            done_at = time.perf_counter()
    err = proc.stderr.read()
    proc.wait()
    ended = time.perf_counter()
    return {"fits": fits, "exit_s": ended - done_at if done_at else float("nan"),
            "retracing": err.count("triggered tf.function retracing"),
            "returncode": proc.returncode}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trainers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps)
        return 0
    run_child(1, 10)  # prepares the digits TFDS files once, outside the timing
    rows = []
    for run in range(args.runs):
        fresh = run_child(1, args.steps)
        many = run_child(args.trainers, args.steps)
        base = fresh["fits"][0]["seconds"]
        rows += [Row(f"run {run}: fresh process fit", base, "s", 1.0,
                     note=f"gc max {fresh['fits'][0]['gc_max_s']:.2f} s"),
                 Row(f"run {run}: fresh process exit", fresh["exit_s"], "s",
                     note=f"retracing warnings {fresh['retracing']}")]
        rows += [Row(f"run {run}: trainer {fit['fit'] + 1}/{args.trainers} fit", fit["seconds"],
                     "s", fit["seconds"] / base,
                     note=f"gc max {fit['gc_max_s']:.2f} s, threads {fit['threads']}")
                 for fit in many["fits"]]
        rows.append(Row(f"run {run}: {args.trainers} trainers exit", many["exit_s"], "s",
                        note=f"retracing warnings {many['retracing']}, exit code "
                             f"{many['returncode']}"))
    print(format_table(f"notebook_pattern: {args.trainers} digits Trainers of {args.steps} steps "
                       "in one process against a fresh process's one", rows, "fresh fit"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
