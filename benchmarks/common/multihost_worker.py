"""One worker of the multi-host throughput benchmark
(``benchmarks/parallel/multihost_throughput.py`` starts one per simulated host, with
TF_CONFIG; without TF_CONFIG it is the one-worker compute baseline).

    python -m benchmarks.common.multihost_worker --workload wide_mlp --steps 8 --rounds 3

Builds MultiWorkerMirroredStrategy from TF_CONFIG (the default strategy without it) and
its implementations, in this one process: ``framework`` (``Trainer.fit`` with the
DEFAULT config: benchmarks.common.throughput_impls' ``a-short``, short fits never measured),
``framework_plan`` (the default config in a run long enough for ``perf.plan="auto"``
to measure: ``a``; with several workers its candidates include an all-reduce pack size)
and ``hand`` (the in-graph loop a careful user writes: ``strategy.run`` of a replica step
whose ``optimizer.apply_gradients`` all-reduces every gradient in one batch, ``--steps``
steps per ``tf.function`` call); with ``--pack_bytes N`` ``framework_packs`` (the
framework with ``distribute.grad_pack_bytes=N``), with ``--compression bf16|fp16``
``framework_<it>`` (``distribute.grad_compression``; fp16 under mixed_float16). Each is
warmed up (traced; the plan measured) by one round, then they run
``--rounds`` rounds of ``--steps`` steps, in an order rotated each round (every worker
runs the same sequence: their collectives pair up). Task 0 prints one JSON line after
``%%JSON%%``: examples/s per round of each.
"""

from __future__ import annotations

import argparse
import json
import os
import time

PART_OF = "benchmarks.parallel.multihost_throughput"  # started by it, one per host: not listed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="wide_mlp")
    parser.add_argument("--steps", type=int, default=8, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--global_batch", type=int, default=0,
                        help="0: the workload's batch (the baseline passes its half)")
    parser.add_argument("--pack_bytes", type=int, default=0,
                        help="> 0: also 'framework_packs', the framework with "
                             "distribute.grad_pack_bytes=N")
    parser.add_argument("--compression", default="",
                        help="bf16|fp16: also the framework with distribute.grad_compression")
    args = parser.parse_args()

    import dataclasses

    import tensorflow as tf

    from benchmarks.common.throughput_impls import Framework, HandInGraph
    from benchmarks.common.workloads import WORKLOADS

    cluster = json.loads(os.environ.get("TF_CONFIG", "{}"))
    strategy = (tf.distribute.MultiWorkerMirroredStrategy() if cluster
                else tf.distribute.get_strategy())
    workload = WORKLOADS[args.workload]
    if args.global_batch:
        workload = dataclasses.replace(workload, batch_size=args.global_batch)
    impls = {"framework": Framework(workload, strategy, "short"),
             "hand": HandInGraph(workload, strategy, xla=False, per_call=args.steps)}
    if cluster:  # the plan's candidates are the default's on one worker
        impls["framework_plan"] = Framework(workload, strategy, "auto")
    if args.pack_bytes:
        impls["framework_packs"] = Framework(workload, strategy, "short", **{
            "distribute.grad_pack_bytes": args.pack_bytes})
    if args.compression:
        impls[f"framework_{args.compression}"] = Framework(workload, strategy, "short", **{
            "distribute.grad_compression": args.compression,
            **({"precision.policy": "mixed_float16"} if args.compression == "fp16" else {})})
    for impl in impls.values():
        impl.warm_up(args.steps)
    rates: dict[str, list[float]] = {name: [] for name in impls}
    names = list(impls)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            started = time.perf_counter()
            impls[name].run(args.steps)
            rates[name].append(args.steps * workload.batch_size
                               / (time.perf_counter() - started))
    planned = impls["framework_plan"].plan() if "framework_plan" in impls else None
    if cluster.get("task", {}).get("index", 0) == 0:
        print("%%JSON%%" + json.dumps({"workload": args.workload, "steps": args.steps,
                                        "global_batch": workload.batch_size,
                                        "workers": strategy.num_replicas_in_sync,
                                        "rates": rates,
                                        "plan": planned["chosen"] if planned else None}),
              flush=True)


if __name__ == "__main__":
    main()
