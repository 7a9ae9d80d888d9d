"""Distributing the user's ``tf.data`` input over replicas and workers.

Every dataset goes through ``strategy.distribute_datasets_from_function``: the user's
``build_*_dataset(ctx)`` runs once per input pipeline (one per worker) and must yield
PER-REPLICA batches of ``ctx.get_per_replica_batch_size(global_batch_size)`` examples.
The framework then

* shards by input pipeline (``ds.shard(num_input_pipelines, input_pipeline_id)``) when
  the user's function never read ``ctx.input_pipeline_id``: sharding whole per-replica
  batches in order keeps the global batch of step ``i`` identical to a single-worker
  run with the same global batch;
* sets tf.data options: deterministic order (``train.deterministic``), autotune on;
* ends the pipeline with ``prefetch(AUTOTUNE)``.

File-level sharding: a user function whose source is files asks
:func:`file_shard_context` whether each pipeline can read only its own files (at least
as many files as pipelines); it then hands ``ctx`` to the reader (TFDS
``ReadConfig(input_context=ctx)``), which reads ``ctx.input_pipeline_id`` and so turns
off the framework's batch sharding. Shuffle and augmentation run after that, on the
pipeline's own files. Global batches under file sharding differ from a 1-process
run's: each pipeline shuffles its own files.

Resume on another number of workers (elastic by restart) is exact for both shardings
as long as every pipeline's stream is deterministic (``train.deterministic=True``,
seeded shuffles). Batch sharding: the global batch sequence is the same for any
number of workers, each pipeline skips its share of the consumed batches. File
sharding: a pipeline's stream depends on the pipeline count, so the new pipelines
continue the interrupted run's streams, rebuilt with its ``InputContext`` and dealt
out by example (:mod:`trainer.data.resume`): every example of the epoch once across the
change, the same global batches as the uninterrupted run. Limits: the old layout stays
for the rest of the run (native file sharding on the new count needs a fresh workdir);
scaling up reads M/N times a pipeline's share; the dataset must shard itself as it did
(same ``config.data.sharding``), else the resume is refused. The checkpoint records
the layout (``report["input_layout"]``).

tf.data service (``config.data.service = "host:port"`` of a dispatcher; see
``python -m launch.data_service``): the training input is built once, with a
single-pipeline ``InputContext`` (the service, not the worker, splits the work), and
read through ``tf.data.experimental.service.distribute`` in ``"distributed_epoch"``
mode: the dispatcher hands the source's splits (files, slices) to whichever service
worker asks next, so each example is preprocessed once per epoch by one service
worker and no worker idles (``"parallel_epochs"`` would make every service worker
produce the whole dataset: duplicates). Every training worker joins the same job
(``job_name``) and receives disjoint batches. The price: the order of batches depends
on the service workers' timing, so a run with the service is neither reproducible nor
resumable at the exact batch. On resume the model, optimizer and step are restored
exactly, and the input restarts at a fresh position of the service's stream (no batch
skipping: skipping a nondeterministic stream would cost time and buy nothing).
Hence the service REQUIRES ``train.deterministic=False``; a config asking for
deterministic order with the service is refused.

:func:`split_batch` is the one definition of the default batch layout.
"""

from __future__ import annotations

import functools
import dataclasses
import socket
import time
from typing import Any, Callable

import tensorflow as tf
from absl import logging

from trainer.data import resume as data_resume
from trainer.errors import InputError

DatasetFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]


@dataclasses.dataclass(frozen=True)
class BatchSizes:
    """A global batch and its split over the replicas in sync: the one place the
    per-replica batch is computed. The Trainer builds its train and eval ones once
    (:func:`trainer.distribution.strategies.batch_sizes`, which refuses a global batch the replicas
    do not divide) and hands them to whoever needs them (``trainer.batch``,
    ``run.batch``)."""

    global_size: int  # examples per step over all replicas and workers
    replicas: int  # replicas in sync

    @property
    def per_replica(self) -> int:
        """Examples per replica per step (what ``build_*_dataset`` batches by)."""
        return self.global_size // self.replicas


SERVICE_PROCESSING_MODE = "distributed_epoch"
SERVICE_JOB_NAME = "train"
_DISPATCHER_TIMEOUT_S = 20.0
_fallbacks_logged: set[tuple[str, int, int]] = set()


