"""Device check: one command that proves the framework's accelerator paths, in a budget.

    python -m benchmarks.device.device_check [--budget_s 480] [--out check.json] [--dry]
                                             [--checks devices,virtual,...]

Runs every check of :mod:`benchmarks.common.device_checks` (devices, memory growth and the
allocator; one GPU as 2 virtual GPUs under MirroredStrategy; float32 / mixed_float16 /
mixed_bfloat16; XLA off / on / the execution plan's choice; MFU and the doctor's
verdict; a checkpoint from device memory; the framework against the hand-written loop
on the transformer and the CNN; the TPU section) on the accelerator it finds, and
prints one table: ``check | status | figure | unit | detail`` (status ``ok``, ``FAIL``
or ``skipped``; a skipped row's detail starts with why: ``no GPU: would prove ...``,
``no TPU: ...``, ``budget: ...``). ``--out`` writes the same rows as JSON. Exit status
0 only when no row FAILed (and at least one ran).

Time: ``--budget_s`` (default 480 s, TensorFlow's start-ups included) is kept. Each
check runs in a process of its own (devices are configured before TensorFlow starts,
and a hang costs only that check): its timeout is its share of the budget that is left
(by weight, :data:`WEIGHTS`; at least the check's minimum), a check whose minimum no
longer fits in what is left is ``skipped`` (``budget: ...``), and a check that overruns
its timeout is killed and FAILs (``timeout: ...``).

Dry mode (``--dry``, or no GPU found): every check runs at a tiny size on the CPU (2
virtual CPU devices where it needs two), GPUs hidden; speed figures are reported, not
judged; the rows that need a GPU are ``skipped`` and say what they would prove. The
``tpu`` check runs where :func:`tf_cluster.tpu.tpu_attached` finds a TPU (not with
``--dry``), and says "no TPU" elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tf_cluster.tpu import tpu_attached

REPO = Path(__file__).resolve().parents[2]
MARK = "%%DEVICE_CHECK%%"
#: name -> (share of the budget, least seconds worth starting, dry; the same, full size).
WEIGHTS = {
    "devices": ((1, 10), (1, 20)),
    "virtual": ((2, 25), (2, 40)),
    "precision": ((2, 25), (3, 60)),
    "speed_transformer": ((3, 40), (5, 90)),
    "speed_cnn": ((3, 40), (3, 60)),
    "mfu": ((2, 25), (2, 45)),
    "checkpoint": ((1, 15), (1, 30)),
    "tpu": ((3, 60), (3, 60)),  # TPU start-up is slow, and a TPU VM runs the rest dry
}
WHY = {  # what each check of device_checks.CHECKS would prove (said when it is skipped)
    "devices": "the GPUs, their memory and compute capability, memory growth and the allocator",
    "virtual": "1 vs 2 replicas on one GPU split in two train to the same float32 weights, "
               "and the all-reduce crosses devices",
    "precision": "float32 / mixed_float16 / mixed_bfloat16 speed, and their final losses "
                 "within bounds of float32's",
    "speed_transformer": "XLA off / on / the plan's choice, and the framework vs the "
                         "hand-written loop",
    "speed_cnn": "the framework vs the hand-written loop on the CNN",
    "mfu": "MFU against the datasheet peak and the doctor's verdict",
    "checkpoint": "a checkpoint from device memory saved, verified and restored bit for bit",
    "tpu": "TPUStrategy, bfloat16, steps per loop and the notebook path on a TPU",
}
COLUMNS = ("check", "status", "figure", "unit", "detail")


def _row(check: str, status: str, detail: str) -> dict:
    return {"check": check, "status": status, "figure": None, "unit": "", "detail": detail}


def _tail(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "no output")[:240]


def run_child(name: str, dry: bool, timeout_s: float) -> list[dict]:
    """The check ``name`` in a fresh process, killed (with its children) after
    ``timeout_s``; its rows, or one FAIL row saying what happened."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""  # a dry run on a GPU machine stays on the CPU
    cmd = [sys.executable, "-m", "benchmarks.device.device_check", "--child", name] + (
        ["--dry"] if dry else [])
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return [_row(name, "FAIL", f"timeout: no result in its {timeout_s:.0f} s "
                                   f"(killed; a hang costs only this check)")]
    if MARK in out:
        return json.loads(out.split(MARK)[-1])
    return [_row(name, "FAIL", f"exit {proc.returncode}: {_tail(err)}")]


