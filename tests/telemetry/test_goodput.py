"""Goodput (trainer.telemetry.goodput): where a run's time went, over its restarts.

A run SIGKILLed after a checkpoint, then run again to the end (real processes): the
workdir's record holds both attempts; the steps the first recorded past the checkpoint
the second resumed from are its wasted progress, the gap between them infrastructure
recovery, and the categories add up to the wall time. An uninterrupted run (in this
process) wastes nothing and reports its numbers at the end of fit() on every output.
"""

from __future__ import annotations

import glob
import json
import time
from pathlib import Path

import pytest
import tensorflow as tf

from tests.conftest import MainProcess, run_main
from tests.support import toy
from trainer.telemetry import goodput_record

STEPS, EVERY = 60, 20
_CONFIG = f'''
from tests.support import toy

def get_config():
    config = toy.toy_config(**{{"train.steps": {STEPS}, "train.log_every_steps": 5,
                               "checkpoint.every_steps": {EVERY}}})
    config.trainer = "tests.support.telemetry_trainers:SlowInputTrainer"  # 0.03 s a batch
    return config
'''


def _attempts(workdir: Path) -> list[dict]:
    try:
        return json.loads((workdir / goodput_record.FILE).read_text())["attempts"]
    except FileNotFoundError:
        return []


def _assert_adds_up(summed: dict) -> None:
    """Every category is >= 0 and they add up to the wall time; goodput in (0, 1]."""
    seconds = summed["seconds"]
    assert set(seconds) == set(goodput_record.CATEGORIES)
    assert all(v >= -1e-6 for v in seconds.values()), seconds
    assert sum(seconds.values()) == pytest.approx(summed["total_s"], abs=0.05), summed
    assert 0 < summed["goodput"] <= 1, summed


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory) -> tuple[Path, dict, str]:
    """The run SIGKILLed once its record shows a window past the checkpoint of step
    EVERY (committed), then run again to the end: (workdir, the first attempt's record
    as the kill left it, the second run's stderr)."""
    tmp = tmp_path_factory.mktemp("goodput")
    config, workdir = tmp / "config.py", tmp / "run"
    config.write_text(_CONFIG)
    first = MainProcess(workdir, config=str(config))
    deadline = time.monotonic() + 240
    while not (_attempts(workdir) and _attempts(workdir)[0]["last_step"] > EVERY
               and (workdir / "checkpoints" / str(EVERY)).is_dir()):
        assert time.monotonic() < deadline, "the first attempt made no progress"
        time.sleep(0.02)
    first.stop()  # SIGKILL: a lost VM
    killed = first.result()
    assert killed.returncode == -9, killed.stderr[-3000:]
    recorded = _attempts(workdir)[0]
    second = run_main(workdir, config=str(config))
    assert second.returncode == 0, second.stderr[-3000:]
    return workdir, recorded, second.stderr


def test_a_killed_and_resumed_run_counts_the_redone_steps_and_the_recovery(
        killed_and_resumed):
    workdir, recorded, _ = killed_and_resumed
    first, second = _attempts(workdir)
    assert first == recorded  # the killed attempt's record stays as the kill left it
    restored = second["restored_step"]
    assert EVERY <= restored < first["last_step"] < STEPS
    assert second["wasted_steps"] == first["last_step"] - restored > 0
    assert second["wasted_s"] == pytest.approx(second["wasted_steps"] * first["step_s"])
    assert 0 <= second["wasted_input_s"] <= second["wasted_s"]
    assert second["recovery_s"] > 0
    assert second["seconds"]["checkpoint_restore"] > 0
    assert second["last_step"] == STEPS
    summed = goodput_record.summary([first, second])
    _assert_adds_up(summed)
    assert summed["total_s"] == pytest.approx(second["last_time"] - first["start"])
    assert summed["seconds"]["wasted_progress"] > 0
    assert summed["seconds"]["infrastructure_recovery"] == second["recovery_s"]


def test_the_resumed_run_reports_the_sum_over_both_attempts(killed_and_resumed):
    workdir, _, stderr = killed_and_resumed
    (record,) = [json.loads(line) for line in (workdir / "metrics.jsonl").open()
                 if '"kind": "goodput"' in line]
    summed = goodput_record.summary(_attempts(workdir))
    assert record["goodput/attempts"] == 2
    assert record["goodput/goodput"] == pytest.approx(summed["goodput"])
    assert record["goodput/wasted_steps"] == summed["wasted_steps"] > 0
    table = goodput_record.table(record)
    assert table in stderr, stderr[-3000:]
    assert "over 2 attempts" in table and "steps redone" in table


def test_an_uninterrupted_run_wastes_nothing_and_reports_on_every_output(tmp_path):
    config = toy.toy_config(**{"train.steps": 20, "train.log_every_steps": 5,
                               "checkpoint.every_steps": 10})
    with toy.ToyTrainer(config, str(tmp_path)) as trainer:
        trainer.fit()
    (attempt,) = _attempts(tmp_path)
    assert attempt["restored_step"] == 0 and attempt["last_step"] == 20
    assert attempt["wasted_steps"] == 0 and attempt["recovery_s"] == 0
    assert attempt["seconds"]["checkpoint_save"] > 0
    summed = goodput_record.summary([attempt])
    _assert_adds_up(summed)
    assert summed["seconds"]["wasted_progress"] == 0
    event = trainer.events.latest("goodput")
    assert event["goodput/goodput"] == pytest.approx(summed["goodput"])
    tags = set()
    for path in glob.glob(str(tmp_path / "train" / "events.out.tfevents.*")):
        for summary in tf.compat.v1.train.summary_iterator(path):
            tags.update(value.tag for value in summary.summary.value)
    assert {"goodput/goodput", "goodput/productive_s", "goodput/wasted_progress_s"} <= tags
