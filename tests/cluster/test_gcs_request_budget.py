"""What a checkpoint in a bucket costs, counted in the GCS emulator's request log.

The digits demo with ``--workdir=gs://...`` on a simulated host, the emulator answering
every request 100 ms late (a real bucket's median is 60-130 ms): loops of 10 steps, a
save every 50, SIGTERM once the step-100 line is out (the stop's save is a later loop's
end), then a second run that resumes from the bucket.
Counted by phase (:mod:`tests.cluster.gcs_requests`), never timed:

* a periodic save is uploads and its commit only (no listing, no metadata request, no
  read-back, no delete), <= :data:`SAVE_REQUESTS` requests in <= :data:`SAVE_ROUNDS`
  sequential rounds, whatever the number of arrays;
* between SIGTERM and the stop's commit marker the bucket sees no listing, no delete of
  a checkpoint, no metadata request and no new telemetry upload (at most the end of a
  telemetry sync in flight at the signal): nothing but the save;
* the resume reads the step in <= :data:`RESTORE_ROUNDS` rounds (listings, then the
  objects in parallel);
* plain orbax (no tf-trainer code) restores the ``state`` item of the bucket's newest
  step, committed by the same marker orbax writes;
* the steps were staged in ``checkpoint.staging_dir``, left empty by both runs.
"""

from __future__ import annotations

import json
import re
import signal
import time

from tests.cluster import gcs_requests
from tests.cluster.runs import RUN_S, bucket_url, start, trainer_argv

LATENCY_MS = 100
SAVE_REQUESTS = 40  # the budget ("<= ~40 requests in all")
SAVE_ROUNDS = 8  # 8 uploads at a time, then the commit (+ late threads); the issue allows ~12
RESTORE_ROUNDS = 10
FLAGS = ("--config.train.steps_per_loop=10", "--config.train.log_every_steps=50",
         "--config.checkpoint.every_steps=50", "--config.eval.every_steps=0",
         "--config.telemetry.probe_every_windows=0")

PLAIN_ORBAX = """
import json, sys
import jax, orbax.checkpoint as ocp
manager = ocp.CheckpointManager(sys.argv[1])
step = manager.latest_step()
restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore()))
leaves = jax.tree_util.tree_leaves(restored["state"])
print(json.dumps({"step": step, "steps": list(manager.all_steps()), "leaves": len(leaves),
                  "finite": all(bool((abs(x) < 1e30).all()) for x in leaves)}))
"""


def test_saves_the_stop_and_the_resume_cost_a_few_round_trips(cluster, gcs):
    prefix = f"budget-{cluster.ports()[0]}"
    directory = f"{prefix}/checkpoints"
    staging = cluster.host(0).scratch / f"staging-{prefix}"  # checkpoint.staging_dir
    flags = (*FLAGS, f"--config.checkpoint.staging_dir={staging}")
    gcs.set_latency(LATENCY_MS)
    try:
        logged = len(gcs.requests())
        proc = start(cluster, gcs, 0, trainer_argv(bucket_url(prefix),
                                                   "--config.train.steps=100000", *flags))
        proc.wait_for(r"^step 100/", RUN_S)
        signalled = time.time()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.finish(RUN_S) == 143, proc.output[-6000:]
        stopped = int(re.findall(r"checkpoint of step (\d+)", proc.output)[-1])
        first = [r for r in gcs.requests()[logged:] if gcs_requests.belongs(r, prefix)]

        resumed_at = len(gcs.requests())
        again = start(cluster, gcs, 0, trainer_argv(
            bucket_url(prefix), f"--config.train.steps={stopped + 50}", *flags))
        assert again.finish(RUN_S) == 0, again.output[-6000:]
        assert f"resumed from step {stopped}" in again.output, again.output[-3000:]
        second = [r for r in gcs.requests()[resumed_at:] if gcs_requests.belongs(r, prefix)]
    finally:
        gcs.set_latency(None)

    assert staging.is_dir() and not list(staging.iterdir()), list(staging.iterdir())

    for step in (50, 100):
        bill = gcs_requests.bill(gcs_requests.step_requests(first, directory, step))
        print(f"\n[measured] save of step {step}: {bill}")
        assert bill["requests"] <= SAVE_REQUESTS and bill["rounds"] <= SAVE_ROUNDS, bill
        assert bill["data upload"] >= 5 and bill["commit"] >= 1, bill
        assert bill["requests"] == bill["data upload"] + bill["commit"], bill

    commit = gcs_requests.commit_of(first, directory, stopped)
    assert commit is not None, f"no commit marker of step {stopped}"
    window = gcs_requests.between(first, signalled, commit["end"])
    bill = gcs_requests.bill(window)
    print(f"[measured] SIGTERM -> commit of step {stopped}: {bill}")
    for phase in ("listing", "metadata", "read", "delete"):
        assert bill[phase] == 0, (phase, [(r["method"], r["path"], r.get("object"))
                                          for r in window])
    # Telemetry: at most the end of one object's sync under way at the signal (its part's
    # upload, the compose, the part's delete); nothing more until the commit.
    telemetry = [(r["method"], r["path"].split("?")[0], r.get("object")) for r in window
                 if gcs_requests.phase(r) == "telemetry"]
    assert len(telemetry) <= 3, telemetry

    checkpoints = [r for r in second if (r.get("object") or gcs_requests.listed_prefix(r)
                                         or "").startswith(directory)]
    first_upload = min((r["t"] for r in checkpoints if gcs_requests.phase(r) == "data upload"),
                       default=float("inf"))
    restore = [r for r in checkpoints if r["t"] < first_upload]
    bill = gcs_requests.bill(restore)
    print(f"[measured] restore of step {stopped}: {bill}")
    assert bill["read"] >= 5 and bill["rounds"] <= RESTORE_ROUNDS, bill

    result = cluster.run(0, ["python", "-c", PLAIN_ORBAX, f"{bucket_url(prefix)}/checkpoints"],
                         env=gcs.client_env(), timeout=RUN_S)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["step"] == stopped + 50 and seen["finite"], seen
    assert seen["leaves"] >= 4, seen  # the model's kernels and biases, the optimizer's slots


