"""The execution planner's decisions (trainer.loop.plan), driven through its public calls with
synthetic loop timings: which plan each call runs, what it chooses, when it does not
measure, what it adopts, and that every worker follows the chief."""

from __future__ import annotations

import datetime
import json
import logging
import math

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings, strategies as st

from trainer import config as config_lib
from trainer.loop.plan import Planner
from trainer.loop.plan_space import Plan, candidates, pack_alternatives
from trainer.loop.plan_cache import PlanCache

SIGNATURE = {"strategy": "OneDeviceStrategy", "replicas": 1, "workers": 1,
             "devices": ["CPU"], "gpus": [], "cpus": 2, "tensorflow": "2.21.0"}


def make_config(**perf):
    config = config_lib.get_config()
    config.train.steps_per_loop = perf.pop("steps_per_loop", 50)
    config.train.log_every_steps = perf.pop("log_every_steps", 100)
    config.perf.plan_min_run_s = 0.0
    for key, value in perf.items():
        config.perf[key] = value
    return config


def make_planner(config, xla_problem=None, xla_error=None, from_chief=None,
                 signature=SIGNATURE, cache=None, pack_sizes=()):
    baseline = Plan("grads" if config.perf.jit_compile else "off", config.train.steps_per_loop,
                    config.distribute.grad_pack_bytes)
    return Planner(config, baseline, xla_problem, xla_error or (lambda setting: None),
                   from_chief or (lambda words: words), signature, cache, pack_sizes)


def step_time(xla_speedup, packs_speedup=1.0):
    """Seconds per step of a plan: 1 ms, divided by ``xla_speedup`` with XLA and by
    ``packs_speedup`` with all-reduce packs."""
    return lambda plan: 1e-3 / ((xla_speedup if plan.xla == "step" else 1.0)
                                * (packs_speedup if plan.pack_bytes else 1.0))


