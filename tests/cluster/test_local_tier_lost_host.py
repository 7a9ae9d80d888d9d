"""A lost host costs seconds: 4 hosts, a gs:// workdir saved every 40 steps, a local copy
on every host every 5; one host's training process is SIGKILLed between two bucket saves
and the group restarts with that host's disk empty (a fresh machine).

The launcher tests' digits config (``tests.cluster.runs.CONFIG``: global batch 64, batch
sharding, final weights saved to the workdir) for 60 steps on 4 hosts, one task each
(``launch.multiworker --hosts``), a progress line per step, each input pipeline slowed to
0.2 s a batch (``LAUNCH_TEST_SLOW_FROM``, only in a run that finds no marker of an
earlier one), ``checkpoint.async_save=False`` (a local step is committed before the next
step starts, so which steps the disks hold is known). worker:2 is SIGKILLed once every
worker is past step 47 (its local step 45 committed on every host), between the bucket
saves of steps 40 and 60; the survivors name the lost peer and stop. The restart (new
ports, host 2's HOME, TMPDIR and TFDS data emptied) resumes from a survivor's local step
45, broadcast to the others: the emulator's request log shows no read of a step's state
or manifest object in the bucket from the restart on (the final save still reads the
durable step's small orbax metadata file), and the final weights
equal, bit for bit, those of the same group run uninterrupted alongside.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time

import numpy as np

from tests.cluster import gcs_requests
from tests.cluster.gcs import BUCKET
from tests.cluster.runs import (GROUP_RUN_S, consecutive_ports, fetch, finish_all, outputs,
                                per_host)
from tests.launch_helpers.running import task_pids
from tests.support.helpers import load_weights

STEPS, BUCKET_EVERY, LOCAL_EVERY, KILL_AFTER = 60, 40, 5, 47
FLAGS = [f"--config.train.steps={STEPS}", "--config.train.log_every_steps=1",
         f"--config.checkpoint.every_steps={BUCKET_EVERY}",
         f"--config.checkpoint.local_every_steps={LOCAL_EVERY}",
         "--config.checkpoint.async_save=False", "--config.telemetry.probe_every_windows=0",
         "--config.checkpoint.lease_s=10"]
SLOWED = {"LAUNCH_TEST_SLOW_FROM": "0:0.2"}
LOST_S = 120  # bound from the kill to every survivor's exit


def group(cluster, gcs, prefix: str, env: dict | None = None):
    return per_host(cluster, cluster.hosts[:4], 1, f"gs://{BUCKET}/{prefix}", FLAGS,
                    env={**gcs.client_env(), **(env or {})})


def last_step(run) -> int:
    """The last step whose progress line the chief's launcher printed (0: none)."""
    found = re.findall(rf"^\[worker:0\] step (\d+)/{STEPS}", run.output, re.M)
    return int(found[-1]) if found else 0


def test_a_host_lost_between_bucket_saves_resumes_from_the_peers_local_steps(
        cluster, gcs, tmp_path):
    prefix = f"local-tier-{consecutive_ports(cluster, 1)}"
    reference = group(cluster, gcs, f"{prefix}-ref", SLOWED)
    runs = group(cluster, gcs, prefix, SLOWED)
    deadline = time.monotonic() + GROUP_RUN_S
    while last_step(runs[0]) < KILL_AFTER:  # lockstep: every worker is past step 45's save
        assert time.monotonic() < deadline and all(r.proc.poll() is None for r in runs), (
            outputs(runs))
        time.sleep(0.05)
    os.kill(task_pids(runs[2].lines)["worker:2"], signal.SIGKILL)  # same PID namespace
    killed_at = last_step(runs[0]) + 1  # the step in flight
    codes = finish_all(runs, LOST_S)
    assert codes[2] != 0 and all(c != 0 for c in codes), outputs(runs)
    assert re.search(r"Lost peer: worker:[123] \(", runs[0].output), outputs(runs)
    assert killed_at < BUCKET_EVERY + 20, killed_at  # between the bucket saves of 40 and 60
    assert finish_all(reference) == [0, 0, 0, 0], outputs(reference)  # it used host 2 too
    lost = cluster.hosts[2]
    for directory in (lost.home, lost.tfds_data_dir, lost.scratch):  # a fresh machine
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)

    restart_at = time.time()
    rerun = group(cluster, gcs, prefix)
    rerun[0].wait_for(rf"^\[worker:0\] step \d+/{STEPS}", GROUP_RUN_S)
    first_step = time.time()  # the first progress line seen
    assert finish_all(rerun) == [0, 0, 0, 0], outputs(rerun)
    resumed = re.search(r"resumed from step (\d+) \(worker (\d)'s local checkpoint\)",
                        rerun[0].output)
    assert resumed, outputs(rerun)
    step, holder = int(resumed.group(1)), int(resumed.group(2))
    assert killed_at - LOCAL_EVERY <= step < killed_at and holder != 2, (step, killed_at)
    requests = [r for r in gcs.requests() if r["t"] >= restart_at
                and gcs_requests.belongs(r, f"{prefix}/checkpoints/")]
    assert requests, "the restart made no request about the checkpoints: no log to judge"
    read = [r for r in requests if gcs_requests.phase(r) == "read"]
    state = [r["object"] for r in read if re.search(r"/checkpoints/\d+/(state|manifest)/",
                                                    r["object"] or "")]
    assert not state, state

    fetch(cluster, gcs, prefix, tmp_path / "run")
    fetch(cluster, gcs, f"{prefix}-ref", tmp_path / "reference")
    want = load_weights(tmp_path / "reference" / "weights-worker-0.npz")
    got = load_weights(tmp_path / "run" / "weights-worker-0.npz")
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))
    print(f"\n[measured] 4 hosts, worker:2 SIGKILLed at step {killed_at} (bucket: step "
          f"{BUCKET_EVERY}): resumed from worker {holder}'s local step {step} "
          f"({killed_at - step} steps behind, bucket-only {killed_at - BUCKET_EVERY}); "
          f"state objects read from the bucket: {len(state)} (other checkpoint objects read: "
          f"{sorted(r['object'].split('/checkpoints/')[1] for r in read)}); "
          f"restart -> first progress line {first_step - restart_at:.1f} s")
