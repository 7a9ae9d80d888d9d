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
from launch import multiworker, slurm
from launch.tfjob import DEFAULT_TFJOB_BACKOFF_LIMIT
from tests.launch_helpers.running import REPO
from tf_cluster import exit_codes
from tf_cluster.tf_config import cluster_tasks, validate_tf_config

EXIT_PREEMPTED = 143  # trainer.main after a preemption save; checked literally
# A global batch that divides over every worker count these tests emit (the launcher
# checks it with trainer.main --check_only --check_replicas).
FLAGS = ["--config=models/configs/digits.py", "--workdir=/shared/run", "--config.train.steps=9",
         "--config.train.global_batch_size=48"]


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
    for kind, spec in specs.items():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow"
        assert container["image"] == "registry.example/trainer:1"
        tail = (["--mode=continuous_eval"] if kind == "Evaluator"
                else ["--config.distribute.strategy=multi_worker"])
        assert container["command"] == ["python", "-m", "trainer.main", *FLAGS, *tail]


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


def sbatch_header(script):
    """``{option: value}`` of the ``#SBATCH --option[=value]`` lines (value None if absent)."""
    return {name: value or None
            for name, value in re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", script, re.M)}


def test_slurm_header_by_default_one_task_per_node_warning_signal_and_requeue(capsys):
    code, out, err = emit(["--workers", "3", "--emit", "slurm", "--job_name", "digits", *FLAGS],
                          capsys)
    assert code == 0, err
    assert out.startswith("#!/bin/bash\n")
    assert sbatch_header(out) == {
        "job-name": "digits", "nodes": "3", "ntasks-per-node": "1",
        "output": "digits-%j.out", "open-mode": "append",  # a requeued run appends
        "signal": f"B:USR1@{slurm.DEFAULT_WARNING_S}", "requeue": None}
    assert "REQUEUE=1" in out and f"EXIT_PREEMPTED={EXIT_PREEMPTED}" in out
    assert "no authentication and no encryption" in out


def test_slurm_header_with_tasks_per_node_and_site_options(capsys):
    code, out, err = emit(["--workers", "8", "--tasks_per_node", "4", "--emit", "slurm",
                           "--time", "1-00:00:00", "--partition", "gpu", "--account", "ml-42",
                           "--warning_s", "600", "--gpus_per_worker", "1", "--no_requeue",
                           *FLAGS], capsys)
    assert code == 0, err
    header = sbatch_header(out)
    assert {k: header.get(k) for k in ("nodes", "ntasks-per-node", "time", "partition",
                                       "account", "signal", "gpus-per-task", "no-requeue")} \
        == {"nodes": "2", "ntasks-per-node": "4", "time": "1-00:00:00", "partition": "gpu",
            "account": "ml-42", "signal": "B:USR1@600", "gpus-per-task": "1",
            "no-requeue": None}
    assert "requeue" not in header
    assert "REQUEUE=0" in out
    assert "--tasks_per_node=4" in out


def test_slurm_nodes_alone_gives_the_task_count(capsys):
    code, out, err = emit(["--nodes", "3", "--tasks_per_node", "2", "--emit", "slurm", *FLAGS],
                          capsys)
    assert code == 0, err
    assert sbatch_header(out)["nodes"] == "3"
    assert sbatch_header(out)["ntasks-per-node"] == "2"


@pytest.mark.parametrize("args, message", [
    (["--workers", "3", "--tasks_per_node", "2"], "not a multiple of --tasks_per_node=2"),
    (["--workers", "4", "--nodes", "3", "--tasks_per_node", "2"],
     "--workers=4 but --nodes=3 x --tasks_per_node=2 makes 6 tasks"),
    (["--workers", "2", "--tasks_per_node", "0"], "--tasks_per_node=0 must be >= 1"),
    (["--workers", "2", "--partition", "gpu; rm -rf /"], "cannot go on an #SBATCH line"),
    (["--workers", "2", "--warning_s", "0"], "--warning_s=0 must be >= 1"),
    (["--workers", "2", "--evaluator"], "run it as its own job"),
])
def test_slurm_bad_counts_and_values_are_refused(args, message, capsys):
    code, out, err = emit([*args, "--emit", "slurm", *FLAGS], capsys)
    assert code == 2 and out == ""
    assert message in err


def _fake_slurm_bin(tmp_path, nodes, per_node=1):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        [ "$1 $2" = "show hostnames" ] || exit 9
        for i in $(seq 1 {nodes}); do echo "node$i"; done
        """))
    tasks = nodes * per_node
    (bin_dir / "srun").write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, subprocess, sys
        args = sys.argv[1:]
        while args[0].startswith("--"):
            args.pop(0)
        env = dict(os.environ, SLURM_NTASKS="{tasks}", SLURM_JOB_NODELIST="node[1-{nodes}]")
        procs = [subprocess.Popen(args, env=dict(env, SLURM_PROCID=str(i),
                                                 SLURM_NODEID=str(i // {per_node}),
                                                 SLURM_LOCALID=str(i % {per_node})),
                                  stdout=subprocess.PIPE) for i in range({tasks})]
        outputs = [p.communicate()[0] for p in procs]  # one task's lines after another
        sys.stdout.buffer.write(b"".join(outputs))
        sys.exit(max(p.returncode for p in procs))
        """))
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("chief, per_node", [(False, 1), (True, 1), (False, 3), (True, 3)])
def test_slurm_script_tasks_derive_a_tf_config_naming_every_task(tmp_path, capsys, chief,
                                                                 per_node):
    args = ["--workers", "3", "--tasks_per_node", str(per_node), "--emit", "slurm",
            "--port", "4321", "--module", "tests.launch_helpers.fake_worker", *FLAGS]
    code, script, err = emit(args + (["--chief"] if chief else []), capsys)
    assert code == 0, err
    header = sbatch_header(script)
    nodes, per_node = int(header["nodes"]), int(header["ntasks-per-node"])
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    bin_dir = _fake_slurm_bin(tmp_path, nodes, per_node)
    env = dict(os.environ, PYTHONPATH=REPO, FAKE_PLAN=json.dumps({"*": {"seconds": 0}}),
               SLURM_JOB_ID="7", SLURM_JOB_NODELIST=f"node[1-{nodes}]",
               PATH=f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}"
                    f"{os.environ['PATH']}")
    env.pop("TF_CONFIG", None)
    result = subprocess.run(["bash", str(path)], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    configs = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
               if line.startswith("TF_CONFIG ")]
    addresses = (["node1:4321", "node2:4321", "node3:4321"] if per_node == 1
                 else ["node1:4321", "node1:4322", "node1:4323"])
    expected = ({"chief": addresses[:1], "worker": addresses[1:]} if chief
                else {"worker": addresses})
    assert len(configs) == 3
    for tf_config in configs:
        validate_tf_config(tf_config)
        assert tf_config["cluster"] == expected
    tasks = sorted((c["task"]["type"], c["task"]["index"]) for c in configs)
    assert tasks == sorted(cluster_tasks(expected)[i][:2] for i in range(3))
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


