"""Hyperparameter sweeps: what the median pruner saves on a seeded digits sweep, and the
sweep's own cost per trial against the same runs typed by hand.

    python -m benchmarks.overhead.sweep [--trials 16] [--steps 1000] [--eval_every 100] \
        [--seed 0] [--by_hand 4] [--rounds 2]

1. The digits sweep (``models/configs/digits_sweep.py``: learning rate, width, batch
   size) of ``--trials`` trials, one at a time, with ``--config.sweep.seed=SEED``, run
   twice: without a pruner and with the median pruner (its defaults: 5 trials complete
   first), both evaluating every ``--eval_every`` steps. Per sweep: the steps its trials
   trained, their sum against the unpruned sweep's (1 - ratio: the fraction saved), the
   best ``eval/accuracy``, the trials pruned and the wall time.
2. Per round (``--rounds``), a sweep of ``--by_hand`` trials without a pruner and its
   trials' printed commands run by hand, one after another, in fresh workdirs (in
   alternating order: the sweep first in even rounds): the sweep's wall time (its
   start, its study, its status table) against theirs, and the difference per trial.
   Numbers, not a test.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time

from benchmarks.common.table import Row, format_table, from_rounds

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "models", "configs", "digits_sweep.py")


def env() -> dict:
    return dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")


def run_sweep(root: str, trials: int, flags: list[str]) -> float:
    """Runs a sweep to its end in ``root``; returns its wall seconds."""
    begin = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "trainer.sweep", f"--config={CONFIG}",
                          f"--workdir={root}", f"--trials={trials}", *flags], cwd=REPO,
                         env=env(), capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"the sweep in {root} failed: {run.stderr.strip().splitlines()[-1]}")
    return time.perf_counter() - begin


def trials_of(root: str) -> list:
    """The study's trials (Optuna's FrozenTrial)."""
    from trainer.sweep import study as study_lib

    storage = study_lib.open_storage(study_lib.default_storage(root))
    return study_lib.Study.load(storage, study_lib.default_name(root)).trials()


def pruning_rows(args: argparse.Namespace, scratch: str) -> list[Row]:
    flags = [f"--config.train.steps={args.steps}", f"--config.eval.every_steps={args.eval_every}",
             f"--config.sweep.seed={args.seed}", "--config.train.log_every_steps=500"]
    rows, base = [], None
    for pruner in ("none", "median"):
        root = os.path.join(scratch, f"pruner_{pruner}")
        seconds = run_sweep(root, args.trials, [*flags, f"--config.sweep.pruner={pruner}"])
        trials = trials_of(root)
        steps = sum(int(t.user_attrs.get("step") or 0) for t in trials)
        complete = [t.value for t in trials if t.state.name == "COMPLETE"]
        pruned = sum(t.state.name == "PRUNED" for t in trials)
        base = base or (steps, seconds)
        rows += [Row(f"{pruner}: steps trained", steps, "steps", steps / base[0],
                     note=f"{pruned} of {len(trials)} trials pruned; steps saved "
                          f"{1 - steps / base[0]:.0%}"),
                 Row(f"{pruner}: best eval/accuracy", max(complete), "acc",
                     note="of the COMPLETE trials"),
                 Row(f"{pruner}: wall time", seconds, "s", seconds / base[1])]
    return rows


def by_hand(root: str, scratch: str) -> float:
    """Runs each trial's printed command of the sweep in ``root`` by hand, one after
    another, in fresh workdirs; returns their wall seconds."""
    seconds = 0.0
    for trial in trials_of(root):
        argv = [a if not a.startswith("--workdir=") else
                f"--workdir={os.path.join(scratch, str(trial.number))}"
                for a in shlex.split(trial.user_attrs["command"])]
        begin = time.perf_counter()
        subprocess.run(argv, cwd=REPO, env=env(), capture_output=True, check=True)
        seconds += time.perf_counter() - begin
    return seconds


def overhead_rows(args: argparse.Namespace, scratch: str) -> list[Row]:
    """Per round, a new sweep of ``--by_hand`` trials and its commands by hand, in
    alternating order (the sweep samples the same values: its seed)."""
    swept, hand = [], []
    for i in range(args.rounds):
        root = os.path.join(scratch, f"overhead_{i}")
        flags = [f"--config.train.steps={args.steps}"]
        if i % 2:  # by hand first: round 0's commands (the same values: the same seed)
            hand.append(by_hand(os.path.join(scratch, "overhead_0"), os.path.join(root, "hand")))
            swept.append(run_sweep(root, args.by_hand, flags))
        else:
            swept.append(run_sweep(root, args.by_hand, flags))
            hand.append(by_hand(root, os.path.join(root, "hand")))
    per_trial = [(s - h) / args.by_hand for s, h in zip(swept, hand)]
    return [from_rounds(f"{args.by_hand} runs by hand", hand, "s", hand),
            from_rounds(f"the same {args.by_hand} as a sweep", swept, "s", hand),
            from_rounds("the sweep's overhead per trial", per_trial, "s",
                        note="(sweep - by hand) / trials, per round")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--eval_every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--by_hand", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="of the overhead's runs")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="sweep_benchmark-")
    rows = pruning_rows(args, scratch)
    print(format_table(f"sweep: {args.trials} digits trials of {args.steps} steps, seed "
                       f"{args.seed}, an evaluation every {args.eval_every} steps; without "
                       f"and with the median pruner", rows, "none"), flush=True)
    print(format_table(f"sweep: its overhead, {args.by_hand} trials of {args.steps} steps "
                       f"against the same commands by hand", overhead_rows(args, scratch),
                       "by hand"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