def file_shard_context(ctx: tf.distribute.InputContext, num_files: int, what: str = "input",
                       sharding: str = "auto") -> tf.distribute.InputContext | None:
    """``ctx`` when each input pipeline can read only its own files, else None.

    Host side, inside a ``build_*_dataset(ctx)``. ``num_files``: files of the source
    (e.g. ``builder.info.splits[split].num_shards``). ``sharding``: ``"auto"`` (by file
    when there are at least as many files as pipelines, else by data), ``"file"`` (by
    file; fewer files than pipelines is an error), ``"data"`` (always by data: the
    framework keeps one per-replica batch in N of the full stream).

    With one pipeline there is nothing to shard: returns None. When it falls back to
    data sharding it logs, once per (what, files, pipelines), what that costs.

    Raises:
      ValueError: ``sharding="file"`` with fewer files than pipelines, or an unknown mode.
    """
    if sharding not in ("auto", "file", "data"):
        raise ValueError(f"sharding={sharding!r} must be 'auto', 'file' or 'data' "
                         f"(config.data.sharding).")
    pipelines = ctx.num_input_pipelines
    if pipelines <= 1 or sharding == "data":
        return None
    if num_files >= pipelines:
        return ctx
    if sharding == "file":
        raise ValueError(
            f"{what}: sharding='file' but the source has {num_files} file(s) for {pipelines} "
            f"input pipelines; write at least {pipelines} files (TFDS: "
            f"DownloadConfig(num_shards={pipelines})) or use sharding='auto' or 'data'.")
    key = (what, num_files, pipelines)
    if key not in _fallbacks_logged:
        _fallbacks_logged.add(key)
        logging.warning(
            "%s: %d file(s) for %d input pipelines: sharding by data, not by file. Every "
            "worker reads and decodes the whole source and keeps 1 batch in %d (%dx the "
            "reading and decoding it needs). Write at least %d files to shard by file.",
            what, num_files, pipelines, pipelines, pipelines, pipelines)
    return None


def check_dispatcher(address: str, timeout_s: float = _DISPATCHER_TIMEOUT_S) -> str:
    """Returns ``address`` ("host:port" or "grpc://host:port") once a TCP connection to it
    succeeds; raises ConnectionError after ``timeout_s`` of refused connections (a
    dispatcher started with the run gets that long to bind; tf.data's own client would
    retry an absent dispatcher for many minutes instead of failing)."""
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"config.data.service={address!r} must be 'host:port' (or "
                         f"'grpc://host:port') of a tf.data service dispatcher.")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=timeout_s).close()
            return address
        except OSError as error:
            if time.monotonic() < deadline:
                time.sleep(0.25)
                continue
            raise ConnectionError(
                f"No tf.data service dispatcher answers at {address} after {timeout_s:g} s "
                f"({error}). Start one with "
                f"`python -m launch.data_service --port {port} --workers K`, or launch the "
                f"run with `python -m launch.multiworker ... --data_service_workers K`, or set "
                f"config.data.service='' to build the input in the training process."
            ) from error


@tf.autograph.experimental.do_not_convert
def zeros_for_spec(spec: Any) -> Any:
    """Zeros shaped like ``spec`` (a structure of ``tf.TensorSpec``; unknown dims: 1),
    e.g. to build a model or lower a step without touching the input."""
    return tf.nest.map_structure(
        lambda s: tf.zeros([d if d is not None else 1 for d in s.shape], s.dtype), spec)