def test_slurm_script_outside_sbatch_says_to_submit_it(tmp_path, capsys):
    code, script, _ = emit(["--workers", "2", "--emit", "slurm", *FLAGS], capsys)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "submit it with sbatch" in result.stderr


# --- TFJob semantics -------------------------------------------------------------------
# The Kubeflow training operator's documented rule for a replica's restartPolicy, applied
# to a container's exit code: ExitCode retries 128-255 (signals, "retryable") and treats
# 1-127 as permanent; OnFailure / Always restart on any failure; Never never restarts.
def operator_retries(restart_policy, exit_code):
    if exit_code == 0:
        return False
    if restart_policy == "ExitCode":
        return 128 <= exit_code <= 255
    if restart_policy in ("OnFailure", "Always"):
        return True
    assert restart_policy == "Never", f"unknown restartPolicy {restart_policy!r}"
    return False


VOLUME_FLAGS = ["--config=models/configs/digits.py", "--workdir=/mnt/runs/digits"]
# A global batch that divides over every replica count these tests emit (checked).
BATCH_48 = "--config.train.global_batch_size=48"


def tfjob(args, capsys, flags=(*VOLUME_FLAGS, BATCH_48)):
    code, out, err = emit(["--emit", "tfjob", "--image", "img", *args, *flags], capsys)
    assert code == 0, err
    return json.loads(out), err


