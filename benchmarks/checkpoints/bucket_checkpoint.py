"""Checkpoints in a bucket (gs://) over a slow link: what a save, a stop's save and a
restore cost in requests and round trips, what async saves cost training, the restore
time, and the preemption save against a 30 s grace period.

    sudo python -m benchmarks.checkpoints.bucket_checkpoint [--rounds 5] [--latency_ms 20]
        [--rate_mbit 200] [--interval_s 6] [--json PATH]
    sudo python -m benchmarks.checkpoints.bucket_checkpoint --requests
        [--latencies 50,150,300] [--code DIR]

``--requests``: the request bill, from the emulator's request log
(:mod:`tests.cluster.gcs_requests`: requests by phase, and rounds, the sequential round
trips), at each of ``--latencies`` ms per request (changed while the emulator runs):
the digits command with ``--workdir=gs://...`` (loops of 10 steps, a save every 50),
SIGTERM once its step-100 line is out, then a new process resuming from the bucket for
50 more steps. Rows: the periodic save of step 50 (its objects' requests), the stop
(SIGTERM to the stop's commit marker: every request of the run in that window; and
SIGTERM to exit 143, seconds), the restore (the resuming run's checkpoint requests
before its first upload) and its process start to first progress line (seconds), and
the cadence: a 1,000-step digits run with a save due every 50 steps, saves written and
skipped (a save due while the previous one is still being written waits 10 s, then is
skipped).
``--code DIR``: run that checkout of the framework instead (e.g. a ``git worktree`` of
an earlier commit, for a before / after table).

Needs root: it makes simulated hosts of its own (network namespaces ``tfbench-*`` on
10.213.11.0/24, apart from the tests' cluster) with the tests' GCS emulator on the head
node (``tests/cluster/gcs.py``), and shapes the link between the host and the emulator:
``--rate_mbit`` each way with a token bucket (``tc tbf``) on both ends of the head's
link, and ``--latency_ms`` added by the emulator before each answer (one round trip per
request: this machine's kernel has no ``sch_netem``, "Specified qdisc kind is unknown").
The cluster is taken down at the end.

On host h0, in ONE process (the ``transformer`` workload of
``benchmarks/common/workloads.py``, Adam, one device, workdir ``gs://BUCKET/bench/...``):

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
    from benchmarks.common import workloads

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
        argv = [sys.executable, "-m", "benchmarks.checkpoints.bucket_checkpoint", "--child",
                "--bucket", BUCKET, "--rounds", str(args.rounds),
                "--interval_s", str(args.interval_s)]
        proc = subprocess.Popen(cluster.wrap(cluster.hosts[0], argv), env=env,
                                cwd=Path(__file__).resolve().parents[2],
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


# ------------------------------------------------------------------ request bills (--requests)
REQUEST_FLAGS = ("--config.train.steps_per_loop=10", "--config.train.log_every_steps=50",
                 "--config.checkpoint.every_steps=50", "--config.eval.every_steps=0",
                 "--config.telemetry.probe_every_windows=0")


def _bill_at(cluster, emulator, latency_ms: float, code: str | None) -> list[dict]:
    """The request bill rows of one latency (see the module docstring)."""
    from tests.cluster import gcs_requests
    from tests.cluster.gcs import BUCKET
    from tests.cluster.hosts import Watched

    def start(cluster, emulator, host, argv, env):  # in --code's checkout when given
        return Watched(cluster.popen(host, argv, env={**emulator.client_env(), **env},
                                     cwd=code or None))

    prefix = f"bill-{int(latency_ms)}-{int(time.time())}"
    directory, url = f"{prefix}/checkpoints", f"gs://{BUCKET}/{prefix}"
    env = {"PYTHONPATH": code} if code else {}
    argv = [sys.executable, "-m", "trainer.main", f"--config={PREEMPTED_MODELS['digits']}",
            f"--workdir={url}", *REQUEST_FLAGS]
    emulator.set_latency(latency_ms)
    try:
        logged = len(emulator.requests())
        proc = start(cluster, emulator, 0, [*argv, "--config.train.steps=100000"], env)
        proc.wait_for(r"^step 100/", 900)
        signalled, began = time.time(), time.perf_counter()
        proc.proc.send_signal(signal.SIGTERM)
        code_ = proc.finish(900)
        exit_s = time.perf_counter() - began
        if code_ != 143:
            raise RuntimeError(f"exit {code_} after SIGTERM:\n{proc.output[-3000:]}")
        stopped = int(re.findall(r"checkpoint of step (\d+)", proc.output)[-1])
        first = [r for r in emulator.requests()[logged:] if gcs_requests.belongs(r, prefix)]
        resumed_at, started = len(emulator.requests()), time.perf_counter()
        again = start(cluster, emulator, 0, [*argv, f"--config.train.steps={stopped + 50}"], env)
        again.wait_for(r"^step \d+/", 900)
        to_first_step = time.perf_counter() - started
        if again.finish(900) != 0:
            raise RuntimeError(f"the resume failed:\n{again.output[-3000:]}")
        second = [r for r in emulator.requests()[resumed_at:] if gcs_requests.belongs(r, prefix)]
        cadence = start(cluster, emulator, 0, [
            sys.executable, "-m", "trainer.main", f"--config={PREEMPTED_MODELS['digits']}",
            f"--workdir={url}-cadence", "--config.train.steps=1000",
            "--config.checkpoint.every_steps=50", "--config.eval.every_steps=0"], env)
        if cadence.finish(900) != 0:
            raise RuntimeError(f"the cadence run failed:\n{cadence.output[-3000:]}")
    finally:
        emulator.set_latency(None)
    saved = len(re.findall(r"checkpoint of step \d+ -> ", cadence.output))
    skipped = len(re.findall(r"checkpoint of step \d+ skipped", cadence.output))
    commit = gcs_requests.commit_of(first, directory, stopped)
    stop = gcs_requests.between(first, signalled, commit["end"] if commit else float("inf"))
    ours = [r for r in second if (r.get("object") or gcs_requests.listed_prefix(r) or ""
                                  ).startswith(directory)]
    upload = min((r["t"] for r in ours if gcs_requests.phase(r) == "data upload"),
                 default=float("inf"))
    return [
        {"latency_ms": latency_ms, "what": "save (step 50)",
         **gcs_requests.bill(gcs_requests.step_requests(first, directory, 50))},
        {"latency_ms": latency_ms, "what": f"stop: SIGTERM -> commit (step {stopped})",
         **gcs_requests.bill(stop), "exit_143_s": round(exit_s, 1)},
        {"latency_ms": latency_ms, "what": "restore", "start_to_first_step_s":
         round(to_first_step, 1), **gcs_requests.bill([r for r in ours if r["t"] < upload])},
        {"latency_ms": latency_ms, "what": "cadence: 1,000 steps, a save due every 50",
         "saved": saved, "skipped": skipped},
    ]


def request_bills(args) -> list[dict]:
    from tests.cluster.gcs import GcsEmulator
    from tests.cluster.hosts import SimulatedCluster

    cluster = SimulatedCluster(root=CLUSTER_DIR, **CLUSTER)
    cluster.up()
    try:
        emulator = GcsEmulator(cluster)
        emulator.start()
        rows = []
        for latency in [float(x) for x in args.latencies.split(",")]:
            rows += _bill_at(cluster, emulator, latency, args.code)
            print(f"  {latency:g} ms a request: done", flush=True)
        return rows
    finally:
        cluster.down()


def report_bills(rows: list[dict]) -> None:
    from tests.cluster.gcs_requests import PHASES

    phases = [p for p in PHASES if any(r.get(p) for r in rows)]
    head = ["ms", "what", "requests", "rounds", "seconds", *phases, "to exit / first step"]
    print(" | ".join(head))
    for r in rows:
        if "skipped" in r:
            print(f"{int(r['latency_ms'])} | {r['what']}: {r['saved']} saved, "
                  f"{r['skipped']} skipped")
            continue
        extra = r.get("exit_143_s", r.get("start_to_first_step_s", ""))
        print(" | ".join(str(v) for v in [int(r["latency_ms"]), r["what"], r["requests"],
                                           r["rounds"], r["seconds"], *(r[p] for p in phases),
                                           f"{extra} s" if extra != "" else ""]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--latency_ms", type=float, default=20.0)
    parser.add_argument("--rate_mbit", type=float, default=200.0)
    parser.add_argument("--interval_s", type=float, default=6.0,
                        help="seconds of training between two saves")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--requests", action="store_true",
                        help="the request bill by phase at each of --latencies")
    parser.add_argument("--latencies", default="50,150,300", help="ms per request")
    parser.add_argument("--code", help="run this checkout of the framework (PYTHONPATH)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bucket", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return
    if os.geteuid() != 0:
        raise SystemExit("benchmarks.checkpoints.bucket_checkpoint makes network namespaces: "
                         "run it as root")
    if args.requests:
        rows = request_bills(args)
        report_bills(rows)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return
    results = parent(args)
    report(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **results}, indent=2))


if __name__ == "__main__":
    main()
