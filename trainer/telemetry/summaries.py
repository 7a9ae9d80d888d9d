"""The run's records on disk: TensorBoard event files and ``metrics.jsonl`` (chief only).

``workdir/train`` and ``workdir/eval`` hold ``tf.summary`` event files (scalars under
their record keys without the ``train/``/``eval/`` prefix; alerts as the text summary
``alerts``); ``workdir/metrics.jsonl`` holds one JSON object per record. A write that fails (full
or read-only disk ...) warns once and turns that output off: telemetry never ends a run. Another layout
(the continuous evaluator's own stream: ``workdir/eval/metrics.jsonl`` and its event
files in ``workdir/eval``) is given by :class:`SummaryWriters`' arguments.

Paths go through ``tf.io.gfile``. In a bucket (``gs://``) the files are written to a
local staging directory and each flush uploads only the bytes added, composed onto the
object (:mod:`trainer.telemetry.object_append`; TensorFlow's own append uploads the
whole file at every flush). Records are written and flushed by one background thread,
in order: a write to a bucket is a network round trip and a bucket that does not
answer is retried for minutes; neither may hold up the training thread.
:meth:`SummaryWriters.flush` and :meth:`~SummaryWriters.close` wait for every record
handed over before them, so once ``fit()`` returns the files hold every record.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import tempfile
from typing import Any, Callable, Sequence

import tensorflow as tf
from absl import logging
from tensorflow.core.framework import summary_pb2

from tf_cluster.storage_schemes import is_bucket
from trainer.errors import storage_fault
from trainer.telemetry.object_append import ComposedObject, upload_errors
from trainer.runtime import keras_compat, signals
from trainer.runtime.waiting import said_while_waiting


def _plugin(name: str) -> summary_pb2.SummaryMetadata:
    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=name))


# The summary format of TensorBoard's scalar and text plugins, written with the core
# ``tf.summary.write`` so that writing needs no ``tensorboard`` package (viewing does).
_SCALAR, _TEXT = _plugin("scalars"), _plugin("text")
_SCALAR_BYTES = _SCALAR.SerializeToString()
MAX_PENDING = 1000  # records waiting for the writer thread; more are dropped with a warning


@tf.function(input_signature=[tf.TensorSpec([], tf.resource), tf.TensorSpec([], tf.int64),
                              tf.TensorSpec([None], tf.string),
                              tf.TensorSpec([None], tf.float32)], autograph=False)
def _write_scalars(writer, step, tags, values):
    """Writes ``values[i]`` under ``tags[i]`` at ``step`` to the writer of resource
    handle ``writer``. One function for the process, traced once: every writer and tag
    set of every Trainer calls it (a function per writer retraced for each new Trainer,
    and TensorFlow warned of excessive retracing)."""

    def body(i):
        written = tf.raw_ops.WriteSummary(writer=writer, step=step, tensor=values[i],
                                          tag=tags[i], summary_metadata=_SCALAR_BYTES)
        with tf.control_dependencies([written]):
            return (i + 1,)

    tf.while_loop(lambda i: i < tf.size(tags), body, (tf.constant(0),))


class SummaryWriters:
    """TensorBoard writers and the metrics.jsonl file of one run (chief only).

    ``outputs``: which of them to write, ``"jsonl"`` and/or ``"tensorboard"``
    (``telemetry.loggers``).

    Opened by the telemetry service for each ``fit()`` and closed at its end. A
    record's scalars are written by one call of a ``tf.function`` shared by every
    writer of the process (traced once), instead of an eager op per scalar.

    Contexts: host only. :meth:`write` and :meth:`write_jsonl` return at once (the
    record is copied and written by the writer thread, in the order given); more than
    :data:`MAX_PENDING` records behind (a bucket that does not answer) drops the newest
    with one warning.

    Args:
      workdir: the run's directory.
      logdirs: TensorBoard directory by record kind; default ``workdir/train`` and
        ``workdir/eval``. A record of another kind cannot be written.
      jsonl: the JSON-lines file (appended to); default ``workdir/metrics.jsonl``.
      filename_suffix: the suffix of the event files, which tells two writers of one
        directory apart (e.g. ``".evaluator"``).
    """

    def __init__(self, workdir: str, outputs: Sequence[str] = ("jsonl", "tensorboard"),
                 logdirs: dict[str, str] | None = None, jsonl: str | None = None,
                 filename_suffix: str | None = None):
        jsonl = jsonl or os.path.join(workdir, "metrics.jsonl")
        self.workdir, self.jsonl_path = workdir, jsonl
        logdirs = logdirs or {kind: os.path.join(workdir, kind) for kind in ("train", "eval")}
        # In a bucket: local files, each flush composing what they gained onto the objects.
        self._staging = (tempfile.mkdtemp(prefix="tf-trainer-records-")
                         if is_bucket(jsonl) else None)
        self._local_dirs = {kind: self._local(logdir, f"tb-{kind}")
                            for kind, logdir in logdirs.items()}
        self._remote_dirs = {self._local_dirs[k]: logdirs[k] for k in logdirs}
        self._event_objects: dict[str, ComposedObject] = {}  # by local event file
        local_jsonl = self._local(jsonl, "metrics.jsonl")
        tf.io.gfile.makedirs(os.path.dirname(local_jsonl) or ".")
        self.summary = ({kind: tf.summary.create_file_writer(self._local_dirs[kind],
                                                             filename_suffix=filename_suffix)
                         for kind in logdirs}
                        if "tensorboard" in outputs else {})
        self.jsonl = tf.io.gfile.GFile(local_jsonl, "a") if "jsonl" in outputs else None
        self._jsonl_object = (ComposedObject(local_jsonl, jsonl)
                              if self.jsonl and self._staging else None)
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="telemetry-writer")
        self._pending: list[concurrent.futures.Future] = []
        self._dropped = 0
        self._closing = False  # close() uploads what a stop signal held back

    def _local(self, path: str, name: str) -> str:
        """Where ``path`` is written: itself, or ``name`` in the staging directory."""
        return os.path.join(self._staging, name) if self._staging else path

    def _upload(self, output: str) -> None:  # on the writer thread
        """In a bucket: composes what the local files of ``output`` gained onto their
        objects (an event file made since the last call gets its object). After a stop
        signal, nothing more is uploaded until :meth:`close` (an object's sync already
        under way ends): the bucket's round trips belong to the stop's checkpoint."""
        if not self._staging:
            return
        if output == "jsonl":
            if self._jsonl_object and self._may_upload():
                self._jsonl_object.sync()
            return
        for local_dir, remote_dir in self._remote_dirs.items():
            for name in sorted(os.listdir(local_dir)) if os.path.isdir(local_dir) else ():
                path = os.path.join(local_dir, name)
                if path not in self._event_objects:
                    self._event_objects[path] = ComposedObject(path, f"{remote_dir}/{name}")
        for target in self._event_objects.values():
            if self._may_upload():
                target.sync()

    def _may_upload(self) -> bool:
        return self._closing or signals.seconds_since_signal() is None

    def _submit(self, write: Callable[[], None]) -> None:
        self._pending = [f for f in self._pending if not f.done()]
        if len(self._pending) >= MAX_PENDING:
            if not self._dropped:
                logging.warning("The run's records are %d writes behind (is %s answering?); "
                                "newer records are dropped until it catches up.",
                                MAX_PENDING, self.workdir)
            self._dropped += 1
            return
        self._pending.append(self._thread.submit(write))

    def _wait(self) -> None:
        """Blocks until every record handed over so far is written."""
        concurrent.futures.wait(self._pending)
        self._pending = []

    def _failed(self, output: str, error: Exception) -> None:
        """A write of ``output`` ("jsonl" / "tensorboard") failed: one warning, and that
        output is written no more (telemetry never ends a run)."""
        where = self.jsonl_path if output == "jsonl" else self.workdir
        why = storage_fault(error) or f"{type(error).__name__}: {str(error)[:300]}"
        logging.warning("Cannot write the run's %s records to %s (%s); the run goes on "
                        "without them.", output, where, why)
        if output == "jsonl":
            with contextlib.suppress(OSError, tf.errors.OpError):
                self.jsonl.close()
            self.jsonl = None
        else:
            self.summary = {}

    def write_jsonl(self, record: dict[str, Any]) -> None:
        """Appends ``record`` to metrics.jsonl only (any JSON values; nothing without
        the "jsonl" output)."""
        line = json.dumps(record, sort_keys=True) + "\n"
        self._submit(lambda: self._append(line))

    def write(self, record: dict[str, Any], logdir: str | None = None) -> None:
        """A window or eval record: metrics.jsonl and its numbers to TensorBoard, in the
        directory of its kind, or of ``logdir`` (a kind of ``logdirs``: a record of
        another kind, e.g. the run's ``goodput``, its tags left whole)."""
        line, record = json.dumps(record, sort_keys=True) + "\n", dict(record)

        def write_both() -> None:
            self._append(line)
            self._summarize(record, logdir or record["kind"])

        self._submit(write_both)

    def _append(self, line: str) -> None:  # on the writer thread
        if self.jsonl:
            try:
                self.jsonl.write(line)
                self.jsonl.flush()
                self._upload("jsonl")
            except (tf.errors.OpError, *upload_errors()) as error:
                self._failed("jsonl", error)

    def _summarize(self, record: dict[str, Any], logdir: str) -> None:  # writer thread
        if self.summary:
            try:
                self._write_summaries(record, logdir)
                self._upload("tensorboard")
            except (tf.errors.OpError, *upload_errors()) as error:
                self._failed("tensorboard", error)

    def _write_summaries(self, record: dict[str, Any], kind: str) -> None:
        step = record["step"]
        scalars = {(key.split("/", 1)[1] if key.startswith(f"{kind}/") else key): float(value)
                   for key, value in record.items()
                   if key not in ("kind", "step", "time", "alert") and value is not None}
        tags = tuple(sorted(scalars))
        _write_scalars(keras_compat.summary_writer_handle(self.summary[kind]),
                       tf.constant(step, tf.int64), tf.constant(tags, tf.string),
                       tf.constant([scalars[t] for t in tags], tf.float32))
        if record.get("alert"):
            with self.summary[kind].as_default(step=step):
                tf.summary.write("alerts", tf.constant(record["alert"]), metadata=_TEXT)
        self.summary[kind].flush()

    def flush(self) -> None:
        """Returns once every record handed over so far is written and flushed."""
        self._wait()
        try:
            for writer in self.summary.values():
                writer.flush()
            if self.summary:
                self._upload("tensorboard")
        except (tf.errors.OpError, *upload_errors()) as error:
            self._failed("tensorboard", error)
        try:
            if self.jsonl:
                self.jsonl.flush()
                self._upload("jsonl")
        except (tf.errors.OpError, *upload_errors()) as error:
            self._failed("jsonl", error)

    def close(self, grace_s: float | None = None) -> int:
        """Writes every record handed over, then flushes and closes every writer and
        the JSON-lines file; returns 0. With ``grace_s`` (a preemption's
        ``checkpoint.preemption_grace_s``), records not written once that many seconds
        have passed since the stop signal are dropped with one warning, the files are
        left as they are, and their number is returned (the writer thread ends on its
        own; the process may exit before)."""
        self._closing = True
        since = signals.seconds_since_signal()
        if grace_s is not None and since is not None:
            _, late = concurrent.futures.wait(self._pending, timeout=max(grace_s - since, 0.0))
            if late:
                self._thread.shutdown(wait=False, cancel_futures=True)
                logging.warning(
                    "The grace period after the stop signal (checkpoint.preemption_grace_s="
                    "%g s) ran out with %d of the run's records not yet written to %s: "
                    "dropped (the checkpoint is saved; the restart goes on writing).",
                    grace_s, len(late), self.workdir)
                return len(late)
        with said_while_waiting(f"the run's records to be written to {self.workdir}"):
            self.flush()
        self._thread.shutdown()
        if self._dropped:
            logging.warning("%d of the run's records were dropped: %s did not keep up.",
                            self._dropped, self.workdir)
        for writer in self.summary.values():
            with contextlib.suppress(OSError, tf.errors.OpError):
                writer.close()
        if self.jsonl:
            with contextlib.suppress(OSError, tf.errors.OpError):
                self.jsonl.close()
        if self._staging:
            shutil.rmtree(self._staging, ignore_errors=True)
        return 0
