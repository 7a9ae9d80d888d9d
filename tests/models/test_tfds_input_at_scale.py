"""Input at scale: digits as real TFDS files, file-level sharding, the tf.data service.

Multi-process tests start real launchers (``launch.multiworker``, ``launch.data_service``)
with real TensorFlow processes on loopback ports; the TFDS data directory is the
session's (tests/conftest.py).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys

import pytest
import tensorflow as tf

from models import digits_tfds, tfds_data
from models.digits import load_digits_split
from tests.conftest import run_main
from tests.support.helpers import assert_same_weights, load_weights
from tests.launch_helpers.running import REPO, Launch, wait_until_dead
from trainer import data

CONFIG = "--config=tests/launch_helpers/weights_config.py"
RUN_S = 300  # generous guard for a group to finish (or to fail) on 2 shared cores
FILE_SHARDED = ["--config.data.sharding=file", "--config.checkpoint.every_steps=10",
                "--config.checkpoint.async_save=False"]


@pytest.fixture(scope="module")
def builder():
    return digits_tfds.prepare()  # the session's TFDS_DATA_DIR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def files_of(ds: tf.data.Dataset) -> list[str]:
    """The file of every example, from TFDS's own ``tfds_id`` ("<file>__<index>")."""
    return [ex["tfds_id"].decode().split("__")[0] for ex in ds.as_numpy_iterator()]


