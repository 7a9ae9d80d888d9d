"""Kill, preempt and crash real ``trainer.main`` processes; restart; compare the state.

All single-process scenarios run in two waves of parallel subprocesses (one module
fixture), so the whole file costs about two process start-ups per wave on 2 cores.
The Trainer is ``tests.support.run_checkpoint.CkptTrainer`` (toy data, Adam, 40 steps, loops of
5, a checkpoint every 10 steps), fp32 and deterministic; its final state (weights, every
optimizer variable, loss-scale state, step) is dumped independently of the checkpoint
code and compared EXACTLY.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, subprocess_env
from tests.support.helpers import free_loopback_ports
from tests.support.run_checkpoint import CRASH_EXIT

EXIT_PREEMPTED = 143  # 128 + SIGTERM (schedulers retry it); documented in docs/errors.md, checked literally
TIMEOUT_S = 600
CONFIG = f"--config={REPO / 'tests' / 'support' / 'run_checkpoint.py'}"
MIRRORED_2 = ["--config.distribute.strategy=mirrored", "--config.distribute.virtual_devices=2"]


class Run:
    """One ``python -m tests.support.run_checkpoint`` (= trainer.main) process."""

    def __init__(self, root, name: str, flags=(), env=None, workdir: str | None = None):
        self.out = root / "out" / name
        self.out.mkdir(parents=True, exist_ok=True)
        self.workdir = root / (workdir or name)
        self.log = root / f"{name}.log"
        full_env = subprocess_env()
        full_env.pop("TF_CONFIG", None)
        full_env.update({"CKPT_TEST_OUT": str(self.out), **(env or {})})
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.run_checkpoint", CONFIG,
                 f"--workdir={self.workdir}", *flags],
                cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT, text=True)

    def wait(self) -> "Run":
        self.proc.wait(timeout=TIMEOUT_S)
        self.output = self.log.read_text()
        self.code = self.proc.returncode
        return self

    def state(self, task: str = "local-0") -> dict:
        path = self.out / f"{task}.npz"
        assert path.exists(), f"no state dump at {path}:\n{self.output[-4000:]}"
        with np.load(path) as f:
            return dict(f)

    def steps_on_disk(self) -> list[str]:
        return sorted(os.listdir(self.workdir / "checkpoints"))


def wait_all(runs: dict) -> dict:
    for run in runs.values():
        run.wait()
    return runs


def assert_same_state(got: dict, want: dict, context: str) -> None:
    assert got.keys() == want.keys()
    assert any(k.startswith("opt/") for k in want) and any(k.startswith("model/") for k in want)
    different = [k for k in want if not np.array_equal(got[k], want[k])]
    assert not different, f"{context}: {different} differ"


def resumed_step(run: Run) -> int:
    lines = [line for line in run.output.splitlines() if "resumed from step" in line]
    assert len(lines) == 1, run.output[-4000:]
    return int(lines[0].split("resumed from step ")[1].split()[0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Wave 1: references and the interrupted runs; wave 2: restarts and restores."""
    root = tmp_path_factory.mktemp("ckpt")
    first = wait_all({
        "ref": Run(root, "ref"),
        "ref_m2": Run(root, "ref_m2", MIRRORED_2),
        "kill": Run(root, "kill", env={"CKPT_TEST_ACTION": "kill:23"}),
        "kill_m2": Run(root, "kill_m2", MIRRORED_2, env={"CKPT_TEST_ACTION": "kill:23"}),
        "term": Run(root, "term", env={"CKPT_TEST_ACTION": "term:12"}),
        "crash": Run(root, "crash", env={"CKPT_TEST_CRASH_SAVE": "20"}),
        "save_4": Run(root, "save_4", ["--config.distribute.strategy=mirrored",
                                       "--config.distribute.virtual_devices=4",
                                       "--config.train.steps=10"]),
    })
    # Each restore on its own copy of the 4-replica workdir: two runs on one workdir at
    # once is what the workdir lease refuses (CI: the second of them exited 1, "another
    # run is writing to this workdir").
    shutil.copytree(root / "save_4", root / "save_4_copy")
    second = wait_all({
        "kill": Run(root, "kill_restart", workdir="kill"),
        "kill_m2": Run(root, "kill_m2_restart", MIRRORED_2, workdir="kill_m2"),
        "term": Run(root, "term_restart", workdir="term"),
        "crash": Run(root, "crash_restart", workdir="crash"),
        "restore_1": Run(root, "restore_1", ["--config.train.steps=10"], workdir="save_4"),
        "restore_2": Run(root, "restore_2", [*MIRRORED_2, "--config.train.steps=10"],
                         workdir="save_4_copy"),
    })
    return {"first": first, "second": second}


@pytest.mark.parametrize("kill, ref", [("kill", "ref"), ("kill_m2", "ref_m2")],
                         ids=["one_device", "mirrored_2"])
def test_sigkill_mid_run_then_restart_equals_uninterrupted_run(runs, kill, ref):
    killed, restarted = runs["first"][kill], runs["second"][kill]
    reference = runs["first"][ref]
    assert reference.code == 0, reference.output[-4000:]
    assert killed.code == -9, killed.output[-4000:]
    assert "injected kill" in killed.output
    assert restarted.code == 0, restarted.output[-4000:]
    assert resumed_step(restarted) in (10, 20)  # step 20's async save may not have committed
    assert int(restarted.state()["step"]) == 40
    assert_same_state(restarted.state(), reference.state(), f"{kill} restart vs {ref}")


