"""The performance doctor: verdicts on runs with a known bottleneck, the CLI's JSON and
table, the jit comparison and the memory-bounded batch search."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import toy
from tests.conftest import REPO, subprocess_env
from tests.support.telemetry_trainers import cnn_config
from trainer.doctor import measure as doctor
from trainer.doctor import report as doctor_report

_CORE = ("baseline", "input", "compute")


def test_slow_input_pipeline_is_diagnosed_input_bound():
    config = toy.toy_config()
    config.trainer = "tests.support.telemetry_trainers:SlowInputTrainer"
    report = doctor.diagnose(config, steps=10, sections=_CORE)
    assert report["verdict"]["kind"] == "input-bound", report
    assert report["input"]["examples_per_s"] < report["compute"]["examples_per_s"]
    assert report["verdict"]["text"].startswith("input-bound: the pipeline delivers")  # not narrowly


def test_input_bound_advice_splits_reading_from_preprocessing_and_orders_the_remedies():
    config = toy.toy_config()
    config.trainer = "tests.support.telemetry_trainers:SlowPreprocessingTrainer"
    report = doctor.diagnose(config, steps=10, sections=_CORE)
    assert report["verdict"]["kind"] == "input-bound", report
    assert report["input"]["read_examples_per_s"] > 10 * report["input"]["examples_per_s"]
    assert report["input"]["read_share"] < 0.1
    advice = report["verdict"]["advice"]
    assert "preprocessing dominates" in advice[0]
    # The toy examples are in memory: no files to shard, and the list has no gap.
    assert report["input"]["reads_files"] is False
    remedies = [a.split(":", 1)[0] for a in advice[1:]]
    assert remedies == ["1. parallelism", "2. cache", "3. tf.data service"]
    assert "python -m launch.data_service --port" in advice[3]
    table = doctor_report.format_table(report)
    assert "reading alone" in table and "in memory (no files read)" in table


def test_cached_pipeline_with_a_heavy_model_is_diagnosed_compute_bound():
    """Negative control for the test above: same verdict code, the other answer."""
    report = doctor.diagnose(cnn_config(), steps=5, sections=_CORE + ("layers",))
    assert report["verdict"]["kind"] == "compute-bound", report
    assert report["input"]["examples_per_s"] > report["compute"]["examples_per_s"]
    top = report["layers"]["top"]
    assert top[0]["type"] == "Conv2D" and top[0]["forward_ms"] > 0 and top[0]["params"] > 0
    assert any("costliest layers" in a for a in report["verdict"]["advice"])


def test_jit_section_times_the_real_run_with_and_without_xla():
    """(5) is the execution plan's figure (tests/doctor/test_doctor_agrees_with_itself.py
    checks it equals section (8)'s); measured even when the config fixes the plan."""
    config = toy.toy_config(**{"perf.plan": "fixed", "perf.plan_trial_s": 0.05,
                               "perf.plan_rounds": 2})
    jit = doctor.measure_jit(config, doctor.build_trainer(config).steps.xla_problem)
    assert jit["applicable"] and jit["on_examples_per_s"] > 0 and jit["off_examples_per_s"] > 0
    assert jit["speedup"] > 0 and jit["configured"] == "off"


def test_batch_search_on_cpu_stops_at_the_memory_budget():
    config = toy.toy_config()
    generous = doctor.search_batch(config, steps=5, doublings=1, memory_budget_mb=1e9)
    assert [r["global_batch_size"] for r in generous["tried"]] == [32, 64]
    assert generous["largest_fitting"] == 64 and all(r["fits"] for r in generous["tried"])
    tiny = doctor.search_batch(config, steps=5, doublings=1, memory_budget_mb=1.0)
    assert tiny["largest_fitting"] is None and "budget" in tiny["stopped"]


