"""A DigitsTrainer that saves its final weights and can crash once, for launcher tests.

* After ``fit()`` it writes ``workdir/weights-<task_type>-<task_index>.npz`` (``local-0``
  without TF_CONFIG) holding ``model.get_weights()`` as ``w0, w1, ...``.
* ``LAUNCH_TEST_CRASH="worker:1:12"`` makes task worker:1 exit with code 3 when its input
  pipeline produces batch 12, once: the marker ``workdir/crashed-worker-1`` stops it from
  crashing again after a restart.
* ``LAUNCH_TEST_EXIT_AT_START="worker:1"`` makes that task exit with code 2 before it
  creates its strategy, while its peers wait for it in MultiWorkerMirroredStrategy setup.
* ``LAUNCH_TEST_RECORD_FILES=1`` records which TFRecord files this task's train
  pipeline read (TFDS's own ``tfds_id`` of each example names its file) and writes them
  after ``fit()`` to ``workdir/files-<task_type>-<task_index>.json``.
* ``LAUNCH_TEST_SLOW_FROM="10:0.5"`` makes every task's input pipeline sleep 0.5 s per
  batch from batch 10 on, and creates ``workdir/slow-<task>`` when it reaches batch 10,
  so a test can signal a run that is surely mid-training. Only in a run that finds no
  such marker at start: a restarted run goes at full speed. Decided once per process, so
  every copy of the pipeline is as slow (telemetry's input probe builds one mid-run).

Its files go through ``tf.io.gfile``: the workdir may be a bucket (``gs://...``).
"""

from __future__ import annotations

import io
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

from models import tfds_data
from models.digits import DigitsTrainer


def task_id() -> tuple[str, int]:
    """This process's ``(task_type, task_index)`` from TF_CONFIG, ``("local", 0)`` without."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return "local", 0
    task = json.loads(raw)["task"]
    return task["type"], int(task["index"])


class WeightsTrainer(DigitsTrainer):
    def __init__(self, config, workdir=None, strategy=None, callbacks=()):
        if os.environ.get("LAUNCH_TEST_EXIT_AT_START") == "%s:%d" % task_id():
            print("injected exit at start", file=sys.stderr, flush=True)
            sys.exit(2)
        super().__init__(config, workdir, strategy, callbacks)
        spec = os.environ.get("LAUNCH_TEST_SLOW_FROM", "")
        self._slow_marker = os.path.join(self.workdir or "", "slow-%s-%d" % task_id())
        self._slow_from = None  # or (first slow batch, seconds per batch)
        if spec and self.workdir and not tf.io.gfile.exists(self._slow_marker):
            start, seconds = spec.split(":")
            self._slow_from = int(start), float(seconds)

    def build_train_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        return self._slowed(self._crashing(super().build_train_dataset(ctx)))

    def build_read_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        if not os.environ.get("LAUNCH_TEST_RECORD_FILES"):
            return super().build_read_dataset(ctx)
        self.files_read: set[str] = set()

        def record(tfds_id):
            self.files_read.add(tfds_id.numpy().decode().split("__")[0])
            return tfds_id

        ds = tfds_data.read_split(self.builder, "train", ctx,
                                  sharding=self.config.data.sharding, add_tfds_id=True)
        return ds.map(lambda ex: {**ex, "tfds_id": tf.py_function(record, [ex["tfds_id"]],
                                                                  tf.string)})

    def _slowed(self, ds: tf.data.Dataset) -> tf.data.Dataset:
        if self._slow_from is None:
            return ds
        start, seconds = self._slow_from

        def maybe_sleep(count):
            if int(count) == start:
                _write(self._slow_marker, b"")
            if int(count) >= start:
                time.sleep(seconds)
            return count

        counted = tf.data.Dataset.zip((ds, tf.data.Dataset.range(1 << 62)))
        return counted.map(
            lambda batch, count: (batch, tf.py_function(maybe_sleep, [count], tf.int64))
        ).map(lambda batch, _: batch)

    def _crashing(self, ds: tf.data.Dataset) -> tf.data.Dataset:
        spec = os.environ.get("LAUNCH_TEST_CRASH", "")
        if not spec:
            return ds
        # Every task gets the same pipeline (collectives need identical graphs on all
        # workers); only the named task crashes.
        task_type, index = task_id()
        target, crash_at = spec.rsplit(":", 1)
        marker = os.path.join(self.workdir, f"crashed-{task_type}-{index}")
        armed = target == f"{task_type}:{index}" and not tf.io.gfile.exists(marker)

        def maybe_crash(count):
            if armed and int(count) == int(crash_at):
                _write(marker, b"")
                print(f"injected crash of {task_type}:{index} at batch {crash_at}", flush=True)
                os._exit(3)
            return count

        counted = tf.data.Dataset.zip((ds, tf.data.Dataset.range(1 << 62)))
        return counted.map(
            lambda batch, count: (batch, tf.py_function(maybe_crash, [count], tf.int64))
        ).map(lambda batch, _: batch)

    def fit(self) -> dict[str, float]:
        results = super().fit()
        task_type, index = task_id()
        weights = io.BytesIO()
        np.savez(weights, **{f"w{i}": w for i, w in enumerate(self.model.get_weights())})
        _write(os.path.join(self.workdir, f"weights-{task_type}-{index}.npz"), weights.getvalue())
        if hasattr(self, "files_read"):
            _write(os.path.join(self.workdir, f"files-{task_type}-{index}.json"),
                   json.dumps(sorted(self.files_read)).encode())
        return results


def _write(path: str, data: bytes) -> None:
    tf.io.gfile.makedirs(os.path.dirname(path))
    with tf.io.gfile.GFile(path, "wb") as f:
        f.write(data)
