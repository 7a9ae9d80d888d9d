"""The default train and eval steps (what ``Trainer.train_step`` / ``eval_step`` do when
not overridden): forward pass, per-example loss, the gradient path, metrics.

Contexts: :meth:`DefaultSteps.train` and :meth:`DefaultSteps.eval` run in REPLICA
context while the loop's ``tf.function`` is traced; the constructor runs on the host.

XLA: when :attr:`DefaultSteps.xla` is set (``perf.jit_compile``, or the execution plan
the run measured and chose: :mod:`trainer.loop.plan`), the forward + backward pass of the
default ``train_step`` is compiled with ``jit_compile=True`` (the iterator and the
optimizer update stay outside). The attribute is read when the step is TRACED: the loop
driver sets it before it calls the loops traced for that setting. Multi-replica
strategies and manual data parallelism over several devices never use it
(:attr:`DefaultSteps.xla_problem`; with ``perf.jit_compile=True`` one log line says so):
a whole step with 2+ Mirrored replicas does not compile (cross-device resource access),
and per-replica XLA is only verified on virtual CPU devices. On TPU every step is
XLA-compiled anyway.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from trainer import precision
from trainer.data import dynamic_shapes_problem, split_batch, zeros_for_spec
from trainer.runtime.tracing import no_autograph
from trainer.step.gradients import GradientPath, check_per_example_loss


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
      custom_train_step: the Trainer overrides ``train_step`` (``perf.jit_compile``
        then compiles nothing: it applies to the default step only).
    """

    def __init__(self, config: ml_collections.ConfigDict, model: keras.Model,
                 optimizer: keras.optimizers.Optimizer, gradients: GradientPath,
                 compute_loss: Callable, update_metrics: Callable,
                 train_metrics: dict, eval_metrics: dict, custom_train_step: bool = False):
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.gradients = gradients
        self.compute_loss = compute_loss
        self.update_metrics = update_metrics
        self.train_metrics = train_metrics
        self.eval_metrics = eval_metrics
        #: Why XLA cannot compile the step under this strategy, or None (it can).
        self.xla_problem = self._xla_problem()
        #: Whether the next trace of :meth:`train` compiles forward + backward with XLA.
        self.xla = bool(config.perf.jit_compile) and self.xla_problem is None
        self.custom_train_step = custom_train_step
        self._log_jit_setting()
        self._jit_grads: Callable | None = None  # built at the first XLA trace

    @property
    def jit_compiled(self) -> bool:
        """True when the default train step's forward + backward is XLA-compiled."""
        return self.xla

    @no_autograph
    def train(self, batch) -> dict[str, tf.Tensor]:
        """Replica context: forward, loss, gradient path, metrics -> ``{"loss": ...}``."""
        variables = self.gradients.trainable_variables()
        if self.xla:
            grads, per_example_loss, outputs = self.jit_grads()(batch)
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

    def keeps_xla_for(self, spec: Any) -> bool:
        """Host, before a trace: whether the configured XLA (:attr:`xla`) stays on for
        batches of ``spec`` (one replica's; None: not known yet). Batches with dynamic
        shapes turn it off, with one warning: XLA would compile the step again for every
        new batch shape, many times slower than no XLA."""
        problem = dynamic_shapes_problem(spec) if spec is not None and self.xla else None
        if problem is not None:
            logging.warning("perf.jit_compile=True is not applied: %s; training without XLA "
                            "(XLA would compile once per batch shape).", problem)
            self.xla = False
        return self.xla

    def _xla_problem(self) -> str | None:
        """Why the default step is not XLA-compiled under this strategy (None: it may be)."""
        strategy = self.gradients.strategy
        replicas = strategy.num_replicas_in_sync
        if isinstance(strategy, tf.distribute.TPUStrategy):
            return "not needed on TPU (every step is XLA-compiled)"
        if replicas > 1:
            return (f"not applied under {type(strategy).__name__} with {replicas} replicas "
                    f"(XLA is used with one replica per process only)")
        if not self.gradients.reducer.supports_jit:
            return ("not applied under distribute.strategy='manual' with several devices "
                    "(XLA cannot compile a device's access to variables on another)")
        return None

    def compiled(self) -> str:
        """What the configured setting compiles with XLA, for the set-up report (before
        an execution plan, :mod:`trainer.loop.plan`, chooses another: its own line says so)."""
        if not self.config.perf.jit_compile:
            return "nothing compiled (perf.jit_compile=False)"
        if self.xla_problem is not None and self.xla_problem.startswith("not needed"):
            return f"perf.jit_compile=True: {self.xla_problem}"
        if self.xla_problem is not None:
            return f"nothing compiled: perf.jit_compile=True is {self.xla_problem}"
        if self.custom_train_step:
            return ("nothing compiled: perf.jit_compile=True compiles the default "
                    "train_step's forward and backward pass, and this Trainer overrides "
                    "train_step")
        return ("the default train_step's forward and backward pass (perf.jit_compile=True; "
                "the iterator, all-reduce and optimizer update are not compiled)")

    def _log_jit_setting(self) -> None:
        if not self.config.perf.jit_compile:
            return
        if self.xla_problem is None and not self.custom_train_step:
            logging.info("perf.jit_compile: forward and backward pass compiled with XLA.")
        elif self.xla_problem is None:
            logging.warning("perf.jit_compile=True has no effect: it compiles the default "
                            "train_step's forward and backward pass, and this Trainer "
                            "overrides train_step; training without XLA (perf.plan='auto' "
                            "may still compile the whole step: see its 'plan:' line).")
        elif self.xla_problem.startswith("not needed"):
            logging.info("perf.jit_compile: %s.", self.xla_problem)
        else:
            logging.warning("perf.jit_compile=True is %s; training without XLA.",
                            self.xla_problem)

    def jit_grads(self) -> Callable:
        """The XLA-compiled ``batch -> (gradients, per-example loss, outputs)`` (replica
        context), built once."""
        if self._jit_grads is None:
            def forward_backward(batch):
                variables = self.gradients.trainable_variables()
                with tf.GradientTape() as tape:
                    outputs, per_example_loss = self.forward_loss(batch)
                    objective = self.gradients.objective(per_example_loss)
                return tape.gradient(objective, variables), per_example_loss, outputs

            self._jit_grads = tf.function(forward_backward, jit_compile=True, autograph=False)
        return self._jit_grads

    def xla_lowering_error(self, batch_spec: Any) -> str | None:
        """Lowers the XLA forward + backward for one replica's batch of ``batch_spec``
        (zeros; nothing runs, no state changes): the error, or None when it lowers.
        Host, one replica (XLA is used with one only)."""
        batch = zeros_for_spec(batch_spec)
        try:
            self.jit_grads().experimental_get_compiler_ir(batch)(stage="hlo")
        except Exception as error:  # any failure drops XLA from the plans, with the reason
            return f"{type(error).__name__}: {error}"
        return None
