"""Launchers: start the trainer as one process, a local worker group, or on a cluster.

* :mod:`launch.tf_config` builds and validates ``TF_CONFIG``.
* :mod:`launch.multiworker` runs a local multi-worker group and emits cluster configs.
* :mod:`launch.mirrored` runs one process with ``MirroredStrategy``.
* :mod:`launch.tpu` finds and connects a TPU.

Nothing in this package imports TensorFlow at import time: the launchers start the
processes that do, and ``TF_CONFIG`` / ``CUDA_VISIBLE_DEVICES`` must be set before
TensorFlow loads.
"""
