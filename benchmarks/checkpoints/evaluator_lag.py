"""How far the continuous evaluator trails the trainer in a local 2-worker group.

    python -m benchmarks.checkpoints.evaluator_lag [--steps 600] [--every 50] [--workdir /tmp/lag]

Runs ``python -m launch.multiworker --workers 2 --evaluator`` on the digits config at
full speed (checkpoints every ``--every`` steps, all kept), then reads the two streams:
for each checkpoint the evaluator evaluated, the chief's step when the result was
recorded (its last log window before that moment, ``workdir/metrics.jsonl``) minus the
checkpoint's step, and the seconds from the checkpoint's commit (its directory's mtime)
to the result. Also the checkpoints it skipped (superseded while it was busy).
Numbers, not a test: they depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common.table import Row, format_table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="evaluator_lag-")
    command = [sys.executable, "-m", "launch.multiworker", "--workers", "2", "--evaluator",
               f"--config={REPO}/models/configs/digits.py", f"--workdir={workdir}",
               f"--config.train.steps={args.steps}", "--config.train.steps_per_loop=10",
               "--config.train.log_every_steps=10", "--config.eval.every_steps=0",
               f"--config.checkpoint.every_steps={args.every}",
               f"--config.checkpoint.max_to_keep={args.steps // args.every + 1}"]
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    if done.returncode:
        print(f"the group failed (exit {done.returncode}); see {workdir}", file=sys.stderr)
        return 1
    train = [r for r in _records(os.path.join(workdir, "metrics.jsonl"))
             if r["kind"] == "train"]
    evaluated = _records(os.path.join(workdir, "eval", "metrics.jsonl"))
    committed = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")))
    lags, rows = [], []
    for record in evaluated:
        chief = max([r["step"] for r in train if r["time"] <= record["time"]], default=0)
        mtime = os.stat(os.path.join(workdir, "checkpoints", str(record["step"]))).st_mtime
        lags.append(chief - record["step"])
        rows.append(Row(f"checkpoint {record['step']}: commit -> result", record["time"] - mtime,
                        "s", note=f"lag {lags[-1]} steps (the chief at step {chief})"))
    skipped = sorted(set(committed) - {r["step"] for r in evaluated})
    if lags:
        rows.append(Row("lag", statistics.median(lags), "steps", spread=(min(lags), max(lags)),
                        note=f"evaluated {len(evaluated)} of {len(committed)} checkpoints; "
                             f"skipped {skipped or 'none'}"))
    print(format_table(f"evaluator_lag: {args.steps} steps, a checkpoint every {args.every}; "
                       f"workdir {workdir}", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