def test_prepare_writes_several_files_per_split_once_and_reuses_them(tmp_path):
    digits_tfds.prepare(str(tmp_path))
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert sum(".tfrecord-" in p.name for p in files) == 2 * digits_tfds.NUM_SHARDS
    before = {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in files}
    again = digits_tfds.prepare(str(tmp_path))
    assert {p: (p.stat().st_mtime_ns, p.stat().st_ino)
            for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before
    # The TFDS split holds exactly the examples of the in-memory split (in another order).
    (x_train, y_train), _ = load_digits_split(0)
    stored = sorted((tuple(ex["image"]), int(ex["label"])) for ex in
                    tfds_data.read_split(again, "train").as_numpy_iterator())
    expected = sorted((tuple((x * 16).round().astype(int)), int(y))
                      for x, y in zip(x_train, y_train))
    assert stored == expected


def test_two_pipelines_read_disjoint_files_whose_union_is_the_split(builder):
    read = [files_of(tfds_data.read_split(builder, "train", tf.distribute.InputContext(2, i, 2),
                                          add_tfds_id=True)) for i in range(2)]
    split = builder.info.splits["train"]
    assert set(read[0]).isdisjoint(read[1])
    assert set(read[0]) | set(read[1]) == set(split.filenames)
    assert len(read[0]) + len(read[1]) == split.num_examples


def test_fewer_files_than_pipelines_shard_by_data_and_say_what_it_costs(builder, caplog):
    ctx = tf.distribute.InputContext(8, 3, 8)
    with caplog.at_level(logging.WARNING):
        ds = tfds_data.read_split(builder, "train", ctx, add_tfds_id=True)
        tfds_data.read_split(builder, "train", ctx)
    assert len(files_of(ds)) == builder.info.splits["train"].num_examples  # reads it all
    fallbacks = [r.getMessage() for r in caplog.records if "sharding by data" in r.getMessage()]
    assert len(fallbacks) == 1 and "8x the reading and decoding" in fallbacks[0]
    with pytest.raises(ValueError, match="4 file\\(s\\) for 8 input pipelines"):
        tfds_data.read_split(builder, "train", ctx, sharding="file")


@pytest.fixture(scope="module")
def file_sharded_run(tmp_path_factory):
    """Two workers, file-sharded, uninterrupted: (workdir, launcher)."""
    workdir = tmp_path_factory.mktemp("file_sharded")
    run = Launch("launch.multiworker", ["--workers", "2", CONFIG, f"--workdir={workdir}",
                                        *FILE_SHARDED, "--config.train.steps=300",
                                        "--config.train.steps_per_loop=10"],
                 {"LAUNCH_TEST_RECORD_FILES": "1"})
    assert run.finish(RUN_S) == 0, run.output[-6000:]
    return workdir, run


def test_two_workers_read_disjoint_files_and_reach_95_percent(file_sharded_run, builder):
    workdir, run = file_sharded_run
    read = [set(json.loads((workdir / f"files-worker-{i}.json").read_text())) for i in (0, 1)]
    assert read[0] and read[1] and read[0].isdisjoint(read[1])
    assert read[0] | read[1] == set(builder.info.splits["train"].filenames)
    final = [line for line in run.lines if line.startswith("[worker:0]") and "final: " in line]
    assert json.loads(final[-1].split("final: ", 1)[1])["eval/accuracy"] >= 0.95


def test_resume_under_file_sharding_is_exact_and_continues_on_another_worker_count(
        file_sharded_run, tmp_path):
    reference, _ = file_sharded_run
    run = Launch("launch.multiworker", ["--workers", "2", "--max_restarts", "1", CONFIG,
                                        f"--workdir={tmp_path}", *FILE_SHARDED,
                                        "--config.train.steps=300",
                                        "--config.train.steps_per_loop=10"],
                 {"LAUNCH_TEST_CRASH": "worker:1:45"})
    assert run.finish(2 * RUN_S) == 0, run.output[-6000:]
    # --max_restarts: the crashed group is restarted once, as a whole, and resumes.
    assert "injected crash of worker:1 at batch 45" in run.output
    assert "restarting the whole group (restart 1 of 1)" in run.output
    assert (tmp_path / "crashed-worker-1").exists()
    assert "resumed from step" in run.output
    for task in ("worker-0", "worker-1"):
        assert_same_weights(load_weights(reference / f"weights-{task}.npz"),
                            tmp_path / f"weights-{task}.npz")
    assert wait_until_dead(run.all_task_pids(), 5) == []  # both groups' tasks
    # One process continues the 2 workers' file-sharded streams (trainer.data.resume),
    # but only with the data settings that wrote them: by batch it cannot rebuild them.
    def one_process(*flags):
        return subprocess.run([sys.executable, "-m", "trainer.main", CONFIG,
                               f"--workdir={tmp_path}", "--config.train.steps=310", *flags],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                              capture_output=True, text=True, timeout=RUN_S)

    proc = one_process("--config.data.sharding=data")
    assert proc.returncode != 0
    assert ("the checkpoint's input was sharded by input pipeline (e.g. by file), but called "
            "with that run's InputContext (2 pipelines) it does not shard itself") \
        in proc.stderr, proc.stderr[-3000:]
    proc = one_process(*FILE_SHARDED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "written by 2 worker(s), continued on 1" in proc.stderr, proc.stderr[-3000:]
    assert "continues the checkpoint's 2 pipeline stream(s)" in proc.stderr


def test_service_refuses_deterministic_order():
    with pytest.raises(ValueError, match="train.deterministic=False"):
        data.distribute(tf.distribute.get_strategy(), lambda ctx: None, data.BatchSizes(8, 1),
                        deterministic=True, service="127.0.0.1:1")


def test_a_bad_dispatcher_address_fails_with_a_clear_error(tmp_path):
    proc = run_main(tmp_path, f"--config.data.service=127.0.0.1:{free_port()}",
                    "--config.train.deterministic=False", timeout=120)
    assert proc.returncode != 0
    assert "No tf.data service dispatcher answers at 127.0.0.1:" in proc.stderr


def test_two_service_workers_started_by_the_launcher_train_digits(tmp_path):
    run = Launch("launch.multiworker", ["--workers", "1", "--data_service_workers", "2",
                                        "--config=models/configs/digits.py",
                                        f"--workdir={tmp_path}",
                                        "--config.train.deterministic=False",
                                        "--config.train.steps=400"])
    assert run.finish(RUN_S) == 0, run.output[-6000:]
    assert "through the tf.data service at 127.0.0.1:" in run.output
    assert run.output.count("tf.data service worker listening") == 2
    final = [line for line in run.lines if "final: " in line]
    assert json.loads(final[-1].split("final: ", 1)[1])["eval/accuracy"] >= 0.95
    assert wait_until_dead(run.all_task_pids(), 5) == []


def test_killing_a_service_worker_stops_the_group(tmp_path):
    run = Launch("launch.multiworker", ["--workers", "1", "--data_service_workers", "2",
                                        "--grace_s", "2", "--config=models/configs/digits.py",
                                        f"--workdir={tmp_path}",
                                        "--config.train.deterministic=False",
                                        "--config.train.steps=1000000"])
    run.wait_for(r"^\[worker:0\] .*step \d+/1000000", RUN_S)
    pids = run.task_pids()
    os.kill(pids["data_service_worker:1"], signal.SIGKILL)
    assert run.finish(RUN_S) != 0  # by itself: the run had a million steps to go
    assert "data_service_worker:1 was killed by SIGKILL: stopping the other tasks" in run.output
    assert wait_until_dead(pids.values(), 5) == []


def test_the_standalone_service_serves_until_stopped_and_leaves_no_process():
    run = Launch("launch.data_service", ["--port", str(free_port()), "--workers", "2",
                                         "--grace_s", "2"])
    for name in ("data_service_dispatcher", "data_service_worker:0", "data_service_worker:1"):
        run.wait_for(rf"^\[{name}\] tf.data service .* listening", RUN_S)
    pids = run.task_pids()
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish(RUN_S) == 128 + signal.SIGTERM
    assert wait_until_dead(pids.values(), 5) == []