def drive(planner, step_seconds, total_steps, log_every, call_overhead=0.0, decided_at=None):
    """Runs the driver's protocol: ``step_seconds(plan)`` per step, plus
    ``call_overhead`` per call. Returns (calls as (plan, steps), decision records);
    ``decided_at`` (a list) receives the number of calls made when it decided."""
    step, calls, records = 0, [], []
    while step < total_steps:
        plan = planner.next_plan()
        next_log = (step // log_every + 1) * log_every
        steps = min(plan.steps_per_loop, total_steps - step, next_log - step)
        seconds = steps * step_seconds(plan) + call_overhead
        step += steps
        calls.append((plan, steps))
        record = planner.after_call(plan, steps, seconds, total_steps - step)
        if record is not None:
            records.append(record)
            if decided_at is not None:
                decided_at.append(len(calls))
    return calls, records


def test_candidates_are_the_config_first_then_xla_and_doubled_loops():
    assert candidates(Plan("off", 50), 100, True) == [
        Plan("off", 50), Plan("off", 100), Plan("step", 50), Plan("step", 100)]
    # perf.jit_compile=True (forward + backward): the whole step and no XLA are tried too.
    assert [p.xla for p in candidates(Plan("grads", 50), 100, True)] == [
        "grads", "grads", "step", "step", "off", "off"]
    # Doubling past the logging window changes nothing: calls end there anyway.
    assert candidates(Plan("off", 100), 100, False) == [Plan("off", 100)]
    assert candidates(Plan("off", 80), 100, False) == [Plan("off", 80), Plan("off", 100)]


def test_pack_sizes_are_timed_only_where_gradients_cross_hosts():
    mib = 1 << 20
    as_vars = [tf.Variable(tf.zeros((1024, 2048))), tf.Variable(tf.zeros((2048,)))]  # 8 MiB
    assert pack_alternatives(0, as_vars, workers=1) == ()  # one host: nothing crosses
    assert pack_alternatives(0, as_vars[1:], workers=2) == ()  # under 4 MiB: one pack anyway
    assert pack_alternatives(0, as_vars, workers=2) == (4 * mib,)  # half the largest
    assert pack_alternatives(4 * mib, as_vars, workers=2) == (0,)  # configured: vs one batch
    # Nine layers of 1 MiB: packs of an eighth of all (1.1 MiB), not half a layer.
    layers = [tf.Variable(tf.zeros((512, 512))) for _ in range(9)]
    assert pack_alternatives(0, layers, workers=2) == (9 * mib // 8,)
    assert candidates(Plan("off", 50), 100, False, (3 * mib,)) == [
        Plan("off", 50), Plan("off", 50, 3 * mib), Plan("off", 100), Plan("off", 100, 3 * mib)]
    assert Plan("off", 50, 3 * mib).describe() == (
        "xla off, steps_per_loop 50, all-reduce packs of 3 MiB")
    # A record written before pack sizes were planned reads as one batched all-reduce.
    assert Plan.from_dict({"xla": "off", "steps_per_loop": 50}) == Plan("off", 50, 0)


def test_faster_packs_are_chosen_and_each_pack_sizes_first_call_is_not_timed():
    """A pack size's first call traces its step: however slow, it does not count."""
    packs = 3 << 20
    traced = set()

    def seconds(plan):
        first = plan.trace_key not in traced
        traced.add(plan.trace_key)
        return step_time(1.0, packs_speedup=1.2)(plan) + (5.0 if first else 0.0)

    planner = make_planner(make_config(), xla_problem="two workers", pack_sizes=(packs,))
    _, (record,) = drive(planner, seconds, 200_000, 100, call_overhead=1e-3)
    assert record["source"] == "measured"
    assert [(r["steps_per_loop"], r["pack_bytes"]) for r in record["plans"]] == [
        (50, 0), (50, packs), (100, 0), (100, packs)]
    assert record["chosen"] == {"xla": "off", "steps_per_loop": 100, "pack_bytes": packs}
    by_plan = {Plan.from_dict(r): r["vs_baseline"] for r in record["plans"]}
    assert 1.15 < by_plan[Plan("off", 50, packs)] < 1.25  # the trace's 5 s is not in it


def test_a_faster_xla_is_chosen_and_reported_with_every_plans_rate():
    planner = make_planner(make_config())
    calls, records = drive(planner, step_time(1.3), 200_000, 100,
                           call_overhead=1e-3)
    (record,) = records
    assert record["source"] == "measured"
    assert record["chosen"] == {"xla": "step", "steps_per_loop": 100, "pack_bytes": 0}
    assert record["ratio"] > 1.3  # and fewer calls
    assert len(record["plans"]) == 4 and all(row["steps_per_s"] for row in record["plans"])
    assert all(plan == Plan("step", 100) for plan, _ in calls[-10:])


def test_the_configured_plan_stays_unless_another_is_measurably_faster():
    planner = make_planner(make_config())
    _, (record,) = drive(planner, step_time(1.005), 200_000, 100)
    assert record["chosen"] == record["baseline"] == {"xla": "off", "steps_per_loop": 50,
                                                      "pack_bytes": 0}


def test_a_slower_xla_is_not_chosen_and_fewer_calls_win_on_host_overhead():
    planner = make_planner(make_config())
    _, (record,) = drive(planner, step_time(0.56), 200_000, 100,
                         call_overhead=5e-3)
    assert record["chosen"] == {"xla": "off", "steps_per_loop": 100, "pack_bytes": 0}


def test_steps_long_next_to_a_trial_time_only_xla_in_trial_sized_calls():
    """A 50-step call of 50 ms steps outlasts a 0.2 s trial: steps_per_loop is not
    measured (its per-call overhead is amortized) and XLA is timed in short calls, so
    measuring stays within its budget."""
    planner = make_planner(make_config())
    heavy = lambda plan: 0.05 / (1.3 if plan.xla == "step" else 1.0)  # noqa: E731
    calls, (record,) = drive(planner, heavy, 100_000, 100)
    timed = [(r["xla"], r["steps_per_loop"]) for r in record["plans"] if "dropped" not in r]
    assert timed == [("off", 50), ("step", 50)]
    assert record["chosen"] == {"xla": "step", "steps_per_loop": 50, "pack_bytes": 0}
    decided = calls.index((Plan("step", 50), 50))  # the first call of the chosen plan
    trial_calls = calls[2:decided]  # after the two warm-up calls
    assert trial_calls and all(steps <= 4 for _, steps in trial_calls)  # 0.2 s / 50 ms
    assert sum(steps for _, steps in calls[:decided]) < 200


def test_short_runs_and_single_candidates_are_not_measured():
    planner = make_planner(make_config(plan_min_run_s=30.0))
    calls, (record,) = drive(planner, lambda p: 1e-3, 2_000, 100)  # ~2 s
    assert record["source"] == "skipped" and "perf.plan_min_run_s=30" in record["reason"]
    assert {plan for plan, _ in calls} == {Plan("off", 50)}
    planner = make_planner(make_config(steps_per_loop=100), xla_problem="two replicas")
    _, (record,) = drive(planner, lambda p: 1e-3, 100_000, 100)
    assert record["source"] == "skipped"
    assert record["reason"] == "one candidate plan (XLA two replicas)"


def test_a_fixed_plan_runs_the_config_and_is_never_saved():
    planner = make_planner(make_config(plan="fixed"))
    calls, records = drive(planner, step_time(2.0), 200_000, 100)
    assert records == [] and {plan for plan, _ in calls} == {Plan("off", 50)}
    assert planner.saved() is None


def test_a_plan_xla_cannot_lower_is_dropped_before_it_runs():
    asked = []

    def lowering(setting):
        asked.append(setting)
        return "InvalidArgumentError: PyFunc"

    planner = make_planner(make_config(), xla_error=lowering)
    calls, (record,) = drive(planner, lambda p: 1e-3, 200_000, 100)
    assert asked == ["step"]  # once, before any step of it
    assert all(plan.xla == "off" for plan, _ in calls)
    dropped = [row for row in record["plans"] if "dropped" in row]
    assert [row["xla"] for row in dropped] == ["step", "step"]
    assert "XLA cannot lower the step: InvalidArgumentError: PyFunc" == dropped[0]["dropped"]


def test_a_checkpoints_plan_is_adopted_only_on_the_same_signature():
    measured = make_planner(make_config())
    drive(measured, step_time(1.3), 200_000, 100, call_overhead=1e-3)
    saved = measured.saved()
    assert saved == {"chosen": {"xla": "step", "steps_per_loop": 100, "pack_bytes": 0},
                     "signature": SIGNATURE}
    again = make_planner(make_config())
    assert again.adopt(saved)["source"] == "checkpoint"
    assert again.next_plan() == Plan("step", 100)
    moved = make_planner(make_config(), signature={**SIGNATURE, "cpus": 64})
    assert moved.adopt(saved) is None and not moved.decided
    for foreign in ({"chosen": {"xla": True}}, {"chosen": "fast"}, {}):  # other versions
        assert make_planner(make_config()).adopt(foreign) is None


# What a plan cache key holds (trainer.loop.plan_cache.key_fields builds it from a run).
KEY = {"trainer": "m:T", "variables": [["dense/kernel", [4, 2], "float32"]],
       "batch": "TensorSpec(shape=(16, 4))", "settings": {"global_batch_size": 16},
       "signature": SIGNATURE}


def test_a_measured_plan_is_cached_and_a_later_run_of_its_key_adopts_it_at_once(tmp_path):
    measured = make_planner(make_config(), cache=PlanCache(str(tmp_path), KEY))
    drive(measured, step_time(1.3), 200_000, 100, call_overhead=1e-3)
    (stored,) = tmp_path.glob("*.json")
    assert json.loads(stored.read_text())["chosen"] == {
        "xla": "step", "steps_per_loop": 100, "pack_bytes": 0}
    later = make_planner(make_config(), cache=PlanCache(str(tmp_path), KEY))
    record = later.adopt(None)  # no checkpoint: a new workdir
    assert record["source"] == "cached" and later.next_plan() == Plan("step", 100)
    assert record["measured_at"] == datetime.date.today().isoformat()
    calls, records = drive(later, step_time(1.0), 100, 100)  # a short run: no measuring
    assert records == [] and {plan for plan, _ in calls} == {Plan("step", 100)}
    assert later.saved() == {"chosen": record["chosen"], "signature": SIGNATURE}
    # Another key (a changed batch) measures again, as with no cache.
    other = {**KEY, "batch": "TensorSpec(shape=(32, 4))"}
    assert make_planner(make_config(), cache=PlanCache(str(tmp_path), other)).adopt(None) is None
    # A checkpoint's plan on this signature comes first.
    resumed = make_planner(make_config(), cache=PlanCache(str(tmp_path), KEY))
    assert resumed.adopt({"chosen": {"xla": "off", "steps_per_loop": 50},
                          "signature": SIGNATURE})["source"] == "checkpoint"


def test_a_corrupt_cache_file_is_one_warning_and_the_run_measures_and_rewrites_it(
        tmp_path, caplog):
    cache = PlanCache(str(tmp_path), KEY)
    for corrupt in ("{not json", '{"chosen": {"xla": "step"}}', "[]"):
        with open(cache.path, "w") as f:
            f.write(corrupt)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            planner = make_planner(make_config(), cache=cache)
            assert planner.adopt(None) is None
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and warnings[0].startswith(
            f"plan cache: {cache.path} cannot be read"), warnings
    drive(planner, step_time(1.3), 200_000, 100, call_overhead=1e-3)
    assert cache.read()["chosen"] == planner.chosen.to_dict()


def test_every_worker_adopts_the_plan_the_chiefs_cache_holds(tmp_path):
    drive(make_planner(make_config(), cache=PlanCache(str(tmp_path), KEY)), step_time(1.3),
          200_000, 100, call_overhead=1e-3)
    sent = []
    chief = make_planner(make_config(), cache=PlanCache(str(tmp_path), KEY),
                         from_chief=lambda words: sent.append(words.copy()) or words)
    chief_record = chief.adopt(None)
    assert chief_record["source"] == "cached"
    # A worker has no cache (None off the chief): it gets the chief's words.
    worker = make_planner(make_config(), from_chief=lambda words: sent[-1])
    assert worker.adopt(None) == chief_record
    assert worker.next_plan() == chief.next_plan()


def test_every_worker_follows_the_chiefs_decisions():
    """A worker whose own timings favour XLA still runs what the chief chose."""
    chief_words = {}

    def chief(words):
        chief_words.setdefault(len(chief_words), words.copy())
        return words

    chief_planner = make_planner(make_config(), from_chief=chief)
    drive(chief_planner, step_time(0.5), 200_000, 100)
    sent = list(chief_words.values())
    received = iter(sent)
    worker = make_planner(make_config(), from_chief=lambda words: next(received))
    _, (record,) = drive(worker, step_time(3.0), 200_000, 100)
    assert record["chosen"] == chief_planner.record["chosen"]
    assert record["chosen"]["xla"] == "off"


@settings(max_examples=60, deadline=None)
@given(steps_per_loop=st.integers(1, 200), log_every=st.integers(1, 300),
       total=st.integers(1, 5_000), xla_speed=st.floats(0.3, 3.0),
       overhead=st.floats(0.0, 0.01), xla_allowed=st.booleans(),
       rounds=st.integers(1, 6), packs=st.sampled_from([(), (2 << 20,)]),
       packs_speed=st.floats(0.5, 2.0))
def test_plans_respect_the_cadence_and_the_budget(steps_per_loop, log_every, total, xla_speed,
                                                  overhead, xla_allowed, rounds, packs,
                                                  packs_speed):
    config = make_config(steps_per_loop=steps_per_loop, log_every_steps=log_every,
                         plan_rounds=rounds)
    planner = make_planner(config, xla_problem=None if xla_allowed else "not allowed",
                           pack_sizes=packs)
    decided_at = []
    calls, records = drive(planner, step_time(xla_speed, packs_speed), total, log_every,
                           overhead, decided_at)
    assert sum(steps for _, steps in calls) == total  # every step once, none repeated
    assert all(1 <= steps <= plan.steps_per_loop for plan, steps in calls)
    # Plans are candidates, or a candidate's trace key in trial-sized calls.
    keys = {p.trace_key for p in planner.plans}
    assert all(plan in planner.plans or (
        plan.trace_key in keys and plan.steps_per_loop <= planner.baseline.steps_per_loop)
        for plan, _ in calls)
    assert len(records) <= 1
    if planner.decided and records and records[0]["source"] == "measured":
        record = records[0]
        # Noiseless timings: the winner is the fastest plan, or the config on a near tie.
        scores = {Plan.from_dict(r): r["vs_baseline"] for r in record["plans"]
                  if r["vs_baseline"] is not None}
        best = max(scores.values())
        chosen = Plan.from_dict(record["chosen"])
        assert scores[chosen] == best or (best <= 1.01 and record["chosen"] == record["baseline"])
        assert math.isfinite(record["measure_s"])
    # After the decision, every call runs the chosen plan.
    if decided_at:
        assert all(plan == planner.chosen for plan, _ in calls[decided_at[0]:])


def test_plan_config_is_validated():
    config = config_lib.get_config()
    config.perf.plan = "fastest"
    with pytest.raises(config_lib.ConfigError,
                       match="perf.plan='fastest' must be 'auto' or 'fixed'"):
        config_lib.validate(config)
    config = config_lib.get_config()
    config.perf.plan_rounds = 0
    with pytest.raises(config_lib.ConfigError, match="perf.plan_rounds"):
        config_lib.validate(config)
    assert np.isfinite(config_lib.get_config().perf.plan_min_run_s)
