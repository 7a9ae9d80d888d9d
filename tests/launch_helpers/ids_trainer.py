"""A Trainer on a dataset of example ids that records which ids every step consumed.

As a config file (``--config=tests/launch_helpers/ids_trainer.py``): 24 steps of a
global batch of 16 over 192 examples in 4 TFRecord files of 48 (``config.data.files``:
the directory a test wrote with :func:`write_id_files`), so an epoch is 12 steps;
Adam with a warmup-cosine schedule and an EMA of the weights.

The input is file-sharded like a TFDS split read with ``ReadConfig(input_context=ctx)``
(``config.data.sharding``, see :func:`trainer.data.file_shard_context`): each pipeline
reads its own files, shuffles them (seeded, every epoch anew), repeats and batches per
replica. A batch is ``(x, {"label", "id"})``.

What the run consumed is part of its state: the model ``IdRecord`` (a second
``keras.Model`` of the Trainer, so the checkpoint holds it) has one row per step and one
column per position of the global batch: ``id + 1`` of the example there (0: not
consumed). Each step every replica puts its ids in its columns (replica ``r`` holds
positions ``[r*b, (r+1)*b)``), one all-reduce sums them, and the step's row is written. A resumed run restores
the rows of the steps before the checkpoint and writes the others.

Environment: ``ELASTIC_TEST_TERM_AT=N``: during step N+1 every task SIGTERMs itself
(a preemption: the run checkpoints at the end of that loop and exits 143).
After ``fit()`` (also when it raises) each task writes ``workdir/state-<task>.npz``:
``model/i``, ``opt/i``, ``ema/i``, ``lr``, ``step``, the loss-scale state and ``record``.
"""

from __future__ import annotations

import os
import signal

import keras
import ml_collections
import numpy as np
import tensorflow as tf

import trainer
from tests.support.helpers import task_name
from trainer import config as config_lib
from trainer.data import file_shard_context

NUM_FILES, PER_FILE = 4, 48
NUM_IDS = NUM_FILES * PER_FILE


def get_config() -> ml_collections.ConfigDict:
    config = config_lib.get_config()
    config.trainer = "tests.launch_helpers.ids_trainer:IdsTrainer"
    config.train.global_batch_size = 16
    config.train.steps = 24
    config.train.steps_per_loop = 2
    config.train.log_every_steps = 4
    config.optimizer.name = "adam"
    config.optimizer.learning_rate = 0.02
    config.optimizer.schedule = "warmup_cosine"
    config.optimizer.warmup_steps = 4
    config.optimizer.decay_steps = 32  # the rate at step 24 is not 0 yet
    config.optimizer.ema_decay = 0.9
    config.checkpoint.async_save = False
    config.telemetry.progress = "lines"
    config.data.files = ""  # directory of ids-*.tfrecord (write_id_files)
    config.data.sharding = "file"  # "file" | "data" | "auto"
    return config


def write_id_files(directory: str) -> list[str]:
    """Writes ``NUM_FILES`` TFRecord files of ``PER_FILE`` consecutive ids each."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for f in range(NUM_FILES):
        path = os.path.join(directory, f"ids-{f:05d}-of-{NUM_FILES:05d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(f * PER_FILE, (f + 1) * PER_FILE):
                feature = {"id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i]))}
                writer.write(tf.train.Example(features=tf.train.Features(
                    feature=feature)).SerializeToString())
        paths.append(path)
    return paths


def _example(serialized: tf.Tensor) -> dict[str, tf.Tensor]:
    i = tf.io.parse_single_example(serialized, {"id": tf.io.FixedLenFeature([], tf.int64)})["id"]
    angle = tf.cast(i, tf.float32)
    x = tf.stack([angle / NUM_IDS, tf.sin(angle), tf.cos(angle), tf.ones([])])
    return x, {"label": tf.cast(i % 3, tf.int32), "id": i}


class IdRecord(keras.Model):
    """``ids[step, position]``: ``id + 1`` of the example at that position of that
    step's global batch (0: not consumed)."""

    def __init__(self, steps: int, global_batch_size: int):
        super().__init__(name="id_record")
        self.ids = self.add_weight(shape=(steps, global_batch_size), dtype="float32",
                                   initializer="zeros", trainable=False,
                                   aggregation="only_first_replica", name="ids")

    def call(self, inputs):
        return inputs


