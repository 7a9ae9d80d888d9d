"""The local checkpoint tier on one machine: real ``trainer.main`` processes, a real SIGKILL.

``tests.support.run_checkpoint`` (40 steps, loops of 5) with workdir saves every 20
steps and a local copy every 5 (``checkpoint.async_save=False``, so the local step
before the kill is committed when the kill comes). One process is SIGKILLed during
step 34: its workdir holds step 20, its local dir steps 25 and 30 (keep 2). Its
workdir and local dir are copied three times, and each copy restarted (in parallel):
untouched (resumes from the local step 30), the newest local step corrupt (25), both
corrupt (the workdir's 20). Each ends bit-equal to an uninterrupted run, and the
goodput record shows what the restart redid.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from tests.support.helpers import subprocess_env
from trainer.checkpoint.storage.local_tier import local_dir

TIMEOUT_S = 600
FLAGS = [f"--config={REPO / 'tests' / 'support' / 'run_checkpoint.py'}",
         "--config.checkpoint.every_steps=20", "--config.checkpoint.local_every_steps=5",
         "--config.checkpoint.async_save=False"]


def start(root, name: str, action: str = "") -> subprocess.Popen:
    """``python -m tests.support.run_checkpoint`` on ``root/name`` (its local dir under
    ``root/local``, its state dump in ``root/out/name``)."""
    (root / "out" / name).mkdir(parents=True, exist_ok=True)
    env = subprocess_env()
    env.pop("TF_CONFIG", None)
    env.update(CKPT_TEST_OUT=str(root / "out" / name), CKPT_TEST_ACTION=action)
    log = open(root / f"{name}.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.run_checkpoint", *FLAGS,
         f"--workdir={root / name}", f"--config.checkpoint.local_dir={root / 'local'}"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def finish(root, procs: dict) -> dict:
    """``{name: (exit code, output)}`` once every process of ``procs`` ended."""
    return {name: (p.wait(timeout=TIMEOUT_S), (root / f"{name}.log").read_text())
            for name, p in procs.items()}


def local_steps(root, name: str) -> str:
    return os.path.join(local_dir(str(root / name), 0, str(root / "local")), "checkpoints")


def corrupt(path: str) -> None:
    """Overwrites every array file of the step directory ``path`` (checksums stay)."""
    for directory, _, files in os.walk(os.path.join(path, "state")):
        for file in files:
            if file != "crc32c.json" and not file.startswith("_"):
                with open(os.path.join(directory, file), "wb") as f:
                    f.write(b"garbage")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("local_tier")
    first = finish(root, {"ref": start(root, "ref"), "kill": start(root, "kill", "kill:33")})
    held = sorted(os.listdir(local_steps(root, "kill")))
    for copy in ("intact", "newest_corrupt", "all_corrupt"):
        shutil.copytree(root / "kill", root / copy)
        shutil.copytree(local_steps(root, "kill"), local_steps(root, copy))
    # A workdir deleted and made afresh at the same path: the killed run's local steps
    # are still on the disk.
    shutil.copytree(local_steps(root, "kill"), local_steps(root, "fresh"))
    corrupt(os.path.join(local_steps(root, "newest_corrupt"), "30"))
    for step in ("25", "30"):
        corrupt(os.path.join(local_steps(root, "all_corrupt"), step))
    second = finish(root, {copy: start(root, copy)
                           for copy in ("intact", "newest_corrupt", "all_corrupt", "fresh")})
    return {"root": root, "first": first, "second": second, "held": held}


def state(root, name: str) -> dict:
    with np.load(root / "out" / name / "local-0.npz") as f:
        return dict(f)


def resumed(output: str) -> str:
    lines = [line for line in output.splitlines() if "resumed from step" in line]
    assert len(lines) == 1, output[-4000:]
    return lines[0].split("resumed from step ")[1]


def test_the_killed_run_kept_two_checksummed_local_steps_beside_the_workdirs(runs):
    code, output = runs["first"]["kill"]
    assert code == -9, output[-4000:]
    assert runs["held"] == ["25", "30"]  # keep 2; 5..20 removed
    for step in runs["held"]:
        path = os.path.join(local_steps(runs["root"], "kill"), step)
        assert os.path.exists(os.path.join(path, "state", "crc32c.json"))
        assert os.path.exists(os.path.join(path, "manifest", "crc32c.json"))
    assert sorted(os.listdir(runs["root"] / "kill" / "checkpoints")) == ["20"]
    # A run that reached train.steps leaves nothing on the local disk.
    assert runs["first"]["ref"][0] == 0, runs["first"]["ref"][1][-4000:]
    assert not os.path.exists(os.path.dirname(local_steps(runs["root"], "ref")))
    assert not os.path.exists(os.path.dirname(local_steps(runs["root"], "intact")))


@pytest.mark.parametrize("copy, step, source, skipped", [
    ("intact", 30, "worker 0's local checkpoint", 0),
    ("newest_corrupt", 25, "worker 0's local checkpoint", 1),
    ("all_corrupt", 20, "all_corrupt", 2)])
def test_a_restart_resumes_from_the_newest_step_that_verifies_and_ends_bit_equal(
        runs, copy, step, source, skipped):
    code, output = runs["second"][copy]
    assert code == 0, output[-4000:]
    assert resumed(output).startswith(f"{step} (") and source in resumed(output)
    assert output.count("Skipping the local checkpoint") == skipped, output[-4000:]
    reference, got = state(runs["root"], "ref"), state(runs["root"], copy)
    assert int(got["step"]) == 40 and got.keys() == reference.keys()
    assert not [k for k in reference if not np.array_equal(got[k], reference[k])]


def test_a_workdir_made_afresh_ignores_the_local_steps_left_at_its_path(runs):
    """Another run's local steps are never restored into a new run: the workdir is
    not marked (local_tier.json), so they are removed (one line) and the run starts from
    step 0."""
    code, output = runs["second"]["fresh"]
    assert code == 0, output[-4000:]
    assert "resumed from step" not in output
    assert output.count("so they are another run's") == 1, output[-4000:]
    reference, got = state(runs["root"], "ref"), state(runs["root"], "fresh")
    assert not [k for k in reference if not np.array_equal(got[k], reference[k])]


def test_goodput_counts_only_the_steps_the_restart_redid(runs):
    def record(copy: str) -> list[dict]:
        with open(runs["root"] / copy / "goodput.json") as f:
            return json.load(f)["attempts"]

    local, durable = record("intact"), record("all_corrupt")
    assert len(local) == len(durable) == 2
    assert local[1]["restored_step"] == 30 and durable[1]["restored_step"] == 20
    killed_at = durable[0]["last_step"]  # the killed attempt's last recorded progress
    assert durable[1]["wasted_steps"] == killed_at - 20 > local[1]["wasted_steps"]
    assert local[1]["wasted_steps"] == max(0, killed_at - 30)
    assert local[1]["wasted_s"] < durable[1]["wasted_s"]
    for attempts in (local, durable):  # the categories still add up to the wall time
        spent = [sum(a["seconds"].values()) for a in attempts]
        walls = [a["last_time"] - a["start"] for a in attempts]
        assert spent == pytest.approx(walls, rel=1e-6, abs=1e-3)
