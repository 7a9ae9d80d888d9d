"""The doctor agrees with itself: one XLA figure (the execution plan's, on the real run)
in sections (5) and (8) and advice that follows it; measuring phases that say what they
do (no training progress, no ETA); a time budget stated at the start and kept; and a
set-up log that says what XLA compiles."""

from __future__ import annotations

import logging

import pytest

from tests.support import toy
from trainer.doctor import measure as doctor
from trainer.doctor import report as doctor_report
from trainer.doctor.phases import Phases
from trainer.doctor.thread_pools import measure_threads
from trainer.telemetry.service import setup_report

_CORE = ("baseline", "input", "compute")


def _fast_plan_config():
    config = toy.toy_config()
    config.perf.plan_trial_s = 0.05
    config.perf.plan_rounds = 2
    return config


def test_the_xla_figure_is_the_plans_figure_and_no_training_progress_is_shown(capsys):
    said: list[str] = []
    report = doctor.diagnose(_fast_plan_config(), steps=10, sections=("jit", "plan"),
                             say=said.append)
    plan, jit = report["plan"], report["jit"]
    assert plan["applicable"] and plan["source"] == "measured", plan
    assert jit["applicable"] and jit["source"] == "plan", jit
    # The configured plan has XLA off: (5) is exactly (8)'s XLA row at that loop length.
    row = next(r for r in plan["plans"]
               if r["xla"] == jit["setting"] and r["steps_per_loop"] == 5)
    assert jit["setting"] == "step" and jit["configured"] == "off"
    assert jit["speedup"] == row["vs_baseline"]
    assert jit["on_examples_per_s"] == row["steps_per_s"] * 32
    table = doctor_report.format_table(report)
    assert f"{row['vs_baseline']:.2f}x vs off: the median of the per-round ratios" in table
    assert f"{row['vs_baseline']:.2f}x the configured" in table
    # The plan's open-ended run shows no training progress; the phases show their own.
    err = capsys.readouterr().err
    assert "ETA" not in err and "/10000000" not in err, err[-2000:]
    assert said[0].startswith("doctor: measuring jit, plan within a time budget of 60 s")
    assert said[1].startswith("doctor: (8) execution plan, trials on the real run ...")
    assert said[2].startswith("doctor:     plan: xla ") and "; measured " in said[2]
    assert said[3].startswith("doctor: (8) execution plan, trials on the real run done in")
    assert said[4].startswith("doctor: (5) XLA on vs off (the execution plan's figure) ...")
    assert said[-1].startswith("doctor: done in")


def _plan_record(configured: str, step_score: float, chosen: str) -> dict:
    """A measured plan record (the shape trainer.loop.plan writes), steps_per_loop 5."""
    base = 1000.0
    scores = {configured: 1.0, "step": step_score}
    scores.setdefault("off", 1.0)
    return {"applicable": True, "source": "measured",
            "baseline": {"xla": configured, "steps_per_loop": 5},
            "chosen": {"xla": chosen, "steps_per_loop": 5},
            "plans": [{"xla": x, "steps_per_loop": 5, "steps_per_s": base * s,
                       "vs_baseline": s} for x, s in scores.items()]}


@pytest.mark.parametrize("configured, step_score, chosen, plan_mode, advice", [
    # The run: XLA at 0.66x on the real run -> no advice to turn it on.
    ("off", 0.66, "off", "auto", None),
    ("off", 1.42, "step", "auto", "runs the real run 1.42x as fast (sections 5 and 8): "
                                  "perf.plan='auto' (the default) chose it"),
    ("off", 1.42, "off", "fixed", "set perf.plan='auto', which measures and keeps it"),
    ("grads", 1.0, "grads", "auto", None),
])
def test_the_xla_advice_follows_the_plans_figure(configured, step_score, chosen, plan_mode,
                                                 advice):
    jit = doctor_report.xla_figure(_plan_record(configured, step_score, chosen), 32)
    assert jit["speedup"] == pytest.approx(step_score)
    xla = _xla_advice(jit, plan_mode)
    if advice is None:
        assert xla == [], xla
    else:
        assert len(xla) == 1 and advice in xla[0], xla


def _xla_advice(jit: dict, plan_mode: str) -> list[str]:
    report = {"config": {"device": "CPU", "plan": plan_mode},
              "baseline": {"examples_per_s": 950}, "input": {"examples_per_s": 5000},
              "compute": {"examples_per_s": 1000}, "jit": jit}
    return [a for a in doctor_report.verdict(report)["advice"] if "XLA" in a or "jit" in a]


