"""Checkpoints in a bucket (gs://) over a slow link: what async saves cost training, the
restore time, and the preemption save against a 30 s grace period.

    sudo python -m benchmarks.bucket_checkpoint [--rounds 5] [--latency_ms 20] [--rate_mbit 200]
                                               [--interval_s 6] [--json PATH]

Needs root: it makes simulated hosts of its own (network namespaces ``tfbench-*`` on
10.213.11.0/24, apart from the tests' cluster) with the tests' GCS emulator on the head
node (``tests/cluster/gcs.py``), and shapes the link between the host and the emulator:
``--rate_mbit`` each way with a token bucket (``tc tbf``) on both ends of the head's
link, and ``--latency_ms`` added by the emulator before each answer (one round trip per
request: this machine's kernel has no ``sch_netem``, "Specified qdisc kind is unknown").
The cluster is taken down at the end.

On host h0, in ONE process (the ``transformer`` workload of ``benchmarks/workloads.py``,
Adam, one device, workdir ``gs://BUCKET/bench/...``):

1. Training cost of async saves: each round runs, in rotating order, ``fit()`` over
   ``INTERVALS`` save intervals of about ``--interval_s`` seconds of training with an
   async save to the bucket every interval, and the same ``fit()`` with no save
   (``checkpoint.every_steps=0``). The training span (``on_fit_start`` to
   ``on_train_end``, so the fit's last save, the same in both, is left out) gives
   examples/s; the ratio of the two in one round is paired, its median over rounds is
   the result (the issue's target: >= 0.95).
2. Restore: ``Trainer.restore()`` of the newest step from the bucket, median seconds
   (checksums verified, as a resume does).

Then, on the same host, ``python -m trainer.main`` of the digits and the transformer LM
(``models/configs/digits.py``, ``models/configs/lm.py``) with ``--workdir=gs://...``:
SIGTERM after the first progress line, the seconds until it exits 143 with its
checkpoint committed in the bucket (a scheduler's grace period is often 30 s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

INTERVALS = 3  # save intervals per timed fit
CLUSTER = {"hosts": 1, "name": "tfbench", "subnet": "10.213.11"}
CLUSTER_DIR = Path("/tmp/tfbench-cluster")
PREEMPTED_MODELS = {"digits": "models/configs/digits.py", "transformer_lm": "models/configs/lm.py"}
GRACE_S = 30.0


# ------------------------------------------------------------------ on the host (child)
class _Span:
    """A callback timing the training part of a fit (no final save)."""

    def __init__(self):
        self.start = self.end = 0.0

    def __call__(self):
        from trainer.callbacks import Callback

        span = self

        class Span(Callback):
            def on_fit_start(self, trainer):
                span.start = time.perf_counter()

            def on_train_end(self, trainer):
                span.end = time.perf_counter()

        return Span()


def _fit(trainer, span: _Span, steps: int, every: int) -> float:
    """Examples/s of the training span of ``fit()`` over ``steps`` more steps."""
    trainer.config.train.steps = trainer.step + steps
    trainer.config.checkpoint.every_steps = every
    trainer.fit()
    return steps * trainer.config.train.global_batch_size / (span.end - span.start)


def child(args) -> dict:
    from benchmarks import workloads

    root = f"gs://{args.bucket}/bench/{int(time.time())}"
    span = _Span()
    workload = workloads.WORKLOADS["transformer"]
    trainer = workloads.framework_trainer(
        workload, 10, workdir=f"{root}/run", callbacks=[span()],
        **{"checkpoint.async_save": True, "checkpoint.max_to_keep": 2,
           "telemetry.probe_every_windows": 0, "distribute.strategy": "one_device"})
    _fit(trainer, span, 20, 0)  # warm-up: traces the loop, writes the first checkpoint
    per_step = 1.0 / (_fit(trainer, span, 50, 0) / workload.batch_size)
    interval = max(10, round(args.interval_s / per_step / 10) * 10)
    arms = {"bucket_async": interval, "none": 0}
    speeds: dict[str, list[float]] = {arm: [] for arm in arms}
    for round_ in range(args.rounds):
        order = list(arms) if round_ % 2 == 0 else list(arms)[::-1]
        for arm in order:
            speeds[arm].append(_fit(trainer, span, INTERVALS * interval, arms[arm]))
        print(f"round {round_ + 1}/{args.rounds}: "
              + ", ".join(f"{a} {speeds[a][-1]:,.0f} ex/s" for a in arms), flush=True)
    restores = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        trainer.restore()
        restores.append(time.perf_counter() - start)
    trainer.close()
    return {"interval_steps": interval, "step_ms": per_step * 1e3, "speeds": speeds,
            "ratios": [a / b for a, b in zip(speeds["bucket_async"], speeds["none"])],
            "restore_s": restores}


def preempted(args, model: str, config: str) -> dict:
    """Seconds from SIGTERM (after the first progress line) to exit 143."""
    workdir = f"gs://{args.bucket}/bench/{int(time.time())}-{model}"
    proc = subprocess.Popen([sys.executable, "-m", "trainer.main", f"--config={config}",
                             f"--workdir={workdir}", "--config.train.steps=100000",
                             "--config.train.log_every_steps=50"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if re.match(r"step \d+/", line):
            break
    else:
        raise RuntimeError(f"{model}: no progress line; exit {proc.wait()}")
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    tail = proc.stdout.read()
    code, seconds = proc.wait(), time.perf_counter() - start
    saved = re.search(r"checkpoint of step (\d+)", tail)
    if code != 143 or not saved:
        raise RuntimeError(f"{model}: exit {code}, no preemption checkpoint:\n{tail[-2000:]}")
    return {"seconds": seconds, "step": int(saved.group(1))}


def child_main(args) -> None:
    results = {"training": child(args)}
    results["preemption"] = {m: preempted(args, m, c) for m, c in PREEMPTED_MODELS.items()}
    print("RESULTS " + json.dumps(results), flush=True)


# ------------------------------------------------------------------ as root (parent)
def _shape(cluster, rate_mbit: float) -> None:
    """Limits both directions of the head's link (gone with the cluster's links)."""
    tbf = ["tbf", "rate", f"{rate_mbit}mbit", "burst", "256kb", "latency", "500ms"]
    outside = f"{CLUSTER['name']}-vhd"  # the bridge port of the head's veth
    subprocess.run(["tc", "qdisc", "replace", "dev", outside, "root", *tbf], check=True)
    subprocess.run(cluster.wrap(cluster.head, ["tc", "qdisc", "replace", "dev", "eth0",
                                               "root", *tbf]), env=cluster.env(), check=True)


def parent(args) -> dict:
    from tests.cluster.gcs import BUCKET, GcsEmulator
    from tests.cluster.hosts import SimulatedCluster
    from tests.support.helpers import subprocess_env

    cluster = SimulatedCluster(root=CLUSTER_DIR, **CLUSTER)
    cluster.up()
    try:
        emulator = GcsEmulator(cluster, latency_ms=args.latency_ms)
        emulator.start()
        _shape(cluster, args.rate_mbit)
        env = cluster.env({**emulator.client_env(),
                           "PYTHONPATH": subprocess_env()["PYTHONPATH"]})
        argv = [sys.executable, "-m", "benchmarks.bucket_checkpoint", "--child",
                "--bucket", BUCKET, "--rounds", str(args.rounds),
                "--interval_s", str(args.interval_s)]
        proc = subprocess.Popen(cluster.wrap(cluster.hosts[0], argv), env=env,
                                cwd=Path(__file__).resolve().parent.parent,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        results = None
        for line in proc.stdout:
            if line.startswith("RESULTS "):
                results = json.loads(line[len("RESULTS "):])
            elif line.startswith("round ") or "Error" in line:
                print("  " + line.rstrip(), flush=True)
        if proc.wait() != 0 or results is None:
            raise SystemExit(f"the benchmark on {cluster.hosts[0].name} failed (exit "
                             f"{proc.returncode})")
        return results
    finally:
        cluster.down()


def _spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return (f"{fmt.format(statistics.median(values))} "
            f"[{fmt.format(min(values))}..{fmt.format(max(values))}]")


def report(args, results: dict) -> None:
    training = results["training"]
    print(f"\nlink: {args.rate_mbit:g} Mbit/s each way, +{args.latency_ms:g} ms per request; "
          f"transformer workload, step {training['step_ms']:.1f} ms, an async save every "
          f"{training['interval_steps']} steps (~{args.interval_s:g} s), {args.rounds} rounds")
    for arm, speeds in training["speeds"].items():
        print(f"  {arm:<13} {_spread(speeds, '{:,.0f}')} ex/s")
    print(f"  ratio bucket_async / none (paired per round): {_spread(training['ratios'])}"
          f"  (target >= 0.95)")
    print(f"  restore from the bucket: {_spread(training['restore_s'], '{:.2f}')} s")
    for model, result in results["preemption"].items():
        print(f"  preemption, {model}: SIGTERM -> checkpoint of step {result['step']} in "
              f"the bucket -> exit 143 in {result['seconds']:.1f} s (grace {GRACE_S:g} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--latency_ms", type=float, default=20.0)
    parser.add_argument("--rate_mbit", type=float, default=200.0)
    parser.add_argument("--interval_s", type=float, default=6.0,
                        help="seconds of training between two saves")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bucket", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return
    if os.geteuid() != 0:
        raise SystemExit("benchmarks.bucket_checkpoint makes network namespaces: run it as root")
    results = parent(args)
    report(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **results}, indent=2))


if __name__ == "__main__":
    main()
