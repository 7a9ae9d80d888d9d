"""A workdir that is not shared between hosts: every task stops in bounded time with one
line naming the host and the path, instead of training into checkpoints the chief's
peers cannot read (or that a requeued chief on another host would not find).

Each simulated host gets its own node-local directory as ``--workdir`` (what a path on
a local disk is on a real cluster); the per-host launchers are the ones of
``test_cross_host_training`` (tests/cluster/runs.py).
"""

from __future__ import annotations

import time

from tests.cluster.hosts import Watched
from tests.cluster.runs import CONFIG_FLAG, consecutive_ports, outputs
from tests.support.helpers import last_lines

TIMEOUT_S = 5  # checkpoint.shared_workdir_timeout_s: how long a worker waits for the file
BOUND_S = 180  # start-up of TensorFlow on both hosts + the wait + the group's stop


def test_a_node_local_workdir_stops_every_host_naming_it_and_the_path(cluster):
    hosts = cluster.hosts[:2]
    port = consecutive_ports(cluster, 1)
    workdirs = [host.scratch / f"run-{port}" for host in hosts]
    started = time.monotonic()
    runs = [Watched(cluster.popen(host, [
        "python", "-m", "launch.multiworker", "--hosts", ",".join(h.address for h in hosts),
        "--node_rank", str(rank), "--tasks_per_node", "1", "--port", str(port),
        "--grace_s", "5", CONFIG_FLAG, f"--workdir={workdir}",
        f"--config.checkpoint.shared_workdir_timeout_s={TIMEOUT_S}"]))
        for rank, (host, workdir) in enumerate(zip(hosts, workdirs))]
    codes = [run.finish(BOUND_S) for run in runs]
    elapsed = time.monotonic() - started
    text = outputs(runs)
    assert codes == [1, 1], text[-8000:]
    worker_line = next(line for line in runs[1].lines if "Workdir error" in line)
    assert (f"Workdir error: --workdir={workdirs[1]} is not shared with the chief: "
            f"worker:1 ({hosts[1].address}:{port}) did not see the file .cluster-") \
        in worker_line, text[-8000:]
    assert f"that the chief (worker:0, {hosts[0].address}:{port}) wrote there" in worker_line
    assert "Traceback" not in text and "Internal error" not in text, text[-8000:]
    assert "[launcher] failed" in last_lines(runs[1].output, 1), text[-8000:]
    assert not (workdirs[1] / "checkpoints").exists()  # the worker's host wrote nothing
    assert not list(workdirs[0].glob("checkpoints/*"))  # nor did the chief train
    cluster.assert_no_processes(hosts, allow=cluster.daemons)
    print(f"\n[measured] node-local workdir -> both launchers exited in {elapsed:.1f} s "
          f"(TensorFlow start-up included; the wait is {TIMEOUT_S} s)")
