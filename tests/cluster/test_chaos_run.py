"""A short chaos campaign (tests/cluster/chaos.py): one run into the bucket is hit by a
preemption while an upload stalls, a SIGKILL and a corrupted newest checkpoint,
restarted after each, then goes on as a group of two workers that loses one (SIGKILL)
and is restarted by its launcher; it ends with the weights of the uninterrupted run, every
preemption said saved was (the restart resumes from that very step), and the goodput
per fault kind, as the run's own goodput record says (one entry per process of the
chief, each resumed from the step the campaign saw), is printed.
benchmarks/checkpoints/chaos_run.py runs a longer campaign with 503 bursts as well (each
costs about a minute of the clients' back-off: kept out of CI, where
tests/cluster/test_gcs_faults.py retries such a burst through a whole run).

The first fault is the spot-VM case that lost work: SIGTERM while the previous upload
stalls (the host cut off from the bucket), the stop's step a save step whose periodic
save was skipped; it was reported saved and was not (the restart resumed from an
earlier step)."""

from __future__ import annotations

import re

from tests.cluster import chaos
from tests.cluster.runs import RUN_S, bucket_url, fetch, start, trainer_argv
from tests.support.helpers import load_weights, max_abs_diff

STEPS = 120
FAULTS = ["sigterm_stalled_upload", "sigkill", "corrupt_newest"]  # then chaos.LAST


def test_a_run_hit_by_faults_ends_with_the_weights_of_an_uninterrupted_one(
        cluster, gcs, tmp_path):
    port = cluster.ports()[0]
    reference = start(cluster, gcs, cluster.hosts[1],
                      trainer_argv(bucket_url(f"chaos-ref-{port}"), *chaos.flags(STEPS),
                                   config=chaos.CONFIG),
                      env={"LAUNCH_TEST_SLOW_FROM": f"0:{chaos.STEP_S}"})
    campaign = chaos.Campaign(cluster, gcs, cluster.hosts[0], f"chaos-{port}", STEPS)
    attempts = campaign.run(FAULTS)
    assert reference.finish(RUN_S) == 0, reference.output[-4000:]

    statuses = [a.status for a in attempts]
    assert statuses == [143, -9, 143, 0], [(a.fault, a.status, a.output[-3000:])
                                                for a in attempts]
    for attempt, after in zip(attempts, attempts[1:]):
        said = re.search(r"preempted at step (\d+); a checkpoint of that step was saved",
                         attempt.output)
        if attempt.status == 143:  # what was said saved is what the restart resumes from
            assert said, attempt.output[-4000:]
            if attempt.fault != "corrupt_newest":
                assert after.resumed == int(said.group(1)), (said.group(0), after.resumed)
    after_corruption = attempts[FAULTS.index("corrupt_newest") + 1]
    assert "Skipping checkpoint" in after_corruption.output, after_corruption.output[-4000:]
    assert "is corrupt" in after_corruption.output  # its step saved again: replaced
    group = attempts[-1]
    assert "restarting the whole group (restart 1 of 1)" in group.output, group.output[-4000:]
    resumes = [int(s) for s in re.findall(r"^\[worker:0\] .*resumed from step (\d+) \(",
                                                  group.output, re.M)]
    assert len(resumes) == 2 and resumes[1] > resumes[0], group.output[-4000:]
    fetch(cluster, gcs, f"chaos-{port}", tmp_path / "run")
    fetch(cluster, gcs, f"chaos-ref-{port}", tmp_path / "reference")
    diff = max_abs_diff(load_weights(tmp_path / "reference" / "weights-local-0.npz"),
                        load_weights(tmp_path / "run" / "weights-worker-0.npz"))
    goodput = chaos.goodput(tmp_path / "run", attempts)
    print(f"\n[measured] chaos: {len(FAULTS) + 1} faults, {len(attempts)} attempts, max|dw| vs "
          f"uninterrupted {diff:.1e}, goodput " + ", ".join(
              f"{k} {v:.2f}" for k, v in sorted(goodput.items())))
    assert diff <= 1e-5