def test_configured_xla_that_slows_the_real_run_is_advised_off():
    record = _plan_record("grads", 1.0, "off")
    record["plans"][-1]["vs_baseline"] = 1.5  # no XLA: 1.5x the configured grads plan
    jit = doctor_report.xla_figure(record, 32)
    assert jit["speedup"] == pytest.approx(1 / 1.5)
    advice = _xla_advice(jit, "auto")
    assert len(advice) == 1 and "set perf.jit_compile=False" in advice[0], advice


def test_a_spent_budget_skips_the_optional_sections_with_the_reason():
    said: list[str] = []
    report = doctor.diagnose(toy.toy_config(), steps=5,
                             sections=_CORE + ("batch", "jit", "layers", "plan"),
                             time_budget_s=0, say=said.append)
    assert said[0].startswith("doctor: measuring baseline, input, compute, batch, jit, "
                              "layers, plan within a time budget of 0 s (--time_budget_s)")
    for section in _CORE:
        assert report[section]["examples_per_s"] > 0  # the verdict's sections always run
    assert report["verdict"]["kind"]
    for section in ("batch", "jit", "layers", "plan"):
        assert report[section]["skipped"] and report[section]["note"].startswith(
            "not measured: the time budget of 0 s (--time_budget_s) was spent after"), section
    table = doctor_report.format_table(report)
    assert table.count("not measured: the time budget of 0 s") == 4, table


def test_phases_start_while_the_budget_lasts():
    now = [0.0]
    said: list[str] = []
    phases = Phases(10.0, said.append, clock=lambda: now[0])
    phases.start(["baseline", "layers", "batch"])

    def takes(seconds):
        def measure():
            now[0] += seconds
            return {"measured": True}
        return measure

    assert phases.run("layers", "(7) layers", takes(11.0)) == {"measured": True}
    assert phases.run("batch", "(4) batch", takes(1.0))["skipped"]
    assert phases.run("baseline", "(1) real run", takes(1.0)) == {"measured": True}
    assert said[1:] == ["doctor: (7) layers ... (0.0 s of 10 s)",
                        "doctor: (7) layers done in 11.0 s",
                        "doctor: (4) batch: not measured: the time budget of 10 s "
                        "(--time_budget_s) was spent after 11.0 s",
                        "doctor: (1) real run ... (11.0 s of 10 s)",
                        "doctor: (1) real run done in 1.0 s"]


def test_the_measurements_made_of_several_runs_stop_at_the_deadline(tmp_path):
    threads = measure_threads(5, str(tmp_path / "config.py"), [], deadline=0.0)
    assert threads == {"applicable": False,
                       "note": "the time budget ran out after 0 of the 3 settings' first "
                               "runs (raise --time_budget_s)"}
    batch = doctor.search_batch(toy.toy_config(), steps=5, doublings=2, memory_budget_mb=1e9,
                                deadline=0.0)
    assert [r["global_batch_size"] for r in batch["tried"]] == [32]
    assert batch["stopped"] == "the time budget ran out before global batch 64"


@pytest.mark.parametrize("trainer_class, jit, compiled", [
    (toy.ToyTrainer, True, "the default train_step's forward and backward pass "
                           "(perf.jit_compile=True"),
    (toy.PerReplicaMeanTrainer, True, "nothing compiled: perf.jit_compile=True compiles the "
                                      "default train_step's forward and backward pass, and "
                                      "this Trainer overrides train_step"),
    (toy.ToyTrainer, False, "nothing compiled (perf.jit_compile=False)"),
])
def test_the_setup_report_says_what_xla_compiles(trainer_class, jit, compiled, caplog):
    caplog.set_level(logging.INFO, logger="absl")
    t = trainer_class(toy.toy_config(**{"perf.jit_compile": jit}))
    xla_line = next(line for line in setup_report(t.context).splitlines()
                    if line.startswith("  XLA: "))
    assert xla_line.startswith(f"  XLA: {compiled}"), xla_line
    logged = [r.getMessage() for r in caplog.records if "jit_compile" in r.getMessage()]
    if trainer_class is toy.PerReplicaMeanTrainer:
        assert logged and "has no effect" in logged[0], logged
    assert not any("forward and backward pass compiled with XLA" in m for m in logged) or (
        trainer_class is toy.ToyTrainer and jit)