def split_batch(batch) -> tuple[Any, Any]:
    """``(features, labels)`` of a batch: a 2-tuple, or a dict with a "label(s)" key.

    Works on tensors and on ``TensorSpec`` structures alike (any context).
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, dict):
        for key in ("label", "labels"):
            if key in batch:
                return {k: v for k, v in batch.items() if k != key}, batch[key]
    raise InputError(
        f"the dataset yields batches of {describe_structure(batch)}; the default "
        f"train_step and eval_step expect (features, labels) or a dict with a 'label' key: "
        f"yield one of those from the dataset hooks, or override train_step and eval_step "
        f"for another layout.")


def describe_shape(shape: Any, dtype: Any) -> str:
    """``"(None, 8) float32"``: a shape and dtype as error messages show them."""
    dims = ", ".join("None" if d is None else str(d) for d in tuple(shape))
    return f"({dims}) {tf.as_dtype(dtype).name}"


def describe_structure(batch: Any) -> str:
    """A short description of a batch's structure (tensors or specs): what an error
    about the batch layout shows the user."""
    def one(value):
        shape = getattr(value, "shape", None)
        dtype = getattr(value, "dtype", None)
        if shape is None or dtype is None:
            return type(value).__name__
        return describe_shape(shape, dtype)

    if isinstance(batch, dict):
        return "a dict with keys " + ", ".join(f"{k!r}: {one(v)}" if not isinstance(
            v, (dict, tuple, list)) else repr(k) for k, v in sorted(batch.items()))
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of {len(batch)}: " + ", ".join(
            one(v) if not isinstance(v, (dict, tuple, list)) else type(v).__name__
            for v in batch)
    return f"a single tensor {one(batch)}"


def dynamic_shapes_problem(spec: Any) -> str | None:
    """Why XLA should not compile a step fed batches of ``spec`` (one replica's): the
    tensors with an unknown size past the batch dimension, or None when all are fixed."""
    dynamic = [describe_shape(s.shape, s.dtype) for s in tf.nest.flatten(spec)
               if hasattr(s, "shape") and s.shape.rank is not None
               and any(d is None for d in list(s.shape)[1:])]
    if not dynamic:
        return None
    return (f"the batches have dynamic shapes ({', '.join(dynamic)}): XLA compiles once "
            f"per shape; pad to fixed lengths (or buckets) to use it")


class _TrackedInputContext(tf.distribute.InputContext):
    """An InputContext that records whether the user sharded by input pipeline."""

    def __init__(self, ctx: tf.distribute.InputContext):
        super().__init__(ctx.num_input_pipelines, ctx.input_pipeline_id,
                         ctx.num_replicas_in_sync)
        self.read_pipeline_id = False

    @property
    def input_pipeline_id(self) -> int:
        self.read_pipeline_id = True
        return super().input_pipeline_id


def _leading_dims(element_spec) -> set:
    dims = set()
    for spec in tf.nest.flatten(element_spec):
        shape = getattr(spec, "shape", None)
        if shape is not None and shape.rank:
            dims.add(shape[0])
    return dims


def _check_batch(ds: tf.data.Dataset, per_replica: int, what: str) -> None:
    dims = _leading_dims(ds.element_spec)
    static = {d for d in dims if d is not None}
    if not dims:
        raise InputError(
            f"{what} yields unbatched elements ({ds.element_spec}); batch them with "
            f"ds.batch(ctx.get_per_replica_batch_size(global_batch_size)).")
    if static and static != {per_replica}:
        raise InputError(
            f"{what} yields batches of {sorted(static)} examples but the per-replica batch "
            f"is {per_replica}; batch with ctx.get_per_replica_batch_size(global_batch_size) "
            f"(the global batch is split over the replicas).")


def distribute(
    strategy: tf.distribute.Strategy,
    dataset_fn: DatasetFn,
    batch: BatchSizes,
    *,
    deterministic: bool = True,
    what: str = "build_train_dataset",
    skip_batches: int = 0,
    resume_layout: data_resume.InputLayout | None = None,
    service: str = "",
    report: dict | None = None,
    must_end: bool = False,
) -> tf.distribute.DistributedDataset:
    """Returns the distributed dataset for ``dataset_fn``.

    Args:
      strategy: the run's strategy.
      dataset_fn: ``ctx -> tf.data.Dataset`` yielding per-replica batches.
      batch: the global batch and its per-replica share (:class:`BatchSizes`).
      deterministic: tf.data deterministic order.
      what: the hook's name, for error messages.
      skip_batches: global steps already consumed (resume): each pipeline skips its
        share of per-replica batches, so a deterministic dataset continues exactly.
      resume_layout: the input layout the checkpoint of ``skip_batches`` recorded
        (None: a fresh run). When the dataset shards itself by pipeline and the
        pipeline or replica count changed, the old layout's streams are continued
        (:func:`trainer.data.resume.continue_streams`).
      service: a tf.data service dispatcher address, or "" (see the module docstring).
      report: if given, gets ``report["input_layout"]``: the
        :class:`trainer.data.resume.InputLayout` whose streams this input continues
        (the checkpoint records it).
      must_end: the dataset is read to its end (an eval pass with ``eval.steps=-1``): an
        INFINITE one (a ``.repeat()`` without a count) is refused with an InputError.

    Raises:
      ValueError: ``service`` with ``deterministic=True`` (it would silently lose
        exactness).
      InputError: ``dataset_fn`` returns no ``tf.data.Dataset``, or unbatched, wrongly
        batched or empty data (raised when the strategy calls it).
      ConnectionError: no dispatcher answers at ``service`` (within seconds).
    """
    per_replica = batch.per_replica
    if service:
        _check_service(service, deterministic, what, skip_batches)
        return strategy.distribute_datasets_from_function(
            lambda ctx: _through_service(dataset_fn, ctx, per_replica, what, service))

    stream = functools.partial(_pipeline_stream, dataset_fn, batch.global_size, what,
                               must_end)

    def fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        ds, sharded = stream(ctx)
        old = data_resume.layout_to_continue(resume_layout, ctx, sharded)
        if report is not None:
            report["input_layout"] = old or data_resume.InputLayout.of(ctx, sharded)
        if old is not None:
            ds = data_resume.continue_streams(stream, old, ctx, batch.global_size,
                                              skip_batches, what)
        elif skip_batches:  # the same layout: each pipeline skips its share
            ds = ds.skip(skip_batches * (ctx.num_replicas_in_sync // ctx.num_input_pipelines))
        return _finish(ds, deterministic)

    return strategy.distribute_datasets_from_function(fn)


def _pipeline_stream(dataset_fn: DatasetFn, global_size: int, what: str, must_end: bool,
                     ctx: tf.distribute.InputContext) -> tuple[tf.data.Dataset, bool]:
    """One pipeline's per-replica batches as the framework shards them, and whether
    ``dataset_fn`` sharded itself (read ``ctx.input_pipeline_id``). ``ctx`` may be an
    earlier run's (:mod:`trainer.data.resume`): its per-replica batch then."""
    tracked = _TrackedInputContext(ctx)
    size = ctx.get_per_replica_batch_size(global_size)
    ds = _checked_dataset(dataset_fn(tracked), size, what)
    if tf.executing_eagerly() and int(ds.cardinality()) == 0:
        raise InputError(f"{what} yields no batch at all: the dataset is empty, or has "
                         f"fewer examples than one per-replica batch ({size}) and "
                         f"drops the remainder (.repeat() cannot help an empty dataset). "
                         f"Check the data source, or call .repeat() BEFORE .batch().")
    if must_end and tf.executing_eagerly() and (
            int(ds.cardinality()) == tf.data.INFINITE_CARDINALITY):
        raise InputError(
            f"{what} returns an infinite dataset (cardinality INFINITE, e.g. a .repeat() "
            f"without a count) and eval.steps=-1 asks for a full pass over it, which "
            f"would never end. Remove the .repeat() from {what}, or set eval.steps to "
            f"the number of batches each evaluation reads (e.g. --config.eval.steps=100).")
    if ctx.num_input_pipelines > 1 and not tracked.read_pipeline_id:
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return ds, tracked.read_pipeline_id


def _checked_dataset(ds: Any, per_replica: int, what: str) -> tf.data.Dataset:
    """``ds`` once it is a ``tf.data.Dataset`` of per-replica batches (else InputError)."""
    if not isinstance(ds, tf.data.Dataset):
        raise InputError(f"{what} must return a tf.data.Dataset, got {type(ds).__name__}.")
    _check_batch(ds, per_replica, what)
    return ds


def _check_service(service: str, deterministic: bool, what: str, skip_batches: int) -> None:
    """Refuses deterministic order with the service, waits for its dispatcher, and says
    what a resume through it means."""
    if deterministic:
        raise ValueError(
            f"config.data.service={service!r} with train.deterministic=True: the tf.data "
            f"service delivers batches in an order that depends on its workers' timing, "
            f"so the run can be neither reproduced nor resumed at the exact batch. Set "
            f"--config.train.deterministic=False to accept that (model, optimizer and "
            f"step still resume exactly), or --config.data.service='' for exact order.")
    check_dispatcher(service)
    logging.info("%s: through the tf.data service at %s (processing mode %s, job %r)",
                 what, service, SERVICE_PROCESSING_MODE, SERVICE_JOB_NAME)
    if skip_batches:
        logging.warning(
            "resuming at step %d with the tf.data service: the model, optimizer and step "
            "are restored exactly; the input continues from the service's stream, not "
            "from batch %d of the interrupted run.", skip_batches, skip_batches)


def _through_service(dataset_fn: DatasetFn, ctx: tf.distribute.InputContext, per_replica: int,
                     what: str, service: str) -> tf.data.Dataset:
    """The input built once (a single-pipeline context), read through the service."""
    single = tf.distribute.InputContext(1, 0, ctx.num_replicas_in_sync)
    ds = _checked_dataset(dataset_fn(single), per_replica, what)
    options = tf.data.Options()
    options.deterministic = False
    ds = ds.with_options(options).apply(tf.data.experimental.service.distribute(
        processing_mode=SERVICE_PROCESSING_MODE, service=service,
        job_name=SERVICE_JOB_NAME))
    return _finish(ds, False)


def _finish(ds: tf.data.Dataset, deterministic: bool) -> tf.data.Dataset:
    options = tf.data.Options()
    options.deterministic = deterministic
    options.autotune.enabled = True
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)
