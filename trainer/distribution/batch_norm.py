"""BatchNormalization across replicas: said at start, synchronised on request.

A ``keras.layers.BatchNormalization`` normalises a training batch by that batch's mean
and variance. On N replicas each replica's batch is 1/N of the global batch: its
statistics are noisier than one replica's, so the same model trains differently on
N replicas (the moving statistics are averaged over the replicas,
:mod:`trainer.step.replica_state`, but the normalisation in the forward pass is each
replica's own). With ``synchronized=True`` (TensorFlow backend) the layer all-reduces
its statistics first: every replica normalises by the global batch's, as one replica
would, at one small all-reduce per layer per step.

:func:`unsynchronized` finds the layers that are not (the Trainer warns once at start
when replicas > 1); ``distribute.sync_batch_norm=True`` makes every one synchronised
(:func:`synchronize`, as PyTorch's ``convert_sync_batchnorm``), on any model, e.g. a
``keras.applications`` one. Limits: a masked input (``mask=``) is normalised per replica
even when synchronised (Keras computes masked moments locally); under manual data
parallelism over several devices a plain one normalises every device slice by its own
statistics, and a synchronised one is refused when the step is traced (its all-reduce
could see this slice alone: :func:`trainer.distribution.collectives.refusing_replica_context`).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from trainer.distribution import host_collectives
from trainer.runtime import keras_compat


def unsynchronized(model: keras.Model) -> list:
    """The model's BatchNormalization layers (nested models' included) that normalise
    each replica's batch by its own statistics."""
    return [layer for layer in keras_compat.all_layers(model)
            if isinstance(layer, keras.layers.BatchNormalization)
            and not getattr(layer, "synchronized", False)]


def synchronize(model: keras.Model) -> int:
    """Makes every BatchNormalization layer of ``model`` normalise by the global batch's
    statistics (read by the layer when it is called, so before the first step is
    traced); returns how many it changed."""
    layers = unsynchronized(model)
    for layer in layers:
        layer.synchronized = True
    return len(layers)


def warning(model: keras.Model, strategy: tf.distribute.Strategy) -> str | None:
    """The one start-up line naming the unsynchronized BatchNormalization layers when
    the strategy has several replicas (or workers); None otherwise."""
    replicas = strategy.num_replicas_in_sync
    if replicas == 1 and host_collectives.num_workers(strategy) == 1:
        return None
    layers = unsynchronized(model)
    if not layers:
        return None
    names = ", ".join(layer.name for layer in layers[:5])
    more = f" and {len(layers) - 5} more" if len(layers) > 5 else ""
    return (f"{len(layers)} BatchNormalization layer(s) ({names}{more}) normalise each of "
            f"the {replicas} replicas' batches by its own statistics, so this model trains "
            f"differently than on one replica; set distribute.sync_batch_norm=True to "
            f"normalise by the global batch's (one small all-reduce per layer per step).")
