"""Compressed gradient all-reduce (``distribute.grad_compression``): its effect on where
the default example job ends, on 2 Mirrored replicas over virtual CPU devices.

    python -m benchmarks.parallel.grad_compression [--steps 1000] [--json out.json]

The digits job exactly as ``models/configs/digits.py`` sets it (the README's quickstart:
MLP 64->128->10, Adam 3e-3, global batch 64, eval every 500 steps) with
``distribute.strategy="mirrored"``, ``distribute.virtual_devices=2``, ``perf.plan="fixed"``
(every run the same plan), trained for ``--steps`` steps from the same seed (the same
initial weights and batches) in one process per variant:

  none                      float32, the exact float32 all-reduce (the reference)
  none (repeat)             the same again: the run-to-run noise floor of max|dw|
  bf16                      float32, gradients all-reduced in bfloat16
  none+mixed_float16        mixed_float16 (dynamic loss scaling), exact all-reduce: the
                            reference of fp16 (fp16 needs mixed_float16); against none,
                            how far the precision policy alone moves the weights
  fp16+mixed_float16        mixed_float16, gradients all-reduced in float16

Printed per variant: the final train loss (fit()'s ``train/loss``: the mean of the last
logging window), the final eval loss and accuracy (the test split), max|w - w_ref| over
every weight against its reference run (``ref``) and the same relative to the largest
|w|, skipped steps and the final loss scale, and the seconds of the fit. Numbers about
the result of training, not a timing benchmark: the 2 replicas share one CPU here, where
there is no link for 16-bit sums to save time on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import table
from benchmarks.common.table import Row

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = {  # name: (precision.policy, distribute.grad_compression, reference variant)
    "none": ("float32", "none", ""),
    "none (repeat)": ("float32", "none", "none"),
    "bf16": ("float32", "bf16", "none"),
    "none+mixed_float16": ("mixed_float16", "none", "none"),
    "fp16+mixed_float16": ("mixed_float16", "fp16", "none+mixed_float16"),
}


def child(variant: str, steps: int, out: str) -> None:
    """Trains ``variant``; saves its weights to ``out`` (.npz) and prints one JSON line."""
    import numpy as np

    from models.configs import digits
    from trainer import trainer as trainer_lib

    policy, compression, _ = VARIANTS[variant]
    config = digits.get_config()
    config.update_from_flattened_dict({
        "train.steps": steps, "distribute.strategy": "mirrored",
        "distribute.virtual_devices": 2, "perf.plan": "fixed",
        "precision.policy": policy, "distribute.grad_compression": compression})
    t = trainer_lib.resolve_trainer_class(config.trainer)(config)
    start = time.perf_counter()
    results = t.fit()
    seconds = time.perf_counter() - start
    skipped, scale = t.precision.counters()
    np.savez(out, *t.model.get_weights())
    print(json.dumps({"train_loss": results["train/loss"], "eval_loss": results["eval/loss"],
                      "eval_accuracy": results["eval/accuracy"], "skipped": skipped,
                      "loss_scale": scale, "seconds": seconds}), flush=True)


def run_variant(variant: str, steps: int, out: str) -> dict:
    """One variant in a fresh process (2 logical CPUs, set before TensorFlow starts)."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.parallel.grad_compression", "--child",
                           variant, "--steps", str(steps), "--out", out], cwd=REPO, env=env,
                          text=True, capture_output=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"variant": variant, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return {"variant": variant, **json.loads(lines[-1])}


def weight_diffs(rows: list[dict], files: dict[str, str]) -> None:
    """Adds ``max_dw`` (max |w - w_ref|) and ``rel_dw`` (that / max |w_ref|) to each row."""
    import numpy as np

    def load(variant):
        with np.load(files[variant]) as f:
            return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]

    for row in rows:
        ref = VARIANTS[row["variant"]][2]
        row["ref"] = ref or "-"
        if not ref or "error" in row or any("error" in r for r in rows if r["variant"] == ref):
            continue
        mine, theirs = load(row["variant"]), load(ref)
        row["max_dw"] = max(float(np.max(np.abs(a - b))) for a, b in zip(mine, theirs))
        row["rel_dw"] = row["max_dw"] / max(float(np.max(np.abs(b))) for b in theirs)


def format_table(title: str, rows: list[dict]) -> str:
    """One row per variant: how far its weights ended from its reference run's (max
    |w - w_ref|), what it ended with in the note (not a timing: no ratios)."""
    def row(r: dict) -> Row:
        if "error" in r:
            return Row(r["variant"], None, "max|w-w_ref|", note=f"failed: {r['error'][:100]}")
        ends = (f"train loss {r['train_loss']:.5f}, eval loss {r['eval_loss']:.5f}, eval acc "
                f"{r['eval_accuracy']:.4f}; skipped {r['skipped']}, loss scale "
                f"{r['loss_scale']:g}; fit {r['seconds']:.1f} s")
        if "max_dw" not in r:
            return Row(r["variant"], None, "max|w-w_ref|", note=f"the reference; {ends}")
        return Row(r["variant"], r["max_dw"], "max|w-w_ref|",
                   note=f"ref {r['ref']}, {r['rel_dw']:.2g} of its max|w|; {ends}")
    return table.format_table(title, [row(r) for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.out)
        return
    # The digits are prepared into the TFDS data directory by the first run; one variant
    # after another, so no two runs prepare it at once.
    tmp = tempfile.mkdtemp(prefix="grad_compression-")
    files = {v: os.path.join(tmp, f"{i}.npz") for i, v in enumerate(VARIANTS)}
    rows = []
    for variant in VARIANTS:
        rows.append(run_variant(variant, args.steps, files[variant]))
        print(f"{variant} done", file=sys.stderr, flush=True)
    weight_diffs(rows, files)
    print(format_table(f"grad_compression: digits job, 2 Mirrored replicas (virtual CPU "
                       f"devices), {args.steps} steps, seed 0", rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
