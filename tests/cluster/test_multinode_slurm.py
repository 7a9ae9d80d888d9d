"""Slurm across the simulated hosts: one slurmd per host, slurmctld on the head node.

Jobs land on separate hosts, see their host's node-local directories, get signals from
``scancel``, and a host lost mid-job (cut off the network or crashed) is marked DOWN and
its job requeued; a ``--nodes 1-2`` job then finishes on the host that is left.

Measured (printed; ``-s`` shows them, never asserted): seconds from losing a host to
Slurm marking it DOWN.
"""

from __future__ import annotations

import re

import pytest

LOST_NODE_S = 60  # bound for Slurm to notice a lost host (SlurmdTimeout=5; ~11 s seen)
JOB_S = 60  # bound for a shell job to start, or to be requeued and start again

# Prints one line per task: its rank, hostname, address and node-local TFDS directory.
WHERE_AM_I = """#!/bin/bash
echo "batch on $(hostname)"
srun bash -c 'echo "task $SLURM_PROCID $(hostname) $(hostname -i) $TFDS_DATA_DIR"'
"""
# One task per node, each says so, then waits to be killed.
ON_BOTH_NODES = """#!/bin/bash
srun bash -c 'echo "task $SLURM_PROCID up"; exec sleep 600'
"""
# First run: holds both nodes until killed. After a requeue: prints where it ran, ends.
UNTIL_REQUEUED = """#!/bin/bash
echo "run ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST ($SLURM_JOB_NUM_NODES nodes)"
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then exit 0; fi
srun bash -c 'echo "task $SLURM_PROCID up"; exec sleep 600'
"""


def test_a_two_node_job_runs_one_task_on_each_host(multinode_slurm, cluster):
    job = multinode_slurm.submit(WHERE_AM_I, "--nodes=2", "--ntasks-per-node=1",
                                 directory=cluster.shared_dir("where"))
    state = job.wait(timeout=JOB_S)
    assert state["JobState"] == "COMPLETED", job.output()
    tasks = sorted(re.findall(r"^task (\d) (\S+) (\S+) (\S+)$", job.output(), re.M))
    assert [t[1:] for t in tasks] == [(h.name, h.address, str(h.tfds_data_dir))
                                      for h in cluster.hosts[:2]], job.output()
    assert sorted(job.nodes()) == [h.name for h in cluster.hosts[:2]]


def test_scancel_signals_the_batch_script_on_its_host(multinode_slurm, cluster):
    script = """#!/bin/bash
trap 'echo "USR1 on $(hostname)"; exit 0' USR1
echo started
while true; do sleep 0.2; done
"""
    job = multinode_slurm.submit(script, "--nodes=1", directory=cluster.shared_dir("signal"))
    job.wait_for_output(r"^started$", timeout=JOB_S)
    job.cancel(signal="USR1", batch=True)
    state = job.wait(timeout=JOB_S)
    assert state["JobState"] == "COMPLETED", job.output()
    assert f"USR1 on {job.nodes()[0]}" in job.output()


@pytest.mark.parametrize("lose", ["partition", "kill_all"])
def test_a_lost_host_is_marked_down_and_its_job_requeued(lose, multinode_slurm, cluster):
    lost = cluster.hosts[1]
    job = multinode_slurm.submit(ON_BOTH_NODES, "--nodes=2", "--requeue",
                                 directory=cluster.shared_dir("lost"))
    for rank in (0, 1):  # the step runs on both hosts
        job.wait_for_output(rf"^task {rank} up$", timeout=JOB_S)
    getattr(cluster, lose)(lost)  # cut off the network, or every process killed
    seconds = multinode_slurm.wait_node_state(lost, {"down"}, timeout=LOST_NODE_S)
    print(f"\n[measured] {lose}: {lost.name} marked down after {seconds:.1f} s")
    state = job.wait({"PENDING", "RUNNING"}, timeout=JOB_S)
    assert int(state["Restarts"]) >= 1, state
    multinode_slurm.cleanup()  # heals or restarts the host's slurmd
    assert multinode_slurm.node_state(lost) == "idle"


def test_a_min_max_job_finishes_on_the_remaining_host(multinode_slurm, cluster):
    kept, lost = cluster.hosts[:2]
    job = multinode_slurm.submit(UNTIL_REQUEUED, "--nodes=1-2", "--requeue",
                                 directory=cluster.shared_dir("minmax"))
    job.wait_for_output(r"^run 0 on .* \(2 nodes\)$", timeout=JOB_S)
    for rank in (0, 1):
        job.wait_for_output(rf"^task {rank} up$", timeout=JOB_S)
    cluster.partition(lost)
    state = job.wait(timeout=LOST_NODE_S + JOB_S)
    assert state["JobState"] == "COMPLETED", job.output()
    assert state["Restarts"] == "1", state
    assert job.output().strip() == f"run 1 on {kept.name} (1 nodes)"
