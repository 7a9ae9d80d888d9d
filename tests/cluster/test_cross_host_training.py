"""Training across simulated hosts: the per-host launcher and multi-node Slurm end with
the weights of one process, survive a preemption, a lost host and a change of worker
count (4 workers on 2 hosts requeued as 2 on the remaining host; a change of worker
count on one host, 4 -> 2 and 2 -> 4, is tests/checkpoint/test_elastic_resume.py's).

Every run is the launcher tests' digits config (``tests.cluster.runs.CONFIG``,
``tests/launch_helpers/weights_config.py``: 30 steps, global batch 64, batch sharding,
final weights saved by ``WeightsTrainer``), one CPU device per task, the workdir in the
cluster's shared directory. The reference is the same config trained by one process
(the session fixture ``launcher_reference_weights``, shared with tests/launch/, which
also checks that 2 and 4 workers on one host end with its weights). With batch sharding the global batches do
not depend on the worker count, so every layout, and every resume on another layout,
ends with the reference's weights (<= 1e-5: only the all-reduce order differs).

Runs that must be interrupted mid-training use ``LAUNCH_TEST_SLOW_FROM`` (each input
pipeline sleeps from batch 10 on, only in a run that finds no marker of an earlier one:
the resumed run goes at full speed).

Measured (printed with ``-s``, never asserted; noisy on a shared machine): examples/s of
2 hosts x 2 tasks (benchmarks/parallel/multihost_throughput.py compares layouts); seconds from a
host's cut to every launcher's exit; seconds from a Slurm requeue to the first resumed training window on
2 hosts (preemption) and on 1 host (a lost host).
"""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from launch import multiworker
from tests.cluster.gcs import BUCKET
from tests.cluster.hosts import SimulatedCluster
from tests.cluster.runs import (CONFIG_FLAG, GROUP_RUN_S, SLOW, STEPS, consecutive_ports, fetch,
                                finish_all, outputs, per_host)
from tests.support.helpers import REPO, assert_same_weights, load_weights, max_abs_diff

RUN_S = GROUP_RUN_S  # bound for one run (up to 4 TensorFlow processes on 2 shared cores)
LOST_S = 120  # bound from a host's cut to every launcher's exit (collective timeout 30 s)
COLLECTIVE_TIMEOUT_S = 30
EVERY_5 = "--config.checkpoint.every_steps=5"
# A stopped task saves at its next loop boundary (5 slowed steps) before SIGKILL.


