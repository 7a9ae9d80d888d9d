"""A longer chaos campaign than CI's: N random faults on one run into a bucket.

    sudo python -m benchmarks.checkpoints.chaos_run [--faults 8] [--steps 400] [--seed 0]
                                                    [--every 10] [--latency_ms 0] [--json PATH]

Needs root and the tests' simulated hosts with the GCS emulator (``.ci/run`` starts
them; ``tests/cluster/netns_hosts.sh up 2 && python -m tests.cluster.gcs start`` by
hand). The campaign is tests/cluster/chaos.py's: the faults are drawn (seeded) from its
kinds — SIGTERM while an upload stalls, SIGKILL, a corrupted newest checkpoint, a burst
of 503 answers — each attempt restarted by the same command; the last attempt is a
group of two workers that loses one to SIGKILL and is restarted by its launcher
(``launch.multiworker --max_restarts 1``), to the end; an uninterrupted run of the
same command on the other host is the reference.
Prints the fault count, max|dw| against the reference and the goodput (productive
training time / wall time, as the run's own record ``goodput.json`` says) overall and
per fault kind. ``--every``: a checkpoint every
that many steps; ``--latency_ms``: the emulator answers every request that much later
for the campaign (a real bucket's median is 60-130 ms).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from benchmarks.common.table import Row, format_table


def format_summary(title: str, max_dw: float, wall_s: float, reference_s: float,
                   goodput: dict[str, float]) -> str:
    """The campaign's table: max|dw| against the uninterrupted run, the wall time against
    the uninterrupted run's, and the goodput overall and per fault kind."""
    rows = [Row("max|dw| vs the uninterrupted run", max_dw, "max|dw|"),
            Row("wall time, all attempts", wall_s, "s", wall_s / reference_s),
            Row("wall time, uninterrupted", reference_s, "s", 1.0)]
    rows += [Row(f"goodput, {kind}", value, "goodput",
                 note="productive training time / wall time")
             for kind, value in sorted(goodput.items())]
    return format_table(title, rows, "uninterrupted")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=10, help="checkpoint.every_steps")
    parser.add_argument("--latency_ms", type=float, default=0.0,
                        help="added by the emulator to every answer")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    from tests.cluster.gcs import GcsEmulator
    from tests.cluster.hosts import DEFAULT_DIR, SimulatedCluster

    cluster = SimulatedCluster(hosts=2, root=Path(DEFAULT_DIR))
    cluster.up()
    gcs = GcsEmulator(cluster)
    gcs.start()
    gcs.set_latency(args.latency_ms or None)
    try:
        _campaign(args, cluster, gcs)
    finally:
        gcs.set_latency(None)


def _campaign(args, cluster, gcs) -> None:
    from tests.cluster import chaos
    from tests.cluster.runs import RUN_S, bucket_url, fetch, start, trainer_argv
    from tests.support.helpers import load_weights, max_abs_diff

    tag = f"chaos-bench-{int(time.time())}"
    faults = random.Random(args.seed).choices(chaos.KINDS, k=args.faults)
    started = time.monotonic()
    reference = start(cluster, gcs, cluster.hosts[1],
                      trainer_argv(bucket_url(f"{tag}-ref"),
                                   *chaos.flags(args.steps, args.every),
                                   config=chaos.CONFIG),
                      env={"LAUNCH_TEST_SLOW_FROM": f"0:{chaos.STEP_S}"})
    campaign = chaos.Campaign(cluster, gcs, cluster.hosts[0], tag, args.steps, args.seed,
                              args.every)
    for i, fault in enumerate([*faults, chaos.LAST]):
        attempt = campaign.attempt(fault)
        print(f"attempt {i + 1}: {fault:<24} resumed from {attempt.resumed:>4}, exit "
              f"{attempt.status}, {attempt.wall_s:.1f} s", flush=True)
    if reference.finish(RUN_S) != 0:
        raise SystemExit(f"the reference run failed:\n{reference.output[-3000:]}")
    reference_s = reference.exited_at - started
    with tempfile.TemporaryDirectory() as tmp:
        fetch(cluster, gcs, tag, Path(tmp) / "run")
        fetch(cluster, gcs, f"{tag}-ref", Path(tmp) / "ref")
        diff = max_abs_diff(load_weights(Path(tmp) / "ref" / "weights-local-0.npz"),
                            load_weights(Path(tmp) / "run" / "weights-worker-0.npz"))
        goodput = chaos.goodput(Path(tmp) / "run", campaign.attempts)
    title = (f"chaos_run: saves every {args.every} steps, +{args.latency_ms:g} ms a request, "
             f"{args.faults + 1} faults ({', '.join(sorted({*faults, chaos.LAST}))}), "
             f"{len(campaign.attempts)} attempts, {args.steps} steps, seed {args.seed}")
    print("\n" + format_summary(title, diff, sum(a.wall_s for a in campaign.attempts),
                                reference_s, goodput))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "faults": faults, "max_abs_dw": diff, "goodput": goodput,
            "attempts": [{"fault": a.fault, "resumed": a.resumed, "status": a.status,
                          "wall_s": a.wall_s} for a in campaign.attempts]}, indent=2))


if __name__ == "__main__":
    main()
