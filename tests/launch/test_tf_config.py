"""Specification of TF_CONFIG: building and validating it (tf_cluster.tf_config), checking it
and deriving it inside SLURM (``python -m launch.tf_config``, launch.slurm)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from launch.slurm import slurm_visible_gpus, tf_config_from_slurm
from tf_cluster.tf_config import TFConfigError, build_tf_config, parse_address, validate_tf_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = {"chief": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222", "10.0.0.3:2222"]}


def config(cluster=None, task_type="worker", index=0, **extra):
    return {"cluster": CLUSTER if cluster is None else cluster,
            "task": {"type": task_type, "index": index}, **extra}


def run_module(args, env_extra=None, timeout=60):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(PYTHONPATH=REPO, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "launch.tf_config", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_build_returns_cluster_task_and_rpc_layer():
    assert build_tf_config(CLUSTER, "worker", 1) == {
        "cluster": CLUSTER, "task": {"type": "worker", "index": 1}, "rpc_layer": "grpc"}


def test_build_copies_the_address_lists():
    cluster = {"worker": ["h1:1", "h2:1"]}
    built = build_tf_config(cluster, "worker", 0)
    cluster["worker"].append("h3:1")
    assert built["cluster"]["worker"] == ["h1:1", "h2:1"]


def test_valid_config_with_every_task_type_passes():
    validate_tf_config(config({**CLUSTER, "evaluator": ["10.0.0.4:2222"], "ps": ["10.0.0.5:1"]},
                              "evaluator", 0, environment="cloud"))


def test_index_out_of_range_is_rejected_with_the_valid_range():
    with pytest.raises(TFConfigError, match=r"index 2 is out of range for 'worker'.*0\.\.1"):
        validate_tf_config(config(index=2))


def test_negative_index_is_rejected():
    with pytest.raises(TFConfigError, match="out of range"):
        validate_tf_config(config(index=-1))


def test_non_integer_index_is_rejected():
    with pytest.raises(TFConfigError, match="index must be an integer"):
        validate_tf_config(config(index="1"))


def test_duplicate_address_names_both_tasks():
    cluster = {"chief": ["h1:2222"], "worker": ["h2:2222", "H1:2222"]}
    with pytest.raises(TFConfigError, match=r"used twice, by chief:0 and worker:1"):
        validate_tf_config(config(cluster))


def test_missing_chief_is_rejected_only_when_required():
    cluster = {"worker": ["h1:1", "h2:1"]}
    validate_tf_config(config(cluster))
    with pytest.raises(TFConfigError, match="no 'chief' task"):
        validate_tf_config(config(cluster), require_chief=True)


@pytest.mark.parametrize("address, message", [
    ("localhost", "is not 'host:port'"),
    (":2222", "is not 'host:port'"),
    ("h1:", "is not 'host:port'"),
    ("h1:port", "use a number in 1..65535"),
    ("h1:0", "use a number in 1..65535"),
    ("h1:70000", "use a number in 1..65535"),
    ("grpc://h1:2222", "carries a scheme"),
    ("bad host:2222", "not a valid hostname"),
    ("fd00::1:2222", "in brackets"),
    ("[zz::1]:2222", "not an IPv6 address"),
    (2222, "must be a 'host:port' string"),
])
def test_malformed_address_is_rejected(address, message):
    with pytest.raises(TFConfigError, match=message):
        validate_tf_config(config({"worker": [address]}))


def test_ipv6_address_in_brackets_is_accepted():
    assert parse_address("[fd00::1]:2222") == ("fd00::1", 2222)


def test_unknown_task_type_in_cluster_suggests_the_closest():
    with pytest.raises(TFConfigError, match=r"unknown task type 'wroker'.*Did you mean 'worker'"):
        validate_tf_config(config({"wroker": ["h1:1"]}))


def test_unknown_task_type_in_task_is_rejected():
    with pytest.raises(TFConfigError, match=r"task type 'master' is not in the cluster"):
        validate_tf_config(config(task_type="master"))


def test_task_type_missing_from_cluster_is_rejected():
    with pytest.raises(TFConfigError, match=r"'evaluator' is not in the cluster"):
        validate_tf_config(config(task_type="evaluator"))


def test_empty_cluster_is_rejected():
    with pytest.raises(TFConfigError, match="'cluster' is empty"):
        validate_tf_config(config({}))


def test_missing_cluster_is_rejected():
    with pytest.raises(TFConfigError, match="has no 'cluster'"):
        validate_tf_config({"task": {"type": "worker", "index": 0}})


def test_empty_address_list_is_rejected():
    with pytest.raises(TFConfigError, match=r"cluster\['ps'\] is an empty list"):
        validate_tf_config(config({"worker": ["h1:1"], "ps": []}))


def test_cluster_without_training_tasks_is_rejected():
    with pytest.raises(TFConfigError, match="needs at least one 'chief' or 'worker'"):
        validate_tf_config(config({"evaluator": ["h1:1"]}, "evaluator"))


def test_two_chiefs_are_rejected():
    with pytest.raises(TFConfigError, match="at most one chief"):
        validate_tf_config(config({"chief": ["h1:1", "h2:1"]}, "chief"))


def test_missing_task_is_rejected():
    with pytest.raises(TFConfigError, match="'task' must be an object"):
        validate_tf_config({"cluster": CLUSTER})


def test_non_object_is_rejected():
    with pytest.raises(TFConfigError, match="must be a JSON object"):
        validate_tf_config(["worker"])


def test_empty_rpc_layer_is_rejected():
    with pytest.raises(TFConfigError, match="rpc_layer"):
        validate_tf_config(config(rpc_layer=""))


def test_error_is_a_value_error():
    assert issubclass(TFConfigError, ValueError)


def test_build_validates():
    with pytest.raises(TFConfigError, match="out of range"):
        build_tf_config({"worker": ["h1:1"]}, "worker", 1)


def test_check_reports_task_and_answering_and_silent_peers():
    with socket.socket() as listening, socket.socket() as unused:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        unused.bind(("127.0.0.1", 0))  # bound, never listening: connect is refused
        mine, live, dead = 0, listening.getsockname()[1], unused.getsockname()[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            mine = s.getsockname()[1]
        cluster = {"worker": [f"127.0.0.1:{mine}", f"127.0.0.1:{live}", f"127.0.0.1:{dead}"]}
        result = run_module(["--check", "--timeout_s", "1"],
                            {"TF_CONFIG": json.dumps(build_tf_config(cluster, "worker", 0))})
    assert result.returncode == 3, result.stderr
    assert "this process is worker:0 of a cluster of 3 task(s)" in result.stdout
    lines = result.stdout.splitlines()
    assert any("worker:0" in l and "this process; port free to bind" in l for l in lines)
    assert any("worker:1" in l and l.endswith("answers") for l in lines)
    assert any("worker:2" in l and "does not answer" in l for l in lines)


def test_check_exits_0_when_every_peer_answers():
    with socket.socket() as peer:
        peer.bind(("127.0.0.1", 0))
        peer.listen()
        cluster = {"chief": ["127.0.0.1:1"], "worker": [f"127.0.0.1:{peer.getsockname()[1]}"]}
        result = run_module(["--check"],
                            {"TF_CONFIG": json.dumps(build_tf_config(cluster, "chief", 0))})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "this process is chief:0" in result.stdout


def test_check_without_tf_config_fails_with_advice():
    result = run_module(["--check"])
    assert result.returncode == 1
    assert "TF_CONFIG is not set" in result.stderr


def test_check_with_invalid_tf_config_prints_the_reason():
    bad = json.dumps(config({"worker": ["h1:1"]}, index=3))
    result = run_module(["--check"], {"TF_CONFIG": bad})
    assert result.returncode == 1
    assert "index 3 is out of range" in result.stderr


def test_check_with_non_json_tf_config_says_so():
    result = run_module(["--check"], {"TF_CONFIG": "{worker"})
    assert result.returncode == 1
    assert "not valid JSON" in result.stderr


SLURM_ENV = {"SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "node[1-3]"}


def test_from_slurm_maps_procid_to_the_host_list():
    hosts = ["node1", "node2", "node3"]
    got = tf_config_from_slurm({**SLURM_ENV, "SLURM_PROCID": "2"}, 5000, hostnames=hosts)
    assert got["cluster"] == {"worker": ["node1:5000", "node2:5000", "node3:5000"]}
    assert got["task"] == {"type": "worker", "index": 2}


def test_from_slurm_with_chief_makes_task_0_the_chief():
    hosts = ["node1", "node2", "node3"]
    chief = tf_config_from_slurm({**SLURM_ENV, "SLURM_PROCID": "0"}, 5000, True, hosts)
    worker = tf_config_from_slurm({**SLURM_ENV, "SLURM_PROCID": "1"}, 5000, True, hosts)
    assert chief["cluster"] == {"chief": ["node1:5000"], "worker": ["node2:5000", "node3:5000"]}
    assert chief["task"] == {"type": "chief", "index": 0}
    assert worker["task"] == {"type": "worker", "index": 0}


def test_from_slurm_checks_the_task_count_against_tasks_per_node():
    with pytest.raises(TFConfigError, match=r"3 task\(s\) on 1 node\(s\), but 1 task\(s\) per "
                                            r"node were expected.*--ntasks-per-node=1"):
        tf_config_from_slurm({**SLURM_ENV, "SLURM_PROCID": "0"}, 5000, hostnames=["n1"])
    with pytest.raises(TFConfigError, match="2 task\\(s\\) per node were expected"):
        tf_config_from_slurm({**SLURM_ENV, "SLURM_PROCID": "0"}, 5000, hostnames=["n1", "n2"],
                             tasks_per_node=2)


TWO_BY_TWO = {"SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "node[1-2]"}


@pytest.mark.parametrize("procid", range(4))
def test_from_slurm_with_two_tasks_per_node_gives_local_task_i_port_base_plus_i(procid):
    env = {**TWO_BY_TWO, "SLURM_PROCID": str(procid), "SLURM_NODEID": str(procid // 2),
           "SLURM_LOCALID": str(procid % 2)}
    got = tf_config_from_slurm(env, 5000, hostnames=["node1", "node2"], tasks_per_node=2)
    assert got["cluster"] == {"worker": ["node1:5000", "node1:5001", "node2:5000",
                                         "node2:5001"]}
    assert got["task"] == {"type": "worker", "index": procid}
    address = got["cluster"]["worker"][procid]
    assert address == f"node{procid // 2 + 1}:{5000 + procid % 2}"


def test_from_slurm_with_two_tasks_per_node_and_a_chief():
    env = {**TWO_BY_TWO, "SLURM_PROCID": "1", "SLURM_NODEID": "0", "SLURM_LOCALID": "1"}
    got = tf_config_from_slurm(env, 5000, True, ["node1", "node2"], tasks_per_node=2)
    assert got["cluster"] == {"chief": ["node1:5000"],
                              "worker": ["node1:5001", "node2:5000", "node2:5001"]}
    assert got["task"] == {"type": "worker", "index": 0}


def test_from_slurm_refuses_a_task_placed_out_of_blocks():
    env = {**TWO_BY_TWO, "SLURM_PROCID": "1", "SLURM_NODEID": "1", "SLURM_LOCALID": "0"}
    with pytest.raises(TFConfigError, match="--distribution=block"):
        tf_config_from_slurm(env, 5000, hostnames=["node1", "node2"], tasks_per_node=2)


@pytest.mark.parametrize("env, devices, expected", [
    ({"SLURM_LOCALID": "1"}, ["0", "1"], "1"),                               # one GPU per task
    ({"SLURM_LOCALID": "0", "CUDA_VISIBLE_DEVICES": "4,5"}, [], "4"),        # --gres=gpu:2
    ({"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, [], "6,7"),  # 2 GPUs per task
    ({"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "3", "SLURM_GPUS_PER_TASK": "1"},
     ["0", "1"], None),                                                      # bound by SLURM
    ({"SLURM_LOCALID": "1"}, [], None),                                      # no GPU: CPU tasks
])
def test_slurm_visible_gpus_gives_each_local_task_its_own(env, devices, expected):
    assert slurm_visible_gpus(env, 2, gpu_devices=devices) == expected


def test_slurm_visible_gpus_leaves_one_task_per_node_alone():
    assert slurm_visible_gpus({"SLURM_LOCALID": "0", "CUDA_VISIBLE_DEVICES": "0,1"}, 1) is None


def test_slurm_visible_gpus_refuses_an_uneven_split():
    with pytest.raises(TFConfigError, match="3 GPU.*cannot be split evenly.*--gres=gpu:2"):
        slurm_visible_gpus({"SLURM_LOCALID": "0", "CUDA_VISIBLE_DEVICES": "0,1,2"}, 2)


def test_from_slurm_outside_slurm_says_so():
    with pytest.raises(TFConfigError, match="not inside a SLURM job step"):
        tf_config_from_slurm({}, 5000, hostnames=["n1"])


def test_from_slurm_command_expands_the_nodelist_with_scontrol(tmp_path):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\n[ \"$1 $2 $3\" = 'show hostnames node[1-2]' ] && "
                        "printf 'node1\\nnode2\\n'\n")
    scontrol.chmod(0o755)
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[1-2]",
           "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    result = run_module(["--from_slurm", "--port", "7000", "--", sys.executable, "-c",
                         "import os; print(os.environ['TF_CONFIG'])"], env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == build_tf_config(
        {"worker": ["node1:7000", "node2:7000"]}, "worker", 1)


def test_from_slurm_command_with_tasks_per_node_sets_the_port_and_the_gpu(tmp_path):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\nprintf 'node1\\n'\n")
    scontrol.chmod(0o755)
    env = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
           "SLURM_JOB_NODELIST": "node1", "CUDA_VISIBLE_DEVICES": "2,3",
           "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    result = run_module(["--from_slurm", "--port", "7000", "--tasks_per_node", "2", "--",
                         sys.executable, "-c", "import os; print(os.environ['TF_CONFIG']); "
                         "print(os.environ['CUDA_VISIBLE_DEVICES'])"], env)
    assert result.returncode == 0, result.stderr
    tf_config, gpus = result.stdout.splitlines()
    assert json.loads(tf_config) == build_tf_config(
        {"worker": ["node1:7000", "node1:7001"]}, "worker", 1)
    assert gpus == "3"
    assert "gets CUDA_VISIBLE_DEVICES=3" in result.stderr
