"""Specification of the SLURM script's node counts: fixed (``--nodes 2``) and elastic
(``--nodes 1-2``, ``--min_nodes``), where the worker count comes from SLURM_NNODES at run
time, and of its requeue on a lost peer.

The script is executed with stand-ins for ``srun`` and ``scontrol`` that record what
they were asked to run (the real multi-node job is tests/launch/test_slurm.py's business).
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from launch import multiworker
from tests.launch_helpers.running import REPO
from tf_cluster.exit_codes import EXIT_PEER_LOST

FLAGS = ["--config=models/configs/digits.py", "--workdir=/shared/run"]


def script(args, capsys):
    assert multiworker.main([*args, "--emit", "slurm", *FLAGS]) == 0
    return capsys.readouterr().out


def header(text):
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", text, re.M))


def run_script(tmp_path, text, nnodes, srun_exit=0):
    """Runs the script with SLURM_NNODES=nnodes; returns (result, srun's argv)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / "srun-argv"
    (bin_dir / "srun").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$@" > {record}
        exit {srun_exit}
        """))
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"scontrol $*\" >> {tmp_path}/scontrol\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID="7", SLURM_NNODES=str(nnodes), SLURM_JOB_NODELIST="node[1-2]",
               PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    result = subprocess.run(["bash", str(path)], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    return result, record.read_text() if record.exists() else ""


def test_two_nodes_of_two_tasks_make_four_workers(tmp_path, capsys):
    text = script(["--nodes", "2", "--tasks_per_node", "2"], capsys)
    assert header(text)["nodes"] == "2" and header(text)["ntasks-per-node"] == "2"
    result, srun = run_script(tmp_path, text, nnodes=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert srun.startswith("--ntasks=4 ")
    assert "2 node(s) x 2 task(s) = 4 workers" in result.stdout


@pytest.mark.parametrize("args", [["--nodes", "1-2"], ["--nodes", "2", "--min_nodes", "1"]])
def test_a_node_range_computes_the_workers_from_the_nodes_slurm_gave(tmp_path, capsys, args):
    text = script([*args, "--tasks_per_node", "2"], capsys)
    assert header(text)["nodes"] == "1-2"
    # CPUs per node, not a task count, which SLURM would keep for a requeued job (it
    # would then wait for both nodes again); srun asks for the tasks of each run.
    assert header(text)["mincpus"] == "2" and "ntasks-per-node" not in header(text)
    for nnodes, workers in ((2, 4), (1, 2)):
        result, srun = run_script(tmp_path, text, nnodes=nnodes)
        assert result.returncode == 0, result.stdout + result.stderr
        assert srun.startswith(f"--ntasks={workers} --ntasks-per-node=2 "), srun
        assert f"{nnodes} node(s) x 2 task(s) = {workers} workers" in result.stdout


def test_a_lost_peer_requeues_the_job_like_a_preemption(tmp_path, capsys):
    text = script(["--nodes", "1-2", "--tasks_per_node", "1"], capsys)
    result, _ = run_script(tmp_path, text, nnodes=2, srun_exit=EXIT_PEER_LOST)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "a task lost a peer (exit 170: a node failed or became unreachable): requeueing " \
           "job 7" in result.stdout
    assert (tmp_path / "scontrol").read_text() == "scontrol requeue 7\n"


def test_a_lost_peer_is_not_requeued_with_no_requeue(tmp_path, capsys):
    text = script(["--nodes", "2", "--no_requeue"], capsys)
    result, _ = run_script(tmp_path, text, nnodes=2, srun_exit=EXIT_PEER_LOST)
    assert result.returncode == EXIT_PEER_LOST
    assert "not requeued (--no_requeue)" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--nodes", "2-1"], "--nodes=2-1 must be >= 1"),
    (["--nodes", "two"], "is not a node count N or a range M-N"),
    (["--nodes", "2", "--min_nodes", "3"], "--min_nodes=3 must be in 1..2"),
    (["--nodes", "1-2", "--workers", "3"], "--workers=3 but --nodes=2 x --tasks_per_node=1"),
])
def test_bad_node_counts_are_refused(args, message, capsys):
    assert multiworker.main([*args, "--emit", "slurm", *FLAGS]) == 2
    assert message in capsys.readouterr().err
