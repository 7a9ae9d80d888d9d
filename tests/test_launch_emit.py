"""Specification of the cluster outputs: ``--emit tf_config | slurm | tfjob``.

Every output is parsed and checked field by field; the SLURM script is also executed
with stand-ins for ``srun`` and ``scontrol``, so the TF_CONFIG its tasks derive is real.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from launch import cluster as cluster_lib
from launch import multiworker
from launch.tf_config import validate_tf_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--config=models/configs/digits.py", "--workdir=/shared/run", "--config.train.steps=9"]


def emit(args, capsys):
    code = multiworker.main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_tf_config_names_every_host_as_a_task_in_order(capsys):
    code, out, err = emit(["--hosts", "10.0.0.1:2222,10.0.0.2:2222,10.0.0.3", "--port", "3333",
                           "--emit", "tf_config"], capsys)
    assert code == 0, err
    configs = json.loads(out)
    assert list(configs) == ["worker:0", "worker:1", "worker:2"]
    cluster = {"worker": ["10.0.0.1:2222", "10.0.0.2:2222", "10.0.0.3:3333"]}
    for index, (name, tf_config) in enumerate(configs.items()):
        validate_tf_config(tf_config)
        assert tf_config["cluster"] == cluster
        assert tf_config["task"] == {"type": "worker", "index": index}
    assert len(out.strip().splitlines()) == 3 + 2  # one task per line between the braces
    assert "no authentication and no encryption" in err


def test_tf_config_with_chief_and_evaluator_takes_the_first_and_last_host(capsys):
    code, out, err = emit(["--hosts", "10.0.0.1:1,10.0.0.2:1,10.0.0.3:1,10.0.0.4:1",
                           "--chief", "--evaluator", "--emit", "tf_config"], capsys)
    assert code == 0, err
    configs = json.loads(out)
    assert list(configs) == ["chief:0", "worker:0", "worker:1", "evaluator:0"]
    assert configs["chief:0"]["cluster"] == {
        "chief": ["10.0.0.1:1"], "worker": ["10.0.0.2:1", "10.0.0.3:1"],
        "evaluator": ["10.0.0.4:1"]}
    assert configs["evaluator:0"]["task"] == {"type": "evaluator", "index": 0}


def test_tf_config_checks_workers_against_the_hosts(capsys):
    code, _, err = emit(["--hosts", "10.0.0.1:1,10.0.0.2:1", "--workers", "3",
                         "--emit", "tf_config"], capsys)
    assert code == 2
    assert "--workers=3 but --hosts gives 2 training task(s)" in err


def test_public_host_is_refused_without_allow_public_bind(capsys):
    code, out, err = emit(["--hosts", "10.0.0.1:1,8.8.8.8:1", "--emit", "tf_config"], capsys)
    assert code == 2 and out == ""
    assert "'8.8.8.8' (8.8.8.8), a public address" in err
    assert "--allow_public_bind" in err


def test_public_host_is_accepted_with_allow_public_bind_and_a_warning(capsys):
    code, out, err = emit(["--hosts", "10.0.0.1:1,8.8.8.8:1", "--emit", "tf_config",
                           "--allow_public_bind"], capsys)
    assert code == 0
    assert json.loads(out)["worker:1"]["cluster"]["worker"][1] == "8.8.8.8:1"
    assert "host '8.8.8.8' is public" in err


@pytest.mark.parametrize("host", ["127.0.0.1", "192.168.1.5", "172.16.0.9", "100.64.1.1",
                                  "[fd00::5]", "localhost"])
def test_private_and_loopback_hosts_are_accepted(host):
    assert cluster_lib.check_private_hosts([f"{host}:2222"]) == []


def test_unspecified_address_is_refused():
    with pytest.raises(cluster_lib.ClusterError, match="no peer can connect to"):
        cluster_lib.check_private_hosts(["0.0.0.0:2222"])


def test_unresolvable_host_gives_a_warning_not_an_error():
    warnings = cluster_lib.check_private_hosts(["no-such-host.invalid:2222"])
    assert len(warnings) == 1 and "cannot check" in warnings[0]


def test_malformed_host_entry_is_refused(capsys):
    code, _, err = emit(["--hosts", "10.0.0.1:1,,10.0.0.2:1", "--emit", "tf_config"], capsys)
    assert code == 2 and "empty entry" in err
    code, _, err = emit(["--hosts", "10.0.0.1:99999", "--emit", "tf_config"], capsys)
    assert code == 2 and "1..65535" in err


def test_tfjob_manifest_has_chief_workers_image_and_command(capsys):
    code, out, err = emit(["--workers", "4", "--chief", "--evaluator", "--emit", "tfjob",
                           "--image", "registry.example/trainer:1", "--job_name", "digits",
                           "--max_restarts", "2", *FLAGS], capsys)
    assert code == 0, err
    manifest = json.loads(out)  # JSON is YAML: kubectl takes it as it is
    assert manifest["apiVersion"] == "kubeflow.org/v1"
    assert manifest["kind"] == "TFJob"
    assert manifest["metadata"]["name"] == "digits"
    assert manifest["spec"]["runPolicy"]["backoffLimit"] == 2
    specs = manifest["spec"]["tfReplicaSpecs"]
    assert {k: v["replicas"] for k, v in specs.items()} == {"Chief": 1, "Worker": 3,
                                                            "Evaluator": 1}
    for spec in specs.values():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow"
        assert container["image"] == "registry.example/trainer:1"
        assert container["command"] == ["python", "-m", "trainer.main", *FLAGS,
                                        "--config.distribute.strategy=multi_worker"]


def test_tfjob_without_chief_has_only_workers(capsys):
    code, out, _ = emit(["--workers", "2", "--emit", "tfjob", "--image", "img"], capsys)
    assert code == 0
    assert {k: v["replicas"] for k, v in json.loads(out)["spec"]["tfReplicaSpecs"].items()} \
        == {"Worker": 2}


def test_tfjob_needs_an_image(capsys):
    code, _, err = emit(["--workers", "2", "--emit", "tfjob"], capsys)
    assert code == 2 and "--emit tfjob needs --image" in err


def test_emit_writes_to_output_file(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    code, out, _ = emit(["--workers", "2", "--emit", "tfjob", "--image", "img",
                         "--output", str(path)], capsys)
    assert code == 0 and out == ""
    assert json.loads(path.read_text())["kind"] == "TFJob"


def test_slurm_header_asks_for_one_task_per_node(capsys):
    code, out, err = emit(["--workers", "3", "--emit", "slurm", "--job_name", "digits", *FLAGS],
                          capsys)
    assert code == 0, err
    assert out.startswith("#!/bin/bash\n")
    header = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", out, re.M))
    assert header == {"job-name": "digits", "nodes": "3", "ntasks-per-node": "1",
                      "output": "digits-%j.out"}
    assert "no authentication and no encryption" in out


def _fake_slurm_bin(tmp_path, nodes):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        [ "$1 $2" = "show hostnames" ] || exit 9
        for i in $(seq 1 {nodes}); do echo "node$i"; done
        """))
    (bin_dir / "srun").write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, subprocess, sys
        args = sys.argv[1:]
        while args[0].startswith("--"):
            args.pop(0)
        env = dict(os.environ, SLURM_NTASKS="{nodes}", SLURM_JOB_NODELIST="node[1-{nodes}]")
        procs = [subprocess.Popen(args, env=dict(env, SLURM_PROCID=str(i)),
                                  stdout=subprocess.PIPE) for i in range({nodes})]
        outputs = [p.communicate()[0] for p in procs]  # one task's lines after another
        sys.stdout.buffer.write(b"".join(outputs))
        sys.exit(max(p.returncode for p in procs))
        """))
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("chief", [False, True])
def test_slurm_script_tasks_derive_a_tf_config_naming_every_task(tmp_path, capsys, chief):
    args = ["--workers", "3", "--emit", "slurm", "--port", "4321",
            "--module", "tests.launch_helpers.fake_worker", *FLAGS]
    code, script, err = emit(args + (["--chief"] if chief else []), capsys)
    assert code == 0, err
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", script, re.M).group(1))
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    bin_dir = _fake_slurm_bin(tmp_path, nodes)
    env = dict(os.environ, PYTHONPATH=REPO, FAKE_PLAN=json.dumps({"*": {"seconds": 0}}),
               PATH=f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}"
                    f"{os.environ['PATH']}")
    env.pop("TF_CONFIG", None)
    result = subprocess.run(["bash", str(path)], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    configs = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
               if line.startswith("TF_CONFIG ")]
    addresses = ["node1:4321", "node2:4321", "node3:4321"]
    expected = ({"chief": addresses[:1], "worker": addresses[1:]} if chief
                else {"worker": addresses})
    assert len(configs) == 3
    for tf_config in configs:
        validate_tf_config(tf_config)
        assert tf_config["cluster"] == expected
    tasks = sorted((c["task"]["type"], c["task"]["index"]) for c in configs)
    assert tasks == sorted(cluster_lib.cluster_tasks(expected)[i][:2] for i in range(3))
    argv_lines = [l for l in result.stdout.splitlines() if l.startswith("started ")]
    assert all(json.loads(l.split(" ", 3)[3]) == [*FLAGS, "--config.distribute.strategy=multi_worker"]
               for l in argv_lines)


@pytest.mark.parametrize("args, message", [
    (["--emit", "tf_config"], "--emit tf_config needs --hosts"),
    (["--emit", "slurm"], "--emit slurm needs --workers N"),
    (["--emit", "slurm", "--workers", "2", "--hosts", "a:1"], "the scheduler picks the hosts"),
])
def test_emit_usage_errors(args, message, capsys):
    code, _, err = emit(args, capsys)
    assert code == 2 and message in err
