"""Specification of the per-host launcher's cluster: every host builds the same TF_CONFIG
cluster, runs its own tasks on its own ports, and refuses flags that cannot work.

Usage errors go through ``launch.multiworker.main`` (exit 2, the reason on stderr); the
layout itself through ``launch.hosts.host_layout``.
"""

import json
import re
import socket

import pytest

from launch import data_service, hosts, multiworker
from launch.group import StartError, task_specs
from launch.supervision import GroupResult
from tf_cluster.exit_codes import EXIT_PEER_LOST

HOSTS = "127.0.0.1,127.0.0.2"


def test_two_hosts_with_two_tasks_each_share_one_cluster_with_their_own_tasks_and_ports():
    layouts = [hosts.host_layout(HOSTS, rank, 2, port=23456) for rank in (0, 1)]
    assert layouts[0].cluster == layouts[1].cluster == {"worker": [
        "127.0.0.1:23456", "127.0.0.1:23457", "127.0.0.2:23456", "127.0.0.2:23457"]}
    assert layouts[0].local_tasks == ["worker:0", "worker:1"]
    assert layouts[1].local_tasks == ["worker:2", "worker:3"]
    for layout in layouts:
        specs = task_specs(layout.cluster, "m", ["--config=c.py"], only=layout.local_tasks)
        configs = [json.loads(s.env["TF_CONFIG"]) for s in specs]
        assert [s.name for s in specs] == layout.local_tasks
        assert all(c["cluster"] == layout.cluster for c in configs)
        assert [f"{c['task']['type']}:{c['task']['index']}" for c in configs] \
            == layout.local_tasks


def test_chief_is_task_0_of_host_0_and_the_evaluator_runs_on_the_last_host():
    first = hosts.host_layout("10.0.0.1,10.0.0.2,10.0.0.3", 0, 2, port=2000, chief=True,
                              evaluator=True)
    assert first.cluster == {
        "chief": ["10.0.0.1:2000"],
        "worker": ["10.0.0.1:2001", "10.0.0.2:2000", "10.0.0.2:2001", "10.0.0.3:2000",
                   "10.0.0.3:2001"],
        "evaluator": ["10.0.0.3:2002"]}
    assert first.local_tasks == ["chief:0", "worker:0"]
    last = hosts.host_layout("10.0.0.1,10.0.0.2,10.0.0.3", 2, 2, port=2000, chief=True,
                             evaluator=True)
    assert last.local_tasks == ["worker:3", "worker:4", "evaluator:0"]


def test_a_host_entry_with_a_port_uses_it_as_that_hosts_base_port():
    layout = hosts.host_layout("127.0.0.1:24000,127.0.0.2:24010", 1, 2)
    assert layout.cluster["worker"] == ["127.0.0.1:24000", "127.0.0.1:24001",
                                        "127.0.0.2:24010", "127.0.0.2:24011"]


def test_the_default_base_port_is_documented_and_used():
    layout = hosts.host_layout(HOSTS, 0, 1)
    assert layout.cluster["worker"] == [f"127.0.0.1:{hosts.DEFAULT_PORT}",
                                        f"127.0.0.2:{hosts.DEFAULT_PORT}"]
    assert str(hosts.DEFAULT_PORT) in multiworker.__doc__


def test_the_data_service_runs_on_host_0_and_every_host_points_at_it():
    layouts = [hosts.host_layout(HOSTS, rank, 2, port=3000, data_service_workers=2)
               for rank in (0, 1)]
    assert layouts[0].dispatcher == layouts[1].dispatcher == "127.0.0.1:3003"
    workers = [s for s in data_service.service_specs(3003, 2, True, host="127.0.0.1")
               if s.name.startswith(data_service.WORKER)]
    # Service workers tell the dispatcher the address other hosts reach them at.
    assert [s.argv[-2:] for s in workers] == [["--address", "127.0.0.1"]] * 2


@pytest.mark.parametrize("args, message", [
    (["--hosts", HOSTS, "--node_rank", "2"], "--node_rank=2 is out of range for 2 host(s)"),
    (["--hosts", HOSTS, "--node_rank", "-1"], "--node_rank=-1 is out of range"),
    (["--hosts", "127.0.0.1,127.0.0.2,127.0.0.1", "--node_rank", "0"],
     "--hosts lists 127.0.0.1 twice (entries 0 and 2)"),
    (["--hosts", HOSTS], "--hosts without --node_rank"),
    (["--node_rank", "0", "--workers", "2"], "--node_rank I needs --hosts"),
    (["--hosts", "8.8.8.8,127.0.0.2", "--node_rank", "1"], "a public address"),
    (["--hosts", HOSTS, "--node_rank", "0", "--tasks_per_node", "0"],
     "--tasks_per_node=0 must be >= 1"),
    (["--hosts", HOSTS, "--node_rank", "0", "--tasks_per_node", "2", "--workers", "3"],
     "--workers=3 but --hosts x --tasks_per_node gives 4 training task(s)"),
    (["--hosts", HOSTS, "--node_rank", "0", "--port", "65535"], "go beyond 65535"),
    (["--hosts", HOSTS, "--node_rank", "0", "--emit", "tf_config"],
     "--node_rank starts this host's tasks"),
])
def test_per_host_usage_errors_exit_2_with_the_reason(args, message, capsys):
    assert multiworker.main(args) == 2
    assert message in capsys.readouterr().err


