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

:func:`split_batch` is the one definition of the default batch layout.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from trainer.errors import InputError

DatasetFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]


@tf.autograph.experimental.do_not_convert
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
    raise ValueError(
        "The default steps expect batches of (features, labels) or a dict with a 'label' "
        f"key; got {type(batch).__name__}. Override train_step/eval_step for other layouts.")


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
    global_batch_size: int,
    *,
    deterministic: bool = True,
    what: str = "build_train_dataset",
    skip_batches: int = 0,
) -> tf.distribute.DistributedDataset:
    """Returns the distributed dataset for ``dataset_fn``.

    Args:
      strategy: the run's strategy.
      dataset_fn: ``ctx -> tf.data.Dataset`` yielding per-replica batches.
      global_batch_size: examples per step over all replicas.
      deterministic: tf.data deterministic order.
      what: the hook's name, for error messages.
      skip_batches: global steps already consumed (resume): each pipeline skips its
        share of per-replica batches, so a deterministic dataset continues exactly.
    """
    per_replica = global_batch_size // strategy.num_replicas_in_sync

    def fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        tracked = _TrackedInputContext(ctx)
        ds = dataset_fn(tracked)
        if not isinstance(ds, tf.data.Dataset):
            raise InputError(f"{what} must return a tf.data.Dataset, got {type(ds).__name__}.")
        _check_batch(ds, per_replica, what)
        if tf.executing_eagerly() and int(ds.cardinality()) == 0:
            raise InputError(f"{what} yields no batch at all: the dataset is empty, or has "
                             f"fewer examples than one per-replica batch ({per_replica}) and "
                             f"drops the remainder (.repeat() cannot help an empty dataset). "
                             f"Check the data source, or call .repeat() BEFORE .batch().")
        if ctx.num_input_pipelines > 1 and not tracked.read_pipeline_id:
            ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        replicas_per_pipeline = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        if skip_batches:
            ds = ds.skip(skip_batches * replicas_per_pipeline)
        options = tf.data.Options()
        options.deterministic = deterministic
        options.autotune.enabled = True
        return ds.with_options(options).prefetch(tf.data.AUTOTUNE)

    return strategy.distribute_datasets_from_function(fn)