def test_cli_reports_the_sections_as_json_on_two_replicas():
    """The batch search (4) is covered in-process above; the rest through the CLI. The
    budget is generous: every section must be measured on a loaded machine too (the
    default budget's statement: tests/doctor/test_doctor_agrees_with_itself.py)."""
    cmd = [sys.executable, "-m", "trainer.doctor", f"--config={REPO}/models/configs/digits.py",
           "--steps=20", "--json", "--sections=baseline,input,compute,jit,communication,layers",
           "--time_budget_s=600",
           "--config.distribute.strategy=mirrored", "--config.distribute.virtual_devices=2"]
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The budget is stated first; the phases say what they do (stderr), never an ETA.
    said = [line for line in proc.stderr.splitlines() if line.startswith("doctor: ")]
    assert said[0].startswith("doctor: measuring baseline, input, compute, jit, "
                              "communication, layers within a time budget of 600 s"), said
    assert "doctor: (6) one replica vs all ..." in "\n".join(said)
    assert said[-1].startswith("doctor: done in") and "ETA" not in proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # The batch search (4) and the execution plan (8) are covered in-process, the thread
    # pools (9) in tests/doctor/test_thread_pools.py.
    assert set(doctor.SECTIONS) - {"batch", "plan", "threads"} | {"config", "verdict"} <= set(report)
    assert report["config"]["replicas"] == 2
    comm = report["communication"]
    assert comm["applicable"] and comm["per_replica_batch"] == 32, comm
    assert comm["one_replica_step_ms"] > 0 and 0 <= comm["communication_share"] <= 1
    assert not report["jit"]["applicable"]  # XLA is not applied with 2 replicas
    assert {r["layer"] for r in report["layers"]["top"]} >= {"dense", "dense_1"}
    measured = {k: v for k, v in report.items() if k != "verdict"}
    assert report["verdict"] == doctor_report.verdict(measured)
    table = doctor_report.format_table(report)
    for label in ("(1) real run", "(2) input pipeline alone", "(3) compute alone",
                  "(6) 1 vs 2 replicas", "(7) top layers", "(10) verdict"):
        assert label in table, label


def _report(run, feed, step, comm_share=None, jit_speedup=None):
    """A doctor report with the given examples/s (and optional sections)."""
    report = {"baseline": {"examples_per_s": run}, "input": {"examples_per_s": feed},
              "compute": {"examples_per_s": step}}
    if comm_share is not None:
        report["communication"] = {"applicable": True, "communication_share": comm_share,
                                   "replicas": 2, "n_replica_step_ms": 10.0,
                                   "one_replica_step_ms": 10.0 * (1 - comm_share)}
    if jit_speedup is not None:  # the plan measured the whole step compiled and chose it
        report["jit"] = {"applicable": True, "speedup": jit_speedup, "setting": "step",
                         "configured": "off", "chosen": {"xla": "step", "steps_per_loop": 5}}
    return report


@pytest.mark.parametrize("case, report, kind, advice", [
    ("pipeline slower than the step", _report(500, 500, 1000), "input-bound", None),
    ("run far below a barely faster pipeline", _report(700, 1100, 1000), "compute-bound",
     "raise train.steps_per_loop"),
    ("replicas spend half the step talking", _report(1000, 5000, 1000, comm_share=0.5),
     "communication-bound", None),
    ("a little communication", _report(1000, 5000, 1000, comm_share=0.1), "compute-bound", None),
    ("fast pipeline, busy step", _report(950, 5000, 1000), "compute-bound", None),
    ("host overhead between steps", _report(500, 5000, 1000, comm_share=0.1), "compute-bound",
     "raise train.steps_per_loop"),
    ("XLA helps", _report(950, 5000, 1000, jit_speedup=1.5), "compute-bound",
     "XLA (the whole step compiled) runs the real run 1.50x as fast"),
])
def test_verdict_for_each_constructed_case(case, report, kind, advice):
    result = doctor_report.verdict(report)
    assert result["kind"] == kind, case
    assert result["text"].startswith(kind)
    if advice:
        assert any(advice in a for a in result["advice"]), result["advice"]
    else:
        assert not any("steps_per_loop" in a or "jit_compile" in a for a in result["advice"])


def test_the_plan_section_shows_the_table_of_plans_the_planner_measured():
    config = toy.toy_config()
    config.perf.plan_trial_s = 0.05
    config.perf.plan_rounds = 2
    report = doctor.diagnose(config, steps=10, sections=("plan",))
    plan = report["plan"]
    assert plan["applicable"] and plan["source"] == "measured", plan
    assert len(plan["plans"]) == 4
    # The doubled steps_per_loop is timed unless one call outlasts a trial (slow box).
    assert all(r["steps_per_s"] or r["dropped"].startswith("not timed") for r in plan["plans"])
    table = doctor_report.format_table(report)
    assert "(8) execution plan" in table and table.count("<- chosen") == 1
    assert "xla step, steps_per_loop 10" in table
    config.perf.plan = "fixed"
    fixed = doctor.diagnose(config, steps=10, sections=("plan",))["plan"]
    assert not fixed["applicable"] and "fixed" in fixed["note"]
