"""The input: the user's ``tf.data`` distributed over replicas and workers, and resumed.

* :mod:`trainer.data.pipeline` — distributing the user's datasets (per-replica
  batches, sharding, options, the tf.data service); its public names are re-exported
  here (``trainer.data.distribute``, ``trainer.data.BatchSizes``, ...).
* :mod:`trainer.data.resume` — continuing the old input streams on another number of
  workers or replicas.
* :mod:`trainer.data.train_input` — a Trainer's train iterator kept from one ``fit()``
  to the next.
* :mod:`trainer.data.iterator_release` — input iterators destroyed on a background
  thread.
"""

from trainer.data.pipeline import (
    SERVICE_JOB_NAME,
    SERVICE_PROCESSING_MODE,
    BatchSizes,
    DatasetFn,
    check_dispatcher,
    describe_shape,
    describe_structure,
    distribute,
    dynamic_shapes_problem,
    file_shard_context,
    split_batch,
    zeros_for_spec,
)

__all__ = ["SERVICE_JOB_NAME", "SERVICE_PROCESSING_MODE", "BatchSizes", "DatasetFn",
           "check_dispatcher", "describe_shape", "describe_structure", "distribute",
           "dynamic_shapes_problem", "file_shard_context", "split_batch", "zeros_for_spec"]