def containers(manifest):
    for kind, spec in manifest["spec"]["tfReplicaSpecs"].items():
        (container,) = spec["template"]["spec"]["containers"]
        yield kind, spec, container


def flag(command, name):
    values = [a.split("=", 1)[1] for a in command if a.startswith(name + "=")]
    return values[-1] if values else None


def test_operator_rule_as_written_here():
    assert [operator_retries("ExitCode", c) for c in (1, 2, 42, 127, 128, 137, 143, 255)] \
        == [False] * 4 + [True] * 4


def test_preemption_exit_code_is_143_in_the_trainer_and_the_launchers():
    from trainer.checkpoint.guards import preemption

    assert preemption.EXIT_PREEMPTED == exit_codes.EXIT_PREEMPTED == EXIT_PREEMPTED


def test_tfjob_every_replica_retries_a_preempted_trainer_and_not_a_broken_one(capsys):
    manifest, _ = tfjob(["--workers", "3", "--chief", "--evaluator", "--volume",
                         "runs:/mnt/runs"], capsys)
    kinds = []
    for kind, spec, _ in containers(manifest):
        kinds.append(kind)
        policy = spec["restartPolicy"]
        assert operator_retries(policy, EXIT_PREEMPTED), (kind, policy)  # preempted: resume
        assert operator_retries(policy, 128 + 9), (kind, policy)  # SIGKILLed (node drain, OOM)
        assert not operator_retries(policy, 1), (kind, policy)  # config error: do not loop
        assert not operator_retries(policy, 42), (kind, policy)  # the old code was not retried
    assert kinds == ["Chief", "Worker", "Evaluator"]


def test_tfjob_default_backoff_limit_leaves_room_for_several_preemptions(capsys):
    # The operator counts each failed pod (a retryable exit too) against backoffLimit.
    manifest, _ = tfjob(["--workers", "2", "--volume", "runs:/mnt/runs"], capsys)
    assert manifest["spec"]["runPolicy"]["backoffLimit"] >= 5
    assert manifest["spec"]["runPolicy"]["backoffLimit"] == DEFAULT_TFJOB_BACKOFF_LIMIT
    manifest, _ = tfjob(["--workers", "2", "--volume", "runs:/mnt/runs", "--max_restarts", "0"],
                        capsys)
    assert manifest["spec"]["runPolicy"]["backoffLimit"] == 0  # asked for explicitly


def test_tfjob_workdir_is_on_the_volume_every_replica_mounts(capsys):
    manifest, err = tfjob(["--workers", "2", "--chief", "--evaluator", "--volume",
                           "runs:/mnt/runs"], capsys)
    assert "warning" not in err
    for kind, spec, container in containers(manifest):
        volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
        workdir = flag(container["command"], "--workdir")
        mounts = [m for m in container["volumeMounts"]
                  if workdir == m["mountPath"] or workdir.startswith(m["mountPath"] + "/")]
        assert mounts, (kind, workdir, container["volumeMounts"])
        claim = volumes[mounts[0]["name"]]["persistentVolumeClaim"]["claimName"]
        assert claim == "runs", kind


