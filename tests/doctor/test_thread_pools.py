"""TensorFlow's thread pools: ``distribute.{inter,intra}_op_threads`` applied before the
runtime starts (a fresh process), refused once it runs with other sizes, and the
doctor's ``threads`` section timing the real run under each setting, one process each."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, subprocess_env
from trainer.doctor import report as doctor_report
from trainer.doctor import thread_pools

APPLY = """
import tensorflow as tf
from trainer import config as config_lib
from trainer.distribution import strategies
config = config_lib.get_config()
config.distribute.strategy = "one_device"
config.distribute.intra_op_threads = 1
strategy = strategies.build_strategy(config.distribute)
print("intra", tf.config.threading.get_intra_op_parallelism_threads())
print("inter", tf.config.threading.get_inter_op_parallelism_threads())
print(strategies.describe(strategy))
config.distribute.intra_op_threads = 2
try:
    strategies.build_strategy(config.distribute)
except config_lib.ConfigError as error:
    print("refused:", error)
"""


def test_pool_sizes_apply_before_the_runtime_and_a_later_change_is_refused():
    proc = subprocess.run([sys.executable, "-c", APPLY], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "intra 1" in out and "inter 0" in out
    assert "thread pools: inter-op TF default, intra-op 1" in out
    refused = next(line for line in out.splitlines() if line.startswith("refused:"))
    assert "distribute.intra_op_threads=2" in refused and "fresh process" in refused


def test_doctor_times_the_real_run_under_each_setting_in_its_own_process():
    threads = thread_pools.measure_threads(
        steps=20, config_path=str(REPO / "models" / "configs" / "digits.py"),
        overrides=["--config.train.steps_per_loop=10"], repeats=1)
    assert threads["applicable"], threads
    rows = threads["settings"]
    assert [(r["inter_op_threads"], r["intra_op_threads"]) for r in rows] == list(
        thread_pools.SETTINGS)
    assert all(r["examples_per_s"] > 0 and len(r["runs"]) == 1 for r in rows)
    assert rows[0]["vs_default"] == 1.0
    advised = threads["advised"]
    assert advised is None or (advised in rows and advised["vs_default"] >= thread_pools.GAIN)
    table = doctor_report.format_table({"config": CONFIG, "threads": threads})
    assert "(9) thread pools (inter/intra)" in table and "    TF/1" in table


def test_doctor_without_a_config_file_says_why_it_cannot_time_the_pools():
    threads = thread_pools.measure_threads(steps=20, config_path=None, overrides=())
    assert not threads["applicable"] and "config file" in threads["note"]


CONFIG = {"trainer": "t", "global_batch_size": 64, "replicas": 1, "strategy": "Default",
          "precision": "float32", "steps_per_loop": 10, "steps": 20}


def _threads(intra_one_gain: float) -> dict:
    rows = [{"inter_op_threads": i, "intra_op_threads": j, "examples_per_s": 100 * g,
             "runs": [100 * g], "vs_default": g}
            for (i, j), g in zip(thread_pools.SETTINGS, (1.0, intra_one_gain, 0.9))]
    best = max(rows, key=lambda r: r["vs_default"])
    return {"applicable": True, "repeats": 2, "settings": rows,
            "advised": best if best["vs_default"] >= thread_pools.GAIN else None}


def test_the_verdict_advises_a_pool_size_only_when_it_pays():
    base = {"config": CONFIG,
            "baseline": {"examples_per_s": 1000.0, "step_ms": 1.0},
            "input": {"examples_per_s": 10000.0, "batch_ms": 0.1},
            "compute": {"examples_per_s": 1100.0, "step_ms": 0.9}}
    pays = doctor_report.verdict({**base, "threads": _threads(1.3)})
    assert any("--config.distribute.intra_op_threads=1 runs 1.30x" in a
               for a in pays["advice"]), pays["advice"]
    small = doctor_report.verdict({**base, "threads": _threads(1.02)})
    assert not any("thread pools" in a for a in small["advice"])
    table = doctor_report.format_table({"config": CONFIG, "threads": _threads(1.3)})
    assert "1.30x TF's sizing  <- advised" in table