def test_a_stop_save_the_bucket_does_not_take_ends_with_the_grace_period(cluster, gcs):
    """Every checkpoint write answered 503 from step 50 on: the client retries (said while
    the stop's save waits), and when ``checkpoint.preemption_grace_s`` after SIGTERM runs
    out the run gives the write up and exits 143 with one line naming the last good
    checkpoint, which the bucket holds committed."""
    prefix = f"grace-{cluster.ports()[0]}"
    proc = start(cluster, gcs, 0, trainer_argv(bucket_url(prefix), "--config.train.steps=100000",
                                               "--config.checkpoint.preemption_grace_s=15",
                                               *FLAGS))
    try:
        proc.wait_for(r"^step 50/", RUN_S)
        gcs.inject(503, count=10**6, path_contains=f"{prefix}%2Fcheckpoints%2F",
                   methods=("POST", "PUT"))
        proc.wait_for(r"^step 100/", RUN_S)
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.finish(RUN_S) == 143, proc.output[-6000:]
    finally:
        gcs.inject(503, count=0, path_contains=prefix)
    output = proc.output
    assert "checkpoint.preemption_grace_s=15 s after the stop signal ran out" in output, \
        output[-6000:]
    assert "the bucket answered 503 (Service Unavailable); its client retries" in output, \
        output[-6000:]
    assert "The stop's checkpoint committed" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("preempted at step")]
    assert len(lines) == 1, lines
    assert re.search(r"NO checkpoint of step \d+ could be saved, the last good one is ",
                     lines[0]), lines[0]
    named = re.search(r"the last good one is step (\d+)", lines[0])
    if named:  # the step named is committed in the bucket
        assert gcs_requests.commit_of(gcs.requests(), f"{prefix}/checkpoints",
                                      int(named.group(1))) is not None, lines[0]


def test_inspect_says_what_the_bucket_answers_while_its_client_retries(cluster, gcs):
    """``trainer.checkpoint.show`` on a bucket answering 503 to its listings: a line
    while it waits (after 5 s), naming the answer; once the bucket answers again, its
    table. The 503s last until that line is out: a count of them would be a race with
    the client's jittered back-off (4 retries can sleep under 5 s in all)."""
    prefix = f"inspect-{cluster.ports()[0]}"
    gcs.inject(503, count=1_000_000, path_contains=f"{prefix}%2Fcheckpoints")
    try:
        run = start(cluster, gcs, 0, ["python", "-m", "trainer.checkpoint.show",
                                      f"--workdir={bucket_url(prefix)}"])
        run.wait_for(r"waiting for the checkpoints of gs://\S+ to be listed and read "
                     r"\(\d+ s so far; the bucket answered 503 \(Service Unavailable\); "
                     r"its client retries\)", RUN_S)
    finally:
        gcs.inject(503, count=0, path_contains=prefix)
    assert run.finish(RUN_S) == 0, run.output[-3000:]
    assert "resume: none (no checkpoint" in run.output, run.output[-3000:]
