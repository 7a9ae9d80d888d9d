"""Telemetry: metrics.jsonl, TensorBoard events, input-wait estimate, regression
alerts, profiler windows and console progress."""

from __future__ import annotations

import glob
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from tests.support import toy
from tests.conftest import run_main
from tests.support.telemetry_trainers import (SLEEP_S, SLOW_FROM_STEP, BatchNormDropoutTrainer,
                                           HeavyCnnTrainer, SlowInputTrainer, TurnSlow,
                                           TurnsSlowTrainer, cnn_config)
from trainer import config as config_lib
from trainer.telemetry import alerts, probes, progress
from trainer.telemetry import service as telemetry


def _records(workdir: Path, kind: str) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _events(workdir: Path, run: str) -> dict[str, dict[int, object]]:
    """{tag: {step: value}} of the TensorBoard event files under workdir/run."""
    out: dict[str, dict[int, object]] = {}
    for path in glob.glob(str(workdir / run / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = tf.make_ndarray(value.tensor)
    return out


_RUN_CONFIG = '''
from tests.support import toy

def get_config():
    config = toy.toy_config(**{"train.steps": 40, "eval.every_steps": 20,
                               "telemetry.probe_every_windows": 1})
    config.trainer = "tests.support.toy:ToyEvalTrainer"
    return config
'''


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``trainer.main`` on ToyEvalTrainer with its output piped (not a TTY): 40 steps,
    a window every 10, eval every 20, a probe every window."""
    tmp = tmp_path_factory.mktemp("toy_run")
    config_file = tmp / "run_config.py"
    config_file.write_text(_RUN_CONFIG)
    proc = run_main(tmp / "workdir", config=str(config_file), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "workdir", proc


def test_metrics_jsonl_has_the_documented_keys_and_increasing_steps(toy_run):
    workdir, _ = toy_run
    train = _records(workdir, "train")
    assert [r["step"] for r in train] == [10, 20, 30, 40]
    for record in train:
        assert set(telemetry.TRAIN_KEYS) <= set(record), set(telemetry.TRAIN_KEYS) - set(record)
        assert "train/accuracy" in record
        assert record["perf/examples_per_s"] > 0 and record["perf/step_time_p90_s"] > 0
        assert record["mem/host_rss_mb"] > 0
    assert [r["perf/warmup"] for r in train] == [True, False, False, False]
    assert train[0]["perf/input_wait_fraction"] is None  # no probe before window 2
    assert all(0 <= r["perf/input_wait_fraction"] <= 1 for r in train[1:])
    evals = _records(workdir, "eval")
    assert [r["step"] for r in evals] == [20, 40]
    for record in evals:
        assert set(telemetry.EVAL_KEYS) | {"eval/accuracy"} <= set(record)


def test_tensorboard_event_files_hold_the_same_scalars(toy_run):
    workdir, _ = toy_run
    train, evals = _events(workdir, "train"), _events(workdir, "eval")
    jsonl = _records(workdir, "train")
    for tag in ("loss", "accuracy", "perf/examples_per_s", "perf/step_time_mean_s",
                "mem/host_rss_mb", "sys/host_cpu_percent", "precision/loss_scale"):
        assert sorted(train[tag]) == [10, 20, 30, 40], tag
    assert train["loss"][40] == pytest.approx(jsonl[-1]["train/loss"], rel=1e-6)
    assert sorted(evals["loss"]) == [20, 40] and sorted(evals["accuracy"]) == [20, 40]
    assert "sys/gpu_util_percent" not in train  # None values (no NVML here) are not written


def test_no_files_without_a_workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    toy.ToyTrainer(toy.toy_config(**{"train.steps": 10})).fit()
    assert list(tmp_path.iterdir()) == []


def _fit(trainer) -> telemetry.Telemetry:
    """Runs ``trainer.fit()`` and returns its telemetry service."""
    trainer.fit()
    return next(p for p in trainer.callbacks.services if isinstance(p, telemetry.Telemetry))


def test_slow_input_pipeline_shows_input_wait_above_half():
    config = toy.toy_config(**{"train.steps": 30, "train.log_every_steps": 5,
                               "telemetry.probe_every_windows": 1})
    records = _fit(SlowInputTrainer(config)).records
    waits = [r["perf/input_wait_fraction"] for r in records[1:]]
    assert min(waits) > 0.5, waits
    assert records[-1]["perf/pipeline_examples_per_s"] < records[-1]["perf/compute_examples_per_s"]


def test_compute_bound_cnn_shows_little_input_wait():
    """Negative control for the test above: a cached pipeline feeding a CNN."""
    config = cnn_config(**{"train.steps": 20, "train.log_every_steps": 5,
                           "telemetry.probe_every_windows": 1})
    records = _fit(HeavyCnnTrainer(config)).records
    waits = [r["perf/input_wait_fraction"] for r in records[1:]]
    assert max(waits) < 0.5, waits


def test_probe_budget_holds_periodic_probes_back_but_not_the_first():
    probe_steps = {}
    for budget in (0, 1e-9):
        config = toy.toy_config(**{"train.steps": 30, "train.log_every_steps": 5,
                                   "telemetry.probe_every_windows": 1,
                                   "telemetry.probe_budget": budget})
        records = _fit(toy.ToyTrainer(config)).records
        probe_steps[budget] = [r["perf/probe_step"] for r in records]
    assert probe_steps[0] == [None, 10, 15, 20, 25, 30]  # every window from the 2nd
    assert probe_steps[1e-9] == [None] + [10] * 5  # the first probe only


def test_probe_schedule_cadence_budget_and_out_of_turn_probes():
    off = probes.ProbeSchedule(every=0, budget=0)
    assert not any(off.due(w, slow=True, alert=True) for w in range(2, 10))
    uncapped = probes.ProbeSchedule(every=2, budget=0)
    assert uncapped.due(3)  # the first probe: at the first window asked
    uncapped.spent(0.1)
    assert [w for w in range(2, 9) if uncapped.due(w)] == [2, 4, 6, 8]
    assert uncapped.due(5, slow=True)
    capped = probes.ProbeSchedule(every=2, budget=0.01)
    capped.spent(60.0)  # far over 1% of the time elapsed so far
    assert not capped.due(2) and not capped.due(4)
    assert not capped.due(5, slow=True)  # a slow window is held to the budget
    assert capped.due(5, alert=True)  # an alert is judged from the current input


def test_an_input_bound_run_with_short_windows_probes_within_the_budget():
    """The batches a probe lets the train pipeline stock up made the next windows fast
    and the one after "slow", which probed again: 6 probes in 60 one-step windows here
    (budget and cadence ignored). Now: the first, then none until the budget allows."""
    config = toy.toy_config(**{"train.steps": 60, "train.log_every_steps": 1,
                               "train.steps_per_loop": 1})
    records = _fit(SlowInputTrainer(config)).records
    assert {r["perf/probe_step"] for r in records} == {None, 2}, [
        r["perf/probe_step"] for r in records]


def test_probes_leave_the_run_unchanged():
    """Probing every window trains bit-identical weights to not probing at all, with a
    model whose forward pass changes state (BatchNorm statistics, dropout seeds)."""
    weights = []
    for every in (1, 0):
        config = toy.toy_config(**{"train.steps": 30, "train.log_every_steps": 5,
                                   "telemetry.probe_every_windows": every,
                                   "telemetry.probe_budget": 0})
        trainer = BatchNormDropoutTrainer(config)
        records = _fit(trainer).records
        assert (records[-1]["perf/input_wait_fraction"] is None) == (every == 0)
        weights.append(trainer.model.get_weights())
    for probed, plain in zip(*weights):
        np.testing.assert_array_equal(probed, plain)


def test_input_probe_drains_prefetched_stock_before_timing():
    trainer = SlowInputTrainer(toy.toy_config(), None)
    probe = probes.InputProbe(trainer.context)
    floor_s = 0.5 * SLEEP_S
    stocks = []
    for _ in range(5):  # per fill-then-drain cycle, tf.data doubles the buffer limit
        # Idle, as between probes: the buffer fills with SLEEP_S-slow batches, up to two
        # chunks' worth or to its limit (no batch made for 1 s: ~30 batches' time).
        stocks.append(trainer.wait_for_stock(2 * 5, quiet_s=1.0))
        # Without floor_s, two chunks served from that stock often agree: ~1 ms/batch.
        assert probe.seconds_per_batch(5, floor_s) > 0.8 * SLEEP_S
    assert max(stocks) >= 2 * 5, stocks  # the probe did meet two chunks of stock


@pytest.mark.parametrize("slow_from, blips", [(SLOW_FROM_STEP, ()), (140, (100,))],
                         ids=["clean", "blip_before"])
def test_regression_alert_fires_and_names_input_wait(tmp_path, slow_from, blips):
    # 20-step windows: fast ones (the first is warm-up), then input-bound from slow_from.
    # The periodic probe runs at step 40, so the detector judges from window 100 on. With
    # the blip, steps 101-110 are slow: window 120 starts the slow streak and is probed
    # while the input is fast again, window 140 runs on the probe's prefetched stock and
    # window 160 continues the streak: the alert must judge the input of its own window.
    # No probe budget: the slow window 120 is probed however long the probe at 40 took.
    config = toy.toy_config(**{"train.steps": 180, "train.log_every_steps": 20,
                               "train.steps_per_loop": 10, "telemetry.probe_every_windows": 100,
                               "telemetry.alert_windows": 2, "telemetry.probe_budget": 0})
    _fit(TurnsSlowTrainer(config, str(tmp_path), callbacks=[TurnSlow(slow_from, blips)]))
    records = _records(tmp_path, "train")
    alerts = [r for r in records if r["alert"]]
    assert len(alerts) == 1, [r["alert"] for r in records]
    assert "input wait up" in alerts[0]["alert"], alerts[0]["alert"]
    assert alerts[0]["step"] > slow_from
    events = _events(tmp_path, "train")
    assert alerts[0]["step"] in events["alerts"]
    assert events["perf/regression_alert"][alerts[0]["step"]] == 1.0


def test_regression_detector_needs_a_sustained_drop():
    detector = alerts.RegressionDetector(drop=0.3, windows=2)
    flags = [detector.update(v) for v in (100, 100, 100, 65, 100, 65, 60, 60, 60)]
    assert [fire for _, fire in flags] == [False] * 6 + [True, False, False]
    assert [slow for slow, _ in flags][3] is True


def test_profile_window_traces_exactly_the_requested_steps(tmp_path):
    config = toy.toy_config(**{"train.steps": 20, "telemetry.profile_steps": "7:9,13:16",
                               "telemetry.probe_every_windows": 0})
    toy.ToyTrainer(config, str(tmp_path)).fit()
    root = tmp_path / "profile" / "plugins" / "profile"
    assert sorted(os.listdir(root)) == ["steps_13_16", "steps_7_9"]
    for name, steps in (("steps_7_9", 2), ("steps_13_16", 3)):
        (trace,) = glob.glob(str(root / name / "*.xplane.pb"))
        space = xplane_pb2.XSpace.FromString(Path(trace).read_bytes())
        get_next = 0
        for plane in space.planes:
            ids = {k for k, v in plane.event_metadata.items()
                   if v.name == "IteratorGetNextOp::DoCompute"}
            get_next += sum(ev.metadata_id in ids for line in plane.lines for ev in line.events)
        assert get_next == steps, (name, get_next)


def test_profile_steps_are_validated():
    assert config_lib.parse_profile_steps("200:210, 500:505") == [(200, 210), (500, 505)]
    for bad in ("200", "210:200", "a:b", "10:20,15:30"):
        with pytest.raises(config_lib.ConfigError, match="profile_steps"):
            config_lib.parse_profile_steps(bad)


def test_progress_without_a_tty_is_plain_lines(toy_run):
    _, proc = toy_run
    output = proc.stdout + proc.stderr
    assert "\r" not in output and "\x1b" not in output
    lines = output.splitlines()
    for step in (10, 20, 30, 40):
        assert any(line.startswith(f"step {step}/40: loss=") for line in lines), step
    assert any(line.startswith("eval  step 20: loss=") for line in lines)


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_tty_is_one_updating_bar(monkeypatch):
    """Negative control for the plain-lines test: a terminal gets carriage returns."""
    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    stream = _FakeTTY()
    monkeypatch.setattr(sys, "stderr", stream)
    toy.ToyTrainer(toy.toy_config(**{"train.steps": 20})).fit()
    text = stream.getvalue()
    assert text.count("\r") >= 4 and "ETA" in text and "20/20" in text


def test_progress_mode_env_overrides_config(monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_ENV, "lines")
    assert progress.progress_mode("bar", _FakeTTY()) == "lines"
    monkeypatch.delenv(progress.PROGRESS_ENV)
    monkeypatch.setenv("TF_CONFIG", "{}")
    assert progress.progress_mode("auto", _FakeTTY()) == "lines"  # under a launcher
    monkeypatch.delenv("TF_CONFIG")
    assert progress.progress_mode("auto", _FakeTTY()) == "bar"
    assert progress.progress_mode("auto", io.StringIO()) == "lines"


def test_likely_cause_names_memory_and_skipped_steps():
    current = {"perf/input_wait_fraction": 0.05, "mem/host_memory_fraction": 0.95,
               "precision/skipped_steps": 7, "sys/host_cpu_percent": 50.0,
               "sys/process_cpu_percent": 90.0}
    cause = alerts.likely_cause(current, {"perf/input_wait_fraction": 0.04,
                                             "precision/skipped_steps": 2})
    assert "memory near limit" in cause and "5 skipped" in cause and "input" not in cause
    assert "profile_steps" in alerts.likely_cause(
        {"perf/input_wait_fraction": 0.0}, {"perf/input_wait_fraction": 0.0})


@pytest.mark.parametrize("wait, step_ms, named", [
    (0.88, 32.0, True),   # already input-bound at 72%: the added wait is the slowdown
    (0.40, 32.0, False),  # 40% of the step waits, but most of the added 31 ms is compute
    (0.20, 32.0, False),  # under the 30% floor
])
def test_likely_cause_weighs_added_input_wait_against_added_step_time(wait, step_ms, named):
    baseline = {"perf/input_wait_fraction": 0.72, "perf/step_time_mean_s": 0.0007}
    current = {"perf/input_wait_fraction": wait, "perf/step_time_mean_s": step_ms / 1e3}
    cause = alerts.likely_cause(current, baseline)
    assert ("input wait up" in cause) == named, cause
    if named:
        assert "88% of a 32 ms step (was 72% of a 0.7 ms step)" in cause
