"""The simulated hosts are separate machines on a real network stack.

Each host is a network namespace (tests/cluster/netns_hosts.sh): these tests show that
hosts reach each other by name over TCP, that a partitioned host is unreachable until it
is healed, that node-local disks are separate and the shared one is shared, that
teardown leaves nothing behind, and that MultiWorkerMirroredStrategy trains across two
hosts with a TF_CONFIG that names their addresses.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from tests.cluster.hosts import SimulatedCluster
from tests.cluster.runs import CONFIG_FLAG, connect
from tests.support.helpers import load_weights

# Accepts connections until killed; prints "listening" once, then each peer's address.
SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    conn, peer = server.accept()
    conn.sendall(socket.gethostname().encode())
    conn.close()
    print(peer[0], flush=True)
"""
TRAIN_S = 180  # bound for two TensorFlow processes to start and train a few steps


def start_server(cluster: SimulatedCluster, host, port: int) -> subprocess.Popen:
    server = cluster.popen(host, [sys.executable, "-c", SERVER, cluster.host(host).address,
                                  str(port)])
    assert server.stdout.readline().strip() == "listening", server.communicate(timeout=5)
    return server


def test_hosts_reach_each_other_by_name_from_their_own_address(cluster):
    h0, h1 = cluster.hosts[:2]
    (port,) = cluster.ports()
    server = start_server(cluster, h1, port)
    client = connect(cluster, h0, h1.name, port)
    assert client.returncode == 0 and client.stdout.strip() == h1.name, client
    assert server.stdout.readline().strip() == h0.address


def test_hosts_have_their_own_hostname_and_no_way_off_the_bridge(cluster):
    for host in cluster.all_hosts:
        assert cluster.run(host, ["hostname"]).stdout.strip() == host.name
        routes = cluster.run(host, ["ip", "-4", "route", "show"]).stdout
        assert "default" not in routes, routes
        assert routes.split()[0] == host.address.rsplit(".", 1)[0] + ".0/24", routes
    # The bridge: no address in the root namespace, and no port but the hosts' veths.
    bridge = f"{cluster.name}-br"
    assert not subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", bridge],
                              capture_output=True, text=True, check=True).stdout
    ports = subprocess.run(["ip", "-o", "-d", "link", "show", "master", bridge],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(ports) == len(cluster.all_hosts) and all(" veth " in p for p in ports), ports


def test_a_partitioned_host_is_unreachable_until_it_is_healed(cluster):
    h0, h1 = cluster.hosts[:2]
    (port,) = cluster.ports()
    start_server(cluster, h1, port)
    assert connect(cluster, h0, h1.address, port).returncode == 0
    cluster.partition(h1)
    cut = connect(cluster, h0, h1.address, port, timeout=2)
    assert cut.returncode == 1 and cut.stdout.startswith("unreachable"), cut
    back = connect(cluster, h1, h0.address, port, timeout=2)  # nor can it reach out
    assert back.returncode == 1, back
    cluster.heal(h1)
    healed = connect(cluster, h0, h1.address, port, timeout=10)
    assert healed.returncode == 0 and healed.stdout.strip() == h1.name, healed


def test_node_local_directories_are_separate_and_the_shared_one_is_shared(cluster):
    h0, h1 = cluster.hosts[:2]
    shared = cluster.shared_dir("disks")
    write = 'echo "$CLUSTER_HOST" > "$HOME/mine" && echo "$CLUSTER_HOST" > "$1/from-$CLUSTER_HOST"'
    cluster.run(h0, ["sh", "-c", write, "sh", shared])
    seen = cluster.run(h1, ["sh", "-c", 'echo "$HOME $TFDS_DATA_DIR $TMPDIR"; '
                                        'cat "$HOME/mine" 2>/dev/null || echo absent; '
                                        'cat "$1/from-$2"', "sh", shared, h0.name]).stdout.split()
    assert seen == [str(h1.home), str(h1.tfds_data_dir), str(h1.scratch), "absent", h0.name]
    assert len({h.home for h in cluster.all_hosts}) == len(cluster.all_hosts)
    assert (h0.home / "mine").read_text().strip() == h0.name


def test_kill_all_ends_every_process_of_a_host(cluster):
    h0, h1 = cluster.hosts[:2]
    for host in (h0, h1):
        shell = cluster.popen(host, ["sh", "-c", "sleep 600 & sleep 600 & echo ready; wait"])
        assert shell.stdout.readline().strip() == "ready"
    assert {p.program for p in cluster.processes([h0])} >= {"sh", "sleep"}
    cluster.kill_all(h0)
    cluster.assert_no_processes([h0], allow=cluster.daemons, timeout=0)
    assert any(p.program == "sleep" for p in cluster.processes([h1]))


def test_up_repairs_a_broken_cluster_and_down_leaves_nothing_behind(simulated_cluster, tmp_path):
    # A second, independent cluster (its own names, subnet and disks, derived from the
    # session's); the session's cluster is only asked for its skip/fail decision.
    name = simulated_cluster.name[:6] + "td"
    subnet = "10.214." + simulated_cluster.head.address.split(".")[2]
    other = SimulatedCluster(hosts=2, name=name, subnet=subnet, root=tmp_path)
    other.up()
    try:
        sleeper = other.popen(0, ["sh", "-c", "echo ready; exec sleep 600"])
        assert sleeper.stdout.readline().strip() == "ready"
        other.partition(1)
        # As after a crash half-way through: host 1's cable gone, the head node gone.
        subprocess.run(["ip", "link", "del", f"{name}-v1"], check=True)
        subprocess.run(["ip", "netns", "del", f"{name}-head"], check=True)
        other.up()  # repairs both, keeps host 0's running process
        for peer in (other.hosts[1], other.head):  # reachable: refused, not lost
            refused = connect(other, 0, peer.address, 9, timeout=2)
            assert refused.stdout.startswith("unreachable: ConnectionRefusedError"), refused
        assert [p.program for p in other.processes([0])] == ["sleep"]
    finally:
        other.down()
    other.down()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert name not in namespaces and name not in links
    assert (tmp_path / "hosts" / f"{name}-h0" / "home").is_dir()  # disks kept


def test_two_hosts_train_with_multi_worker_mirrored_strategy(cluster):
    """One trainer.main task per host, TF_CONFIG naming the hosts' addresses."""
    hosts = cluster.hosts[:2]
    ports = cluster.ports(len(hosts))
    workers = [f"{h.address}:{p}" for h, p in zip(hosts, ports)]
    workdir = cluster.shared_dir("multiworker")
    procs = []
    for index, host in enumerate(hosts):
        tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        procs.append(cluster.popen(host, [
            "python", "-m", "trainer.main", CONFIG_FLAG,
            f"--workdir={workdir}", "--config.distribute.strategy=multi_worker",
            "--config.train.steps=10", "--config.distribute.collective_timeout_s=60"],
            env={"TF_CONFIG": json.dumps(tf_config)}))
    outputs = [cluster.finish(proc, TRAIN_S) for proc in procs]
    for host, proc, output in zip(hosts, procs, outputs):
        assert proc.returncode == 0, f"{host.name}:\n{output[-6000:]}"
    assert "replicas in sync: 2" in outputs[0], outputs[0][-3000:]
    # Each host prepared the digits dataset on its own node-local disk.
    for host in hosts:
        assert any(host.tfds_data_dir.iterdir()), host
    w0, w1 = (load_weights(workdir / f"weights-worker-{i}.npz") for i in range(2))
    assert all(np.array_equal(a, b) for a, b in zip(w0, w1))  # in sync across the hosts