def examples_per_s(workdir: Path) -> float:
    """Median examples/s of the train windows in ``metrics.jsonl`` after the first (which
    includes the compilation)."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["perf/examples_per_s"] for r in records if r.get("kind") == "train"]
    assert len(speeds) >= 2, records
    return statistics.median(speeds[1:])


def assert_reference_weights(reference: list[np.ndarray], workdir: Path, workers: int) -> float:
    """Every worker's final weights equal the reference's; returns the largest difference."""
    for index in range(workers):
        assert_same_weights(reference, workdir / f"weights-worker-{index}.npz")
    return max(max_abs_diff(reference, load_weights(workdir / f"weights-worker-{i}.npz"))
               for i in range(workers))



def resumed_step(output: str) -> int:
    found = re.findall(r"resumed from step (\d+) \(", output)
    assert found, f"the run did not resume from a checkpoint:\n{output[-6000:]}"
    return int(found[-1])


@pytest.fixture
def reference(launcher_reference_weights: list[np.ndarray]) -> list[np.ndarray]:
    """The weights of one process training the same config (the session's one run)."""
    return launcher_reference_weights


# ---------------------------------------------------------------- per-host launcher

def test_two_hosts_of_two_tasks_train_to_the_weights_of_one_process(cluster, reference):
    h0, h1 = cluster.hosts[:2]
    workdir = cluster.shared_dir("two-hosts")
    runs = per_host(cluster, (h0, h1), 2, workdir)
    assert finish_all(runs) == [0, 0], outputs(runs)
    # Each launcher started its own two tasks on its own address.
    assert re.search(rf"node_rank 1 of 2: starting 2 task\(s\) on {h1.address}: "
                     rf"worker:2=\d+, worker:3=\d+", runs[1].output), runs[1].output[-3000:]
    assert "replicas in sync: 4" in runs[0].output, runs[0].output[-3000:]
    diff = assert_reference_weights(reference, workdir, 4)
    speed = examples_per_s(workdir)
    print(f"\n[measured] max|dw| 2 hosts x 2 vs one process: {diff:.2e}; examples/s: "
          f"2 hosts x 2 {speed:,.0f}")


def test_gradient_packs_between_two_hosts_train_to_the_weights_of_one_host(cluster, reference):
    """distribute.grad_pack_bytes across hosts: the gradients cross in several packs
    (tests/step/test_gradient_packs.py), the weights are one host's."""
    workdir = cluster.shared_dir("two-hosts-packs")
    runs = per_host(cluster, cluster.hosts[:2], 1, workdir,
                    ["--config.distribute.grad_pack_bytes=4096"])
    assert finish_all(runs) == [0, 0], outputs(runs)
    assert "replicas in sync: 2" in runs[0].output, runs[0].output[-3000:]
    assert_reference_weights(reference, workdir, 2)


def test_two_hosts_with_local_disks_only_train_as_one_through_a_bucket(cluster, gcs, reference,
                                                                      tmp_path):
    """No shared file system: the workdir is gs://; the shared-workdir check, the
    checkpoints and the weights go through the bucket."""
    h0, h1 = cluster.hosts[:2]
    prefix = f"two-hosts-{cluster.ports()[0]}"
    runs = per_host(cluster, (h0, h1), 1, f"gs://{BUCKET}/{prefix}", env=gcs.client_env())
    assert finish_all(runs) == [0, 0], outputs(runs)
    assert "replicas in sync: 2" in runs[0].output, runs[0].output[-3000:]
    for run in runs:
        assert f"checking that every task sees the workdir gs://{BUCKET}/{prefix}" in run.output
    names = fetch(cluster, gcs, prefix, tmp_path)
    assert f"checkpoints/{STEPS}/commit_success.txt" in names, names
    assert f"checkpoints/{STEPS}/state/crc32c.json" in names, names
    assert not any(n.startswith(".cluster-") for n in names), names  # the check cleaned up
    assert_reference_weights(reference, tmp_path, 2)
    # Nothing went to a local directory named "gs:" (a path joined without gfile).
    for root in (REPO, h0.home, h1.home):
        assert not (root / "gs:").exists(), root


def test_a_host_cut_off_ends_every_launcher_naming_it_and_the_rerun_resumes(cluster, reference):
    h0, h1 = cluster.hosts[:2]
    workdir = cluster.shared_dir("cut")
    flags = ["--collective_timeout_s", str(COLLECTIVE_TIMEOUT_S), EVERY_5]
    runs = per_host(cluster, (h0, h1), 2, workdir, flags, env=SLOW)
    saved = runs[0].wait_for(r"checkpoint of step (\d+) ->", RUN_S)
    cluster.partition(h1)
    cut = time.monotonic()
    codes = finish_all(runs, LOST_S)
    assert all(code != 0 for code in codes), outputs(runs)
    # The surviving host's launcher ends with one line naming the lost host and a task.
    last = runs[0].lines[-1]
    assert last.startswith("[launcher] failed: "), outputs(runs)
    assert re.search(rf"lost peer:? (worker:[23] on )?host {re.escape(h1.address)} "
                     rf"\(node_rank 1: worker:[23] at {re.escape(h1.address)}:\d+", last), last
    assert last.endswith(f"(exit status {codes[0]}).")
    # The surviving host's tasks exit 170 (retryable), each with one "Lost peer" line.
    assert codes[0] == 170, outputs(runs)[-8000:]
    assert re.search(r"Lost peer: worker:[23] \(", runs[0].output), runs[0].output[-6000:]
    assert "Traceback" not in runs[0].output, runs[0].output[-6000:]
    cluster.assert_no_processes(cluster.hosts, allow=cluster.daemons)
    exits = [run.exited_at - cut for run in runs]
    print(f"\n[measured] {h1.name} cut (checkpoint of step {saved.group(1)} logged before) -> "
          f"launchers exited after {', '.join(f'{s:.1f} s' for s in exits)} (codes {codes}); "
          f"{h0.name}'s last line: {last}")

    cluster.heal(h1)
    rerun = per_host(cluster, (h0, h1), 2, workdir, flags)
    assert finish_all(rerun) == [0, 0], outputs(rerun)
    step = resumed_step(rerun[0].output)
    checkpoints = {int(s) for s in re.findall(r"checkpoint of step (\d+) ->", runs[0].output)}
    assert step > 0 and step in checkpoints, (step, checkpoints)
    assert_reference_weights(reference, workdir, 4)


# ---------------------------------------------------------------- multi-node Slurm

def submit(slurm, cluster: SimulatedCluster, label: str, nodes: str,
           flags: Sequence[str] = (), env: dict | None = None, workdir: str | None = None):
    """The emitted ``--nodes NODES --tasks_per_node 2`` script, submitted; returns the job
    and its workdir (default: ``run`` in the job's shared directory)."""
    directory = cluster.shared_dir(label)
    workdir, script = workdir or directory / "run", directory / "job.sbatch"
    code = multiworker.main(["--emit", "slurm", "--nodes", nodes, "--tasks_per_node", "2",
                             "--port", str(consecutive_ports(cluster, 2)), "--job_name", label,
                             "--output", str(script), CONFIG_FLAG, f"--workdir={workdir}", *flags])
    assert code == 0
    return slurm.submit(script, directory=directory, env={"TZ": "UTC", **(env or {})}), workdir


def seen(job, pattern: str, timeout: float = RUN_S) -> float:
    """When (``time.monotonic()``, polled) the job's output first matched ``pattern``."""
    job.wait_for_output(pattern, timeout)
    return time.monotonic()


def test_a_two_node_slurm_job_trains_to_the_weights_of_one_host(multinode_slurm, cluster,
                                                                 reference):
    job, workdir = submit(multinode_slurm, cluster, "slurm2", "2")
    state = job.wait(timeout=RUN_S)
    output = job.output()
    assert state["JobState"] == "COMPLETED", output[-6000:]
    assert sorted(job.nodes()) == [h.name for h in cluster.hosts[:2]]
    assert "2 node(s) x 2 task(s) = 4 workers" in output
    assert_reference_weights(reference, workdir, 4)


def test_a_warning_signal_checkpoints_requeues_and_resumes_on_both_hosts(
        multinode_slurm, cluster, reference):
    job, workdir = submit(multinode_slurm, cluster, "slurm-usr1", "2", env=SLOW)
    job.wait_for_output(r"^step 10/30", RUN_S)  # mid-training: slowed from here on
    job.cancel(signal="USR1", batch=True)  # what Slurm sends --warning_s before the limit
    requeued = seen(job, r"requeueing job")
    resumed = seen(job, r"run 2,[\s\S]*^step \d+/30: ")
    state = job.wait(timeout=RUN_S)
    output = job.output()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", output[-6000:]
    step = int(re.search(r"preempted at step (\d+); a checkpoint", output).group(1))
    assert 0 < step < STEPS
    assert resumed_step(output) == step
    assert re.search(r"run 2, nodes .*\(2 node\(s\) x 2 task\(s\) = 4 workers\)", output), output
    assert sorted(job.nodes()) == [h.name for h in cluster.hosts[:2]]
    assert_reference_weights(reference, workdir, 4)
    print(f"\n[measured] 2 hosts: requeue -> first resumed window seen {resumed - requeued:.1f} s "
          f"(resumed at step {step})")


def test_a_host_lost_mid_job_requeues_it_onto_the_remaining_host(multinode_slurm, cluster,
                                                                  reference):
    kept, lost = cluster.hosts[:2]
    job, workdir = submit(multinode_slurm, cluster, "slurm-lost", "1-2", [EVERY_5], env=SLOW)
    job.wait_for_output(r"2 node\(s\) x 2 task\(s\) = 4 workers", RUN_S)
    job.wait_for_output(r"checkpoint of step \d+ ->", RUN_S)
    cluster.partition(lost)
    deadline = time.monotonic() + RUN_S
    while int(job.state().get("Restarts", "0")) < 1:  # Slurm noticed: NODE_FAIL, requeued
        assert time.monotonic() < deadline, (job.state(), job.output()[-6000:])
        time.sleep(0.3)
    requeued = time.monotonic()
    pattern = r"\(1 node\(s\) x 2 task\(s\) = 2 workers\)"
    resumed = seen(job, pattern + r"[\s\S]*^step \d+/30: ")
    state = job.wait(timeout=RUN_S)
    output = job.output()
    assert state["JobState"] == "COMPLETED", output[-6000:]
    assert job.nodes() == [kept.name]
    last_run = output[re.search(pattern, output).start():]
    assert resumed_step(last_run) > 0
    diff = assert_reference_weights(reference, workdir, 2)
    print(f"\n[measured] 1 host: requeue (Restarts seen) -> first resumed window seen "
          f"{resumed - requeued:.1f} s (resumed at step {resumed_step(last_run)}, "
          f"restarts {state['Restarts']}); 4 -> 2 workers max|dw| {diff:.2e}")


def test_a_spot_host_lost_mid_job_requeues_onto_another_host_resuming_from_the_bucket(
        multinode_slurm, cluster, gcs, reference, tmp_path):
    """The spot-VM case: the workdir is gs://, the job's host (with its local disk) is
    lost, Slurm requeues the job onto the other host, which resumes from the bucket."""
    prefix = f"slurm-spot-{cluster.ports()[0]}"
    job, _ = submit(multinode_slurm, cluster, "slurm-spot", "1", [EVERY_5],
                    env={**SLOW, **gcs.client_env()}, workdir=f"gs://{BUCKET}/{prefix}")
    # An async save is logged when issued; the next one starts once it is committed.
    committed = int(job.wait_for_output(r"checkpoint of step (\d+) ->", RUN_S).group(1))
    job.wait_for_output(rf"checkpoint of step {committed + 5} ->", RUN_S)
    (first,) = job.nodes()
    cluster.partition(first)  # the machine and its local disk are gone
    state = job.wait(timeout=LOST_S + RUN_S)
    output = job.output()
    assert state["JobState"] == "COMPLETED", output[-6000:]
    (second,) = job.nodes()
    assert second != first, (first, second)
    step = resumed_step(output)
    assert committed <= step < STEPS, output[-6000:]
    fetch(cluster, gcs, prefix, tmp_path, host=second)  # the lost host has no route
    assert_reference_weights(reference, tmp_path, 2)