def test_negative_control_exact_comparison_sees_float_level_differences(runs):
    # 1 and 2 replicas train to the same weights within 1e-5 (test_equivalence) but not
    # bit for bit: the exact comparison above would catch a resume that is off by that.
    one, two = runs["first"]["ref"].state(), runs["first"]["ref_m2"].state()
    assert max(float(np.max(np.abs(one[k] - two[k]))) for k in one if k.startswith("model/")) < 1e-4
    with pytest.raises(AssertionError):
        assert_same_state(one, two, "1 vs 2 replicas")


def test_checkpoint_written_on_4_replicas_restores_on_1_and_2(runs):
    saved = runs["first"]["save_4"]
    assert saved.code == 0, saved.output[-4000:]
    assert "replicas in sync: 4" in saved.output
    for name, replicas in (("restore_1", 1), ("restore_2", 2)):
        run = runs["second"][name]
        assert run.code == 0, run.output[-4000:]
        assert f"replicas in sync: {replicas}" in run.output
        assert resumed_step(run) == 10
        assert_same_state(run.state(), saved.state(), f"{name} vs save_4")


def test_sigterm_saves_the_current_step_exits_42_and_the_restart_continues(runs):
    term, restart = runs["first"]["term"], runs["second"]["term"]
    assert term.code == EXIT_PREEMPTED, term.output[-4000:]
    # SIGTERM arrives during step 13; the loop of steps 11-15 finishes, then it saves.
    assert "preempted at step 15" in term.output
    assert int(term.state()["step"]) == 15
    assert restart.code == 0, restart.output[-4000:]
    assert resumed_step(restart) == 15
    assert_same_state(restart.state(), runs["first"]["ref"].state(), "term restart vs ref")


def test_crash_during_a_checkpoint_commit_restores_the_previous_step(runs):
    crash, restart = runs["first"]["crash"], runs["second"]["crash"]
    assert crash.code == CRASH_EXIT, crash.output[-4000:]
    assert "injected crash while committing checkpoint 20" in crash.output
    assert restart.code == 0, restart.output[-4000:]
    assert "Ignoring the incomplete checkpoint" in restart.output
    assert "20.orbax-checkpoint-tmp" in restart.output
    assert resumed_step(restart) == 10
    assert not any("tmp" in name for name in restart.steps_on_disk())  # cleaned at next save
    assert_same_state(restart.state(), runs["first"]["ref"].state(), "crash restart vs ref")


def _corrupt_every_step(workdir) -> None:
    """Overwrites every array file: OCDBT data files (stock) or .npy (checkpoint.fast_io)."""
    state = workdir / "checkpoints" / "*" / "state"
    paths = (glob.glob(str(state / "*.npy"))
             + glob.glob(str(state / "**" / "d" / "*"), recursive=True))
    assert paths
    for path in paths:
        with open(path, "wb") as f:
            f.write(b"garbage")


@pytest.mark.parametrize("case, flags, expected", [
    ("incompatible", ["--config.model.hidden=32"],
     r"Checkpoint error: Variable 'sequential/dense/kernel' has shape \[8, 32\] but .* "
     r"holds shape \[8, 16\]"),
    ("corrupt", [], r"Checkpoint error: No readable checkpoint: .*/40: cannot read "
                    r"variable '[^']+' \(ValueError: .*\); .*/30: cannot read variable"),
])
def test_cli_reports_a_bad_checkpoint_in_one_message_naming_the_variable(
        runs, tmp_path, case, flags, expected):
    workdir = tmp_path / case
    shutil.copytree(runs["first"]["ref"].workdir / "checkpoints", workdir / "checkpoints")
    if case == "corrupt":
        _corrupt_every_step(workdir)
    run = subprocess.run(
        [sys.executable, "-m", "trainer.main", CONFIG, f"--workdir={workdir}", *flags],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 1, run.stderr[-4000:]
    assert re.search(expected, run.stderr), run.stderr[-4000:]
    assert "Traceback" not in run.stderr


def _worker_group(root, name: str, flags=(), action: str = "") -> dict:
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_loopback_ports(2)]}
    group = {}
    for index in range(2):
        env = {"TF_CONFIG": json.dumps({"cluster": cluster,
                                        "task": {"type": "worker", "index": index}}),
               "CKPT_TEST_ACTION": action}
        # The shared-workdir check is off: this group stands for hosts WITHOUT one.
        group[index] = Run(root, f"{name}-{index}",
                           ["--config.distribute.strategy=multi_worker",
                            "--config.checkpoint.shared_workdir_timeout_s=0", *flags],
                           env=env, workdir=f"workdir-{index}")
    return wait_all(group)


def test_two_workers_only_the_chief_writes_and_both_resume_the_same_state(tmp_path):
    # Separate workdirs stand for machines without a shared filesystem: worker 1 can
    # only get the state through the chief's broadcast. SIGTERM reaches worker 1 only.
    first = _worker_group(tmp_path, "preempt", action="worker:1:term:12")
    for index, run in first.items():
        assert run.code == EXIT_PREEMPTED, run.output[-4000:]
        assert "preempted at step 15" in run.output
    assert "injected term of worker-1" in first[1].output
    assert first[0].steps_on_disk() == ["10", "15"]
    assert not (tmp_path / "workdir-1").exists()  # nothing written for the other worker
    second = _worker_group(tmp_path, "resume", ["--config.train.steps=20"])
    for index, run in second.items():
        assert run.code == 0, run.output[-4000:]
        assert resumed_step(run) == 15
    assert not (tmp_path / "workdir-1").exists()
    assert_same_state(second[1].state("worker-1"), second[0].state("worker-0"),
                      "worker 1 vs worker 0 after resuming")
    assert int(second[0].state("worker-0")["step"]) == 20