def plan(names: list[str], budget_s: float, dry: bool, tpu: bool,
         run=run_child, clock=time.monotonic) -> list[dict]:
    """Runs ``names`` in order within ``budget_s``. Each gets its weight's share of the
    seconds left, at least its minimum (:data:`WEIGHTS`), as the timeout of
    ``run(name, dry, timeout_s)``; one whose minimum no longer fits in what is left is
    skipped ("budget: ..."); ``tpu`` without a TPU is skipped ("no TPU: ...")."""
    deadline = clock() + budget_s
    rows: list[dict] = []
    for i, name in enumerate(names):
        if name == "tpu" and not tpu:
            rows.append(_row("tpu", "skipped", f"no TPU: would prove {WHY['tpu']} "
                                               f"(tf_cluster.tpu found none)"))
            continue
        weights = {n: WEIGHTS[n][0 if dry else 1] for n in names[i:] if n != "tpu" or tpu}
        left = deadline - clock()
        weight, minimum = weights[name]
        if left < minimum:
            rows.append(_row(name, "skipped", f"budget: {max(left, 0):.0f} s left, it needs "
                                              f"{minimum} s; would prove {WHY[name]}"))
            continue
        share = left * weight / sum(w for w, _ in weights.values())
        rows.extend(run(name, dry, min(left, max(share, minimum))))
    return rows


def format_table(rows: list[dict]) -> str:
    """A Markdown table of the rows (pastes into benchmarks/README.md as it is)."""
    def figure(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, (int, float)) and abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}"

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += [f"| {r['check']} | {r['status']} | {figure(r['figure'])} | {r['unit'] or '-'} | "
              f"{r['detail'].replace('|', '/')} |" for r in rows]
    return "\n".join(lines)


def accelerator_present() -> tuple[bool, bool]:
    """``(gpu, tpu)`` without loading TensorFlow: an NVIDIA device node, a TPU
    (:func:`tf_cluster.tpu.tpu_attached`)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu = any(Path("/dev").glob("nvidia[0-9]*")) and visible not in ("", "-1")
    return gpu, tpu_attached()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget_s", type=float, default=480.0,
                        help="seconds for the whole check, TensorFlow start-ups included")
    parser.add_argument("--out", help="also write the rows as JSON here")
    parser.add_argument("--dry", action="store_true",
                        help="tiny sizes on the CPU (the default when no GPU is found)")
    parser.add_argument("--checks", default=",".join(WEIGHTS),
                        help=f"comma-separated subset of {','.join(WEIGHTS)}")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one check in this fresh process; the parent stays TensorFlow-free
        from benchmarks.common import device_checks

        rows = device_checks.run_check(args.child, args.dry)
        print(MARK + json.dumps(rows), flush=True)
        return 0
    names = args.checks.split(",")
    unknown = sorted(set(names) - set(WEIGHTS))
    if unknown:
        parser.error(f"--checks: unknown {unknown}; choose from {','.join(WEIGHTS)}")
    start = time.monotonic()
    gpu, tpu = accelerator_present()
    dry, tpu = args.dry or not gpu, tpu and not args.dry
    rows = plan(names, args.budget_s, dry, tpu)
    elapsed = time.monotonic() - start
    failed = [r["check"] for r in rows if r["status"] == "FAIL"]
    holds = not failed and any(r["status"] == "ok" for r in rows)
    mode = ("dry (CPU, tiny sizes)" if dry else "GPU") + ("; TPU found" if tpu else "")
    print(f"device check: {mode}; {elapsed:.0f} s of a {args.budget_s:g} s budget")
    print(format_table(rows))
    print("all checks hold" if holds else
          f"FAILED: {', '.join(failed)}" if failed else "nothing ran")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "mode": "dry" if dry else "gpu", "tpu": tpu, "budget_s": args.budget_s,
            "elapsed_s": elapsed, "ok": holds, "columns": COLUMNS, "rows": rows}, indent=2))
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
