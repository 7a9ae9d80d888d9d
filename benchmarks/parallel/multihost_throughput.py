"""Throughput across hosts on shaped links: the framework vs a hand-written
MultiWorkerMirroredStrategy loop, 2 simulated hosts x 1 worker.

    sudo python -m benchmarks.parallel.multihost_throughput [--links 10gbit,1gbit,100mbit]
        [--workloads wide_mlp,deep_mlp,transformer] [--rounds 3] [--compression bf16]
        [--json PATH]

Needs root and the tests' simulated hosts (``tests/cluster``: network namespaces on a
private bridge; started here if down). Each link speed is set with ``tc qdisc ... tbf``
on both hosts' interfaces (egress: every byte a host sends); a per-packet delay
(``netem``) is added when the kernel has it (``--delay_ms``; this machine's kernel has no
``sch_netem``: the runs below are rate-limited only). Per link and workload, both hosts
run ``benchmarks/common/multihost_worker.py`` (TF_CONFIG of 2 workers), which pairs the
framework (``Trainer.fit``, default config, a short run: the configured plan), the
framework whose execution plan was measured on the run (``framework_plan``: a pack
size is one of its candidates; each group has an empty plan cache of its own), the
framework with gradient packs (``distribute.grad_pack_bytes``, ``--pack_bytes``, 4 MiB
by default), with ``--compression`` the framework with a compressed all-reduce, and the
hand-written loop (one batched all-reduce per step, as a careful user writes it) round
by round in one process.

Printed per row: examples/s of each (median over rounds), the median per-round ratio
to the hand-written loop, and the seconds per step spent waiting in collectives,
estimated as the step time on the link minus the compute-only step time (each host
training the same per-worker batch by itself, both at once, measured first):
communication that overlaps compute does not show in it.

The hosts share this machine's cores: compute per step is slower than on two machines,
so the link speed at which communication and compute take about the same time is lower
than on real hosts.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from pathlib import Path

from benchmarks.common.table import Row, format_table

STEPS = {"10gbit": 12, "3gbit": 8, "1gbit": 6, "300mbit": 4, "100mbit": 3}


def _rate_bytes(rate: str) -> int:
    """``"1gbit"`` -> bytes per second."""
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate).groups()
    return int(float(number) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[unit] / 8)


def shape(cluster, host, rate: str | None, delay_ms: float) -> str:
    """Sets ``host``'s egress to ``rate`` (None: unshaped); returns what was applied."""
    cluster.run(host, ["tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
    if rate is None:
        return "unshaped"
    tbf = ["tbf", "rate", rate, "burst", str(max(_rate_bytes(rate) // 100, 65536)),
           "latency", "100ms"]
    if delay_ms:
        netem = cluster.run(host, ["tc", "qdisc", "add", "dev", "eth0", "root", "handle",
                                   "1:", "netem", "delay", f"{delay_ms}ms"], check=False)
        if netem.returncode == 0:
            cluster.run(host, ["tc", "qdisc", "add", "dev", "eth0", "parent", "1:",
                               "handle", "2:", *tbf])
            return f"{rate} + {delay_ms} ms delay"
    cluster.run(host, ["tc", "qdisc", "add", "dev", "eth0", "root", *tbf])
    return rate


def run_workers(cluster, hosts, argv: list[str], timeout: float, env: dict,
                group: bool = True) -> dict:
    """``argv`` on ``hosts`` with ``env``, as one MultiWorkerMirroredStrategy group (one
    worker each), or (not ``group``) as independent single workers at the same time;
    returns the first host's JSON."""
    from tests.cluster.hosts import Watched

    ports = cluster.ports(len(hosts))
    workers = [f"{h.address}:{p}" for h, p in zip(hosts, ports)]
    runs = []
    for index, host in enumerate(hosts):
        config = {"TF_CONFIG": json.dumps({"cluster": {"worker": workers},
                                           "task": {"type": "worker", "index": index}})
                  } if group else {}
        runs.append(Watched(cluster.popen(host, argv, env={**env, **config})))
    codes = [run.finish(timeout) for run in runs]
    if any(codes):
        raise SystemExit("a worker failed:\n" + "\n".join(r.output[-3000:] for r in runs))
    line = next(x for x in runs[0].lines if x.startswith("%%JSON%%"))
    return json.loads(line[len("%%JSON%%"):])


def _empty_plan_cache() -> dict:
    """The environment of one group: a plan cache of its own, empty
    (trainer/loop/plan_cache.py), so that no link's plan is adopted on another."""
    return {"XDG_CACHE_HOME": tempfile.mkdtemp(prefix="multihost-plans-")}


def format_row(row: dict) -> str:
    """One workload x link: each implementation's examples/s (median over rounds) and the
    per-round ratio to ``hand``; the note gives the seconds per step spent waiting in
    collectives (the step time minus the compute-only step time)."""
    hand = row["rounds"]["hand"]
    rows = []
    for impl, per_round in row["rounds"].items():
        ratios = [r / h for r, h in zip(per_round, hand)]
        rows.append(Row(impl, row[impl], "ex/s", row[f"{impl}_vs_hand"],
                        (min(ratios), max(ratios)), (min(per_round), max(per_round)),
                        note=f"wait {row[f'{impl}_wait_s']:.3f} s/step"))
    return format_table(f"multihost_throughput: {row['workload']}, link {row['link']}, compute "
                        f"{row['compute_s']:.3f} s/step; plan {row['plan']}", rows, "hand")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", default="10gbit,1gbit,100mbit")
    parser.add_argument("--workloads", default="wide_mlp,deep_mlp,transformer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--delay_ms", type=float, default=0.1)
    parser.add_argument("--pack_bytes", type=int, default=4 << 20,
                        help="the framework with distribute.grad_pack_bytes=N as well (0: not)")
    parser.add_argument("--compression", default="",
                        help="bf16|fp16: the framework with distribute.grad_compression too")
    parser.add_argument("--timeout_s", type=float, default=1800)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    from benchmarks.common.workloads import WORKLOADS
    from tests.cluster.hosts import DEFAULT_DIR, SimulatedCluster

    cluster = SimulatedCluster(hosts=2, root=Path(DEFAULT_DIR))
    cluster.up()
    hosts = cluster.hosts[:2]
    rows = []
    try:
        for name in args.workloads.split(","):
            workload = WORKLOADS[name]
            base = ["python", "-m", "benchmarks.common.multihost_worker", "--workload", name,
                    "--rounds", str(args.rounds), "--pack_bytes", str(args.pack_bytes),
                    "--compression", args.compression]
            for host in hosts:
                shape(cluster, host, None, 0)
            # Compute alone: each host trains its half of the batch by itself, both at
            # once (the hosts share this machine's cores, as in the group).
            alone = run_workers(cluster, hosts, [*base, "--steps", "12", "--global_batch",
                                                 str(workload.batch_size // 2)],
                                args.timeout_s, _empty_plan_cache(), group=False)
            compute_s = workload.batch_size // 2 / statistics.median(alone["rates"]["hand"])
            for link in args.links.split(","):
                applied = [shape(cluster, h, link, args.delay_ms) for h in hosts][0]
                got = run_workers(cluster, hosts, [*base, "--steps", str(STEPS.get(link, 6))],
                                  args.timeout_s, _empty_plan_cache())
                rates = got["rates"]
                row = {"workload": name, "link": applied, "compute_s": compute_s,
                       "rounds": rates, "plan": got["plan"]}
                for impl, per_round in rates.items():
                    row[impl] = statistics.median(per_round)
                    row[f"{impl}_vs_hand"] = statistics.median(
                        r / h for r, h in zip(per_round, rates["hand"]))
                    row[f"{impl}_wait_s"] = max(0.0, workload.batch_size / row[impl] - compute_s)
                rows.append(row)
                print(format_row(row) + "\n", flush=True)
    finally:
        for host in hosts:
            shape(cluster, host, None, 0)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
