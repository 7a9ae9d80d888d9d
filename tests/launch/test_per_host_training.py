"""The per-host launcher with the real trainer: two "hosts" on this machine's loopback
addresses (127.0.0.1 and 127.0.0.2), one launcher each, as on two machines.

Each test starts real TensorFlow processes (MultiWorkerMirroredStrategy, one CPU device
per worker). TensorFlow's gRPC server binds 0.0.0.0, so the two "hosts" get different
base ports (``--hosts 127.0.0.1:P0,127.0.0.2:P1``); on real hosts one ``--port`` does.
The reference weights are one process's (the session fixture ``launcher_reference_weights``).
"""

import os
import re
import signal

from launch.local_group import pick_free_ports
from tests.support.helpers import assert_same_weights
from tests.launch_helpers.running import Launch, wait_until_dead

CONFIG = "--config=tests/launch_helpers/weights_config.py"
RUN_S = 300  # generous bound for a healthy group to finish its 30 steps on 2 shared cores
BOUND_S = 120  # a lost peer ends the surviving launcher within this (TF notices in <= ~10 s)
LONG = "--config.train.steps=100000"
PROGRESS = r"^\[worker:0\] .*step \d+/100000"  # worker:0, the chief, logs progress


def per_host(hosts, rank, workdir, flags=(), extra=()):
    return Launch("launch.multiworker",
                  ["--hosts", hosts, "--node_rank", str(rank), "--tasks_per_node", "1",
                   "--grace_s", "2", *extra, CONFIG, f"--workdir={workdir}", *flags])


def two_hosts():
    first, second = pick_free_ports(2)
    return f"127.0.0.1:{first},127.0.0.2:{second}", second


def test_two_hosts_train_to_the_same_weights_as_one_process(tmp_path,
                                                            launcher_reference_weights):
    hosts, _ = two_hosts()
    launchers = [per_host(hosts, rank, tmp_path) for rank in (0, 1)]
    codes = [run.finish(RUN_S) for run in launchers]
    assert codes == [0, 0], "\n".join(run.output[-4000:] for run in launchers)
    assert "node_rank 1 of 2: starting 1 task(s) on 127.0.0.2: worker:1=" \
        in launchers[1].output
    for task in ("worker-0", "worker-1"):
        assert_same_weights(launcher_reference_weights, tmp_path / f"weights-{task}.npz")


def test_a_killed_peer_host_ends_the_surviving_launcher_naming_the_lost_host(tmp_path):
    hosts, second_port = two_hosts()
    survivor, peer = (per_host(hosts, rank, tmp_path, [LONG]) for rank in (0, 1))
    survivor.wait_for(PROGRESS, RUN_S)
    pids = {**survivor.task_pids(), **peer.task_pids()}
    os.kill(peer.proc.pid, signal.SIGKILL)  # the host's launcher; its tasks die with it
    code = survivor.finish(BOUND_S)
    assert code != 0, survivor.output[-6000:]
    last = survivor.lines[-1]
    assert last.startswith("[launcher] failed: worker:0 "), survivor.output[-6000:]
    assert re.search(rf"lost peer:? (worker:1 on )?host 127\.0\.0\.2 \(node_rank 1: worker:1 "
                     rf"at 127\.0\.0\.2:{second_port}\)", last), last
    assert last.endswith(f"(exit status {code}).")
    if code == 170:  # the trainer reports a lost peer with its own status
        assert "Lost peer: worker:1" in survivor.output
    assert wait_until_dead(pids.values(), 10) == []
