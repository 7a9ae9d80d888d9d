"""A workdir in S3: the bucket mounted with s3fs-fuse trains, checkpoints and resumes on
a machine that never saw it (a new mount with an empty cache) exactly as an
uninterrupted local run; ``--workdir=s3://...`` itself is one line saying what to use."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import MainProcess, run_main
from tests.support.helpers import NO_TENSORFLOW_PRELUDE, REPO, last_lines, subprocess_env

STEPS = ("--config.train.steps=200", "--config.checkpoint.every_steps=100")


def _result(stdout: str) -> dict[str, float]:
    line = next(line for line in stdout.splitlines() if line.startswith("result: "))
    return {k: float(v) for k, v in re.findall(r"(\S+?)=([-0-9.e]+)(?=\s)", line + " ")}


def test_a_mounted_bucket_trains_and_a_new_machine_resumes_it_exactly(s3_bucket, tmp_path):
    reference = MainProcess(tmp_path / "local", "--config.train.steps=400")
    first_machine = s3_bucket.mount("first-machine")
    first = run_main(first_machine / "digits", *STEPS)
    assert first.returncode == 0, first.stderr[-3000:]
    assert _result(first.stdout)["step"] == 200
    keys = s3_bucket.keys("digits/")
    for key in ("digits/config.json", "digits/metrics.jsonl",
                "digits/checkpoints/200/state/crc32c.json",
                "digits/checkpoints/200/commit_success.txt"):
        assert key in keys, f"{key} not in the bucket: {sorted(keys)[:40]}"
    assert any(k.startswith("digits/train/events.out.tfevents") for k in keys), sorted(keys)
    s3_bucket.unmount(first_machine)  # the machine and its s3fs cache are gone

    second_machine = s3_bucket.mount("second-machine")
    resumed = run_main(second_machine / "digits", "--config.train.steps=400")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "restored from checkpoint step 200" in resumed.stderr + resumed.stdout
    uninterrupted = reference.result()
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    got, want = _result(resumed.stdout), _result(uninterrupted.stdout)
    assert got["step"] == want["step"] == 400
    for name in ("eval/loss", "eval/accuracy"):
        assert got[name] == pytest.approx(want[name], rel=1e-4), (name, got, want)


def test_an_s3_url_is_one_line_naming_the_mount():
    """Before TensorFlow is imported (it would only say 'scheme not implemented')."""
    proc = subprocess.run(
        [sys.executable, "-c", NO_TENSORFLOW_PRELUDE, "trainer.main",
         f"--config={REPO / 'models/configs/digits.py'}", "--workdir=s3://runs/digits"],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = last_lines(proc.stderr, 1)
    assert line.startswith("Workdir error: --workdir=s3://runs/digits: TensorFlow 2.21 has no "
                           "S3 file system"), proc.stderr[-2000:]
    assert "Mount the bucket" in line and "--workdir=/mnt/runs/digits" in line, line
    assert "Traceback" not in proc.stderr