class IdsTrainer(trainer.Trainer):
    def __init__(self, config, workdir=None, strategy=None, callbacks=()):
        super().__init__(config, workdir, strategy, callbacks)
        with self.strategy.scope():
            self.id_record = IdRecord(config.train.steps, config.train.global_batch_size)

    def build_model(self) -> keras.Model:
        return keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(3),
            keras.layers.Activation("linear", dtype="float32"),
        ])

    def build_train_dataset(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        files = sorted(tf.io.gfile.glob(os.path.join(self.config.data.files, "ids-*.tfrecord")))
        own = file_shard_context(ctx, len(files), "ids", self.config.data.sharding)
        if own is not None:
            files = files[own.input_pipeline_id::own.num_input_pipelines]
        return (tf.data.TFRecordDataset(files).map(_example)
                .shuffle(NUM_IDS, seed=self.config.seed).repeat()
                .batch(ctx.get_per_replica_batch_size(self.config.train.global_batch_size),
                       drop_remainder=True))

    def compute_loss(self, batch, outputs) -> tf.Tensor:
        _, labels = batch
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def train_step(self, batch):
        x, targets = batch
        outputs = self.steps.train((x, targets["label"]))
        self._record(targets["id"])
        term_at = os.environ.get("ELASTIC_TEST_TERM_AT")
        if term_at:
            tf.py_function(self._terminate_at(int(term_at)), [self.step_counter], [])
        return outputs

    def _record(self, ids: tf.Tensor) -> None:
        """Replica context: writes the step's global batch of ids into its row (each
        replica its columns, summed over replicas: the same value on every replica)."""
        context = tf.distribute.get_replica_context()
        b = tf.shape(ids)[0]
        columns = tf.cast(context.replica_id_in_sync_group, tf.int32) * b + tf.range(b)
        rows = tf.fill([b], tf.cast(self.step_counter, tf.int32))
        mine = tf.scatter_nd(tf.stack([rows, columns], 1), tf.cast(ids + 1, tf.float32),
                             tf.shape(self.id_record.ids))
        everyone = context.all_reduce(tf.distribute.ReduceOp.SUM, mine)
        self.id_record.ids.assign(self.id_record.ids + everyone)

    @staticmethod
    def _terminate_at(at: int):
        def act(step):
            if int(step) == at:
                print(f"injected SIGTERM of {task_name()} at step {at}", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
        return act

    def fit(self):
        try:
            return super().fit()
        finally:
            if self.workdir:
                self._dump()

    def _dump(self) -> None:
        dump = {f"model/{i}": w for i, w in enumerate(self.model.get_weights())}
        dump.update({f"opt/{i}": np.asarray(v.numpy())
                     for i, v in enumerate(self.optimizer.variables)})
        dump.update({f"ema/{i}": np.asarray(v.numpy())
                     for i, v in enumerate(self.ema.variables)})
        dump["lr"] = np.asarray(float(tf.convert_to_tensor(self.optimizer.learning_rate)))
        p = self.precision
        for name, v in (("scale", p.scale), ("good_steps", p.good_steps),
                        ("skipped_steps", p.skipped_steps), ("step_counter", self.step_counter)):
            dump[name] = np.asarray(v.numpy())
        dump["step"] = np.asarray(self.step)
        dump["record"] = np.asarray(self.id_record.ids.numpy())
        os.makedirs(self.workdir, exist_ok=True)
        np.savez(os.path.join(self.workdir, f"state-{task_name()}.npz"), **dump)