@pytest.mark.parametrize("workdir", ["/tmp/digits", "/mnt/runsX/digits", "/mnt/runs/../x"])
def test_tfjob_refuses_a_workdir_outside_the_mounted_volume(workdir, capsys):
    code, out, err = emit(["--workers", "2", "--emit", "tfjob", "--image", "img", "--volume",
                           "runs:/mnt/runs", "--config=c.py", f"--workdir={workdir}"], capsys)
    assert code == 2 and out == ""
    assert f"--workdir={workdir} is not under the volume mounted at /mnt/runs" in err
    assert "Use --workdir=/mnt/runs/<run>" in err


def test_tfjob_warns_when_the_workdir_is_not_shared(capsys):
    manifest, err = tfjob(["--workers", "2"], capsys, flags=["--config=c.py", "--workdir=/tmp/d"])
    assert "warning: --workdir=/tmp/d is a path inside each pod's own filesystem" in err
    assert "--volume CLAIM:MOUNT" in err
    _, err = tfjob(["--workers", "2"], capsys, flags=["--config=c.py", "--workdir=gs://b/run"])
    assert "warning" not in err  # a bucket is shared storage


def test_tfjob_refuses_an_s3_workdir_with_the_trainers_line(capsys):
    code, out, err = emit(["--workers", "2", "--emit", "tfjob", "--image", "img",
                           "--config=c.py", "--workdir=s3://runs/digits"], capsys)
    assert code == 2 and out == ""
    assert "--workdir=s3://runs/digits: TensorFlow 2.21 has no S3 file system" in err
    assert "--workdir=/mnt/runs/digits" in err  # the mount point to use instead


def test_tfjob_evaluator_runs_continuous_eval_on_one_device(capsys):
    manifest, _ = tfjob(["--workers", "2", "--evaluator", "--gpus_per_worker", "4", "--volume",
                         "runs:/mnt/runs"], capsys)
    commands = {kind: c["command"] for kind, _, c in containers(manifest)}
    evaluator = commands.pop("Evaluator")
    assert flag(evaluator, "--mode") == "continuous_eval"
    assert flag(evaluator, "--config.distribute.strategy") is None
    assert evaluator[:3] == ["python", "-m", "trainer.main"]
    assert [a for a in evaluator if a.startswith(("--config=", "--workdir="))] == VOLUME_FLAGS
    for kind, command in commands.items():
        assert flag(command, "--mode") is None, kind
        assert flag(command, "--config.distribute.strategy") == "multi_worker", kind
        assert flag(command, "--workdir") == flag(evaluator, "--workdir")
    limits = {kind: c["resources"]["limits"]["nvidia.com/gpu"] for kind, _, c in containers(manifest)}
    assert limits == {"Worker": 4, "Evaluator": 1}


def test_tfjob_resources_requests(capsys):
    manifest, _ = tfjob(["--workers", "2", "--cpu", "4", "--memory", "16Gi", "--volume",
                         "runs:/mnt/runs"], capsys)
    for _, _, container in containers(manifest):
        assert container["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}}


@pytest.mark.parametrize("args, message", [
    (["--volume", "runs"], "is not CLAIM:MOUNT"),
    (["--volume", "runs:relative/path"], "is not CLAIM:MOUNT"),
    (["--volume", "Runs_1:/mnt"], "not a valid Kubernetes name"),
    (["--cpu", "four"], "--cpu='four' is not a Kubernetes quantity"),
    (["--memory", "16 GB"], "--memory='16 GB' is not a Kubernetes quantity"),
    (["--gpus_per_worker", "-1"], "--gpus_per_worker=-1 must be >= 0"),
])
def test_tfjob_bad_values_are_refused(args, message, capsys):
    code, out, err = emit(["--workers", "2", "--emit", "tfjob", "--image", "img", *args,
                           *VOLUME_FLAGS], capsys)
    assert code == 2 and out == ""
    assert message in err


def test_tfjob_refuses_a_mode_flag(capsys):
    code, _, err = emit(["--workers", "2", "--emit", "tfjob", "--image", "img", "--volume",
                         "runs:/mnt/runs", *VOLUME_FLAGS, "--mode=train"], capsys)
    assert code == 2
    assert "--mode is set per replica" in err