def test_a_public_address_is_accepted_with_allow_public_bind():
    args = multiworker.parse(["--hosts", "8.8.8.8,127.0.0.2", "--node_rank", "1",
                              "--allow_public_bind"])
    assert args.mode == "hosts"
    assert any("is public" in warning for warning in args.warnings)


def test_an_address_that_is_not_this_machines_is_refused_before_any_task_starts():
    layout = hosts.host_layout("127.0.0.1,192.0.2.77", 1, 1)  # TEST-NET-1: never local
    with pytest.raises(StartError, match=r"--hosts entry 1 \(192.0.2.77\) is not an address "
                                         r"of this machine") as raised:
        hosts.check_this_host(layout)
    assert raised.value.exit_code == 2


def test_a_taken_port_of_this_host_is_named_with_its_holder():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        layout = hosts.host_layout(f"127.0.0.2,127.0.0.1:{port - 1}", 1, 2)
        with pytest.raises(StartError) as raised:
            hosts.check_this_host(layout)
    assert re.search(rf"port {port} of this host \(127.0.0.1\) is taken \(Address already in "
                     rf"use, held by pid \d+", str(raised.value)), str(raised.value)


def test_a_lost_peer_named_by_the_task_is_mapped_to_its_host():
    layout = hosts.host_layout(HOSTS, 0, 2, port=23456)
    result = GroupResult(EXIT_PEER_LOST, "worker:0 exited with code 170", "worker:0",
                         watched=("E1202 trainer] Lost peer: worker:3 (127.0.0.2:23457) "
                                  "stopped responding",))
    explained = hosts.explain_failure(result, layout)
    assert explained.exit_code == EXIT_PEER_LOST
    assert explained.reason == (
        "worker:0 exited with code 170; lost peer worker:3 on host 127.0.0.2 (node_rank 1: "
        "worker:3 at 127.0.0.2:23457), reported by worker:0")


def test_tensorflows_unhealthy_task_report_names_the_lost_peer_too():
    """TensorFlow's report as a surviving task prints it (the lost task on its own line)."""
    lines = [
        "tensorflow.python.framework.errors_impl.UnavailableError: {{function_node "
        "__wrapped__CollectiveReduceV2_device_/job:worker/replica:0/task:1/device:CPU:0}} "
        "Collective ops is aborted by: Error reported from /job:worker/task:0: The following "
        "tasks are unhealthy (stopped sending heartbeats):",
        "/job:worker/replica:0/task:0",
        "The tasks have crashed. Check the task logs for an earlier error, or scheduler "
        "events (e.g. preemption, eviction) to debug further."]
    watched = tuple(l for l in lines if hosts.LOST_PEER_LINE.search(l.encode()))
    assert len(watched) == 2
    layout = hosts.host_layout(HOSTS, 1, 1, port=23456)
    result = GroupResult(1, "worker:1 exited with code 1", "worker:1", watched=watched)
    assert hosts.explain_failure(result, layout).reason == (
        "worker:1 exited with code 1; lost peer worker:0 on host 127.0.0.1 (node_rank 0: "
        "worker:0 at 127.0.0.1:23456), reported by worker:1")


def test_a_peer_host_that_does_not_answer_is_named_when_the_task_names_none():
    with socket.socket() as alive_peer:  # node 1's task answers; node 2's port is closed
        alive_peer.bind(("127.0.0.2", 0))
        alive_peer.listen()
        port = alive_peer.getsockname()[1]
        with socket.socket() as closed:
            closed.bind(("127.0.0.3", 0))
            dead_port = closed.getsockname()[1]
        layout = hosts.host_layout(f"127.0.0.1:{port},127.0.0.2:{port},127.0.0.3:{dead_port}",
                                   0, 1)
        result = GroupResult(1, "worker:0 exited with code 1", "worker:0")
        reason = hosts.explain_failure(result, layout).reason
    assert reason == (f"worker:0 exited with code 1; lost peer: host 127.0.0.3 (node_rank 2: "
                      f"worker:2 at 127.0.0.3:{dead_port}) does not answer")
