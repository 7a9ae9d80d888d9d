"""``python -m benchmarks.device.device_check`` in its dry mode (no GPU here: CPU devices, tiny
sizes), as CI runs it: the table, its JSON copy, the exit status, the reasons of the
skipped rows; and its budget (a check that would not fit is skipped, a hang is killed).

Each test runs a few checks, so that none takes much over a minute; ``speed_cnn`` is
``speed_transformer``'s code on another workload and is not run here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.device import device_check
from tests.support.helpers import REPO, subprocess_env

STATUSES = {"ok", "FAIL", "skipped"}


def dry_run(tmp_path, checks: str, budget_s: float = 240) -> tuple[dict, str]:
    """The command's JSON copy and its output; asserts what every dry run must hold."""
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.device.device_check", "--dry", f"--budget_s={budget_s}",
         f"--checks={checks}", f"--out={out}"],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=budget_s + 60)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "dry" and report["ok"] is True
    # No wall-clock bound here (the repo's rule): the budget's split and the timeouts
    # are tested with an injected clock and a real hung child below.
    for row in report["rows"]:
        assert set(row) == set(device_check.COLUMNS)
        assert row["status"] in STATUSES, row
        assert row["status"] != "FAIL", row
        if row["status"] == "skipped":  # says why: no GPU / no TPU / budget, and what for
            assert row["detail"].split(":")[0] in ("no GPU", "no TPU", "budget"), row
            assert "would prove" in row["detail"], row
        else:
            assert row["detail"], row
        assert f"| {row['check']} | {row['status']} |" in proc.stdout  # the printed table
    return {row["check"]: row for row in report["rows"]}, proc.stdout


def test_devices_virtual_devices_checkpoint_and_tpu(tmp_path):
    rows, stdout = dry_run(tmp_path, "devices,virtual,checkpoint,tpu")
    assert rows["devices"]["status"] == "ok" and "dry mode" in rows["devices"]["detail"]
    assert rows["devices/memory_growth"]["detail"].startswith("no GPU")
    assert rows["devices/allocator"]["detail"].startswith("no GPU")
    equal = rows["virtual/1_vs_2_replicas"]
    assert equal["status"] == "ok" and 0 <= equal["figure"] <= 1e-5
    assert "CPU:0, CPU:1" in equal["detail"]
    crossed = rows["virtual/all_reduce"]
    assert crossed["status"] == "ok" and crossed["figure"] > 0
    assert "is 3 (expected 3)" in crossed["detail"]
    checkpoint = rows["checkpoint"]
    assert checkpoint["status"] == "ok" and checkpoint["figure"] > 0
    assert "checksums match" in checkpoint["detail"]
    assert "equal bit for bit" in checkpoint["detail"]
    assert rows["tpu"]["status"] == "skipped" and rows["tpu"]["detail"].startswith("no TPU")
    assert "all checks hold" in stdout


def test_precision_mfu_and_the_doctor(tmp_path):
    rows, _ = dry_run(tmp_path, "precision,mfu")
    for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
        assert rows[f"precision/{policy}"]["status"] == "ok"
        assert rows[f"precision/{policy}"]["figure"] > 0
    assert "bound 2%" in rows["precision/mixed_float16"]["detail"]
    assert rows["mfu/tflops"]["status"] == "ok" and rows["mfu/tflops"]["figure"] > 0
    assert rows["mfu"]["status"] == "skipped"  # a CPU has no datasheet peak
    assert rows["doctor"]["detail"].split(":")[0] in (
        "input-bound", "input-bound (narrowly)", "compute-bound")


def test_xla_the_plan_and_the_hand_written_loop(tmp_path):
    rows, _ = dry_run(tmp_path, "speed_transformer")
    for check in ("xla/off", "xla/on", "xla/plan", "vs_hand/transformer_tiny"):
        assert rows[check]["status"] == "ok" and rows[check]["figure"] > 0, rows[check]
    assert "perf.plan=auto chose xla=" in rows["xla/plan"]["detail"]


def test_a_gpu_the_command_found_but_tensorflow_does_not_see_fails_the_devices_row():
    """A child started without --dry is on a host where the command found a GPU; here
    TensorFlow (tensorflow-cpu) sees none, as on a GPU host with the CPU build."""
    rows = {r["check"]: r for r in device_check.run_child("devices", False, timeout_s=300)}
    assert rows["devices"]["status"] == "FAIL"
    assert "TensorFlow sees only" in rows["devices"]["detail"]
    assert "tf-trainer[gpu]" in rows["devices"]["detail"]


def test_a_check_that_would_not_fit_is_skipped_and_the_rest_get_the_budget_left():
    now = [0.0]
    given = {}

    def run(name, dry, timeout_s):  # each check takes 30 s of the fake clock
        given[name] = timeout_s
        now[0] += 30
        return [{"check": name, "status": "ok", "figure": 1.0, "unit": "", "detail": "ran"}]

    rows = device_check.plan(["devices", "virtual", "precision", "tpu"], 60, True, False,
                             run=run, clock=lambda: now[0])
    assert [r["status"] for r in rows] == ["ok", "ok", "skipped", "skipped"]
    assert given["devices"] >= device_check.WEIGHTS["devices"][0][1]
    assert given["virtual"] == pytest.approx(25)  # its minimum: its share (15 s) is less
    assert rows[2]["detail"].startswith("budget: 0 s left, it needs 25 s; would prove")
    assert rows[3]["detail"].startswith("no TPU: would prove")


def test_a_check_past_its_timeout_is_killed_and_fails():
    rows = device_check.run_child("precision", True, timeout_s=2)
    assert rows == [{"check": "precision", "status": "FAIL", "figure": None, "unit": "",
                     "detail": "timeout: no result in its 2 s (killed; a hang costs only "
                               "this check)"}]
