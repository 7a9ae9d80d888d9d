"""The default train and eval steps (what ``Trainer.train_step`` / ``eval_step`` do when
not overridden): forward pass, per-example loss, the gradient path, metrics.

Contexts: :meth:`DefaultSteps.train` and :meth:`DefaultSteps.eval` run in REPLICA
context while the loop's ``tf.function`` is traced; the constructor runs on the host.

XLA (``perf.jit_compile``): the forward + backward pass of the default ``train_step``
is compiled with ``jit_compile=True`` (the iterator and the optimizer update stay
outside). Multi-replica strategies and manual data parallelism over several devices
fall back to the plain graph with one log line: a whole step with 2+ Mirrored replicas
does not compile (cross-device resource access), and per-replica XLA is only verified
on virtual CPU devices. On TPU every step is XLA-compiled anyway.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from trainer import precision
from trainer.data import split_batch
from trainer.gradients import GradientPath, check_per_example_loss
from trainer.tracing import no_autograph


class DefaultSteps:
    """The default steps of one Trainer.

    Args:
      config: the run's config (``perf.jit_compile``, ``perf.recompute``).
      model: the model the steps call.
      optimizer: the optimizer the default train step updates.
      gradients: the Trainer's gradient path.
      compute_loss: ``(batch, float32 outputs) -> per-example loss [b]`` (replica ctx).
      update_metrics: ``(metrics, batch, outputs) -> None`` (replica ctx).
      train_metrics, eval_metrics: the metric dicts the steps update.
    """

    def __init__(self, config: ml_collections.ConfigDict, model: keras.Model,
                 optimizer: keras.optimizers.Optimizer, gradients: GradientPath,
                 compute_loss: Callable, update_metrics: Callable,
                 train_metrics: dict, eval_metrics: dict):
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.gradients = gradients
        self.compute_loss = compute_loss
        self.update_metrics = update_metrics
        self.train_metrics = train_metrics
        self.eval_metrics = eval_metrics
        self.jit_grads = self._build_jit_grads()

    @property
    def jit_compiled(self) -> bool:
        """True when the default train step's forward + backward is XLA-compiled."""
        return self.jit_grads is not None

    @no_autograph
    def train(self, batch) -> dict[str, tf.Tensor]:
        """Replica context: forward, loss, gradient path, metrics -> ``{"loss": ...}``."""
        variables = list(self.model.trainable_variables)
        if self.jit_grads is not None:
            grads, per_example_loss, outputs = self.jit_grads(batch)
            loss = self.gradients.apply_grads(self.optimizer, variables, grads,
                                              per_example_loss)
        else:
            with tf.GradientTape() as tape:
                outputs, per_example_loss = self.forward_loss(batch)
            loss = self.gradients.apply(tape, per_example_loss, variables, self.optimizer)
        self.update_metrics(self.train_metrics, batch, outputs)
        return {"loss": loss}

    @no_autograph
    def eval(self, batch) -> dict[str, tf.Tensor]:
        """Replica context: forward, loss, metrics -> ``{"loss": per-example loss [b]}``."""
        outputs, per_example_loss = self.forward_loss(batch, training=False)
        self.update_metrics(self.eval_metrics, batch, outputs)
        return {"loss": per_example_loss}

    @no_autograph
    def forward(self, features, training: bool):
        """Replica context: the model call, through ``tf.recompute_grad`` when
        ``perf.recompute`` and training (activations are recomputed in the backward pass
        instead of kept; inputs and outputs are flattened for it)."""
        if not (training and self.config.perf.recompute):
            return self.model(features, training=training)
        outputs_structure = []

        def call(*flat_inputs):
            outputs = self.model(tf.nest.pack_sequence_as(features, list(flat_inputs)),
                                 training=True)
            outputs_structure.append(outputs)
            return tf.nest.flatten(outputs)

        flat = tf.recompute_grad(call)(*tf.nest.flatten(features))
        return tf.nest.pack_sequence_as(outputs_structure[0], flat)

    @no_autograph
    def forward_loss(self, batch, training: bool = True) -> tuple[Any, tf.Tensor]:
        """Replica context: ``(float32 outputs, per-example loss [b])``."""
        features, _ = split_batch(batch)
        outputs = precision.outputs_to_float32(self.forward(features, training))
        loss = self.compute_loss(batch, outputs)
        return outputs, check_per_example_loss(loss, batch)

    def _build_jit_grads(self) -> Callable | None:
        """The XLA-compiled ``batch -> (gradients, per-example loss, outputs)``, or None."""
        if not self.config.perf.jit_compile:
            return None
        strategy = self.gradients.strategy
        replicas = strategy.num_replicas_in_sync
        if isinstance(strategy, tf.distribute.TPUStrategy):
            logging.info("perf.jit_compile: not needed on TPU (every step is XLA-compiled).")
            return None
        if replicas > 1:
            logging.warning(
                "perf.jit_compile=True is not applied under %s with %d replicas (XLA is "
                "used with one replica per process only); training without XLA.",
                type(strategy).__name__, replicas)
            return None
        if not self.gradients.reducer.supports_jit:
            logging.warning(
                "perf.jit_compile=True is not applied under distribute.strategy='manual' "
                "with several devices (XLA cannot compile a device's access to variables "
                "on another); training without XLA.")
            return None
        logging.info("perf.jit_compile: forward and backward pass compiled with XLA.")

        def forward_backward(batch):
            variables = list(self.model.trainable_variables)
            with tf.GradientTape() as tape:
                outputs, per_example_loss = self.forward_loss(batch)
                objective = self.gradients.objective(per_example_loss)
            return tape.gradient(objective, variables), per_example_loss, outputs

        return tf.function(forward_backward, jit_compile=True, autograph=False)
