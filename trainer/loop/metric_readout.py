"""Reading a run's metrics from the host: :class:`MetricReadout`.

Contexts: host, cross-replica; call on every worker (the reads reduce over workers).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
from absl import logging

from trainer.distribution import host_collectives
from trainer.runtime.tracing import per_object_function


class MetricReadout:
    """A loss metric and named metrics (``{"loss": ..., NAME: ...}``), read as Python
    floats and reset.

    ``compiled``: read and reset in ONE ``tf.function`` call (op by op from the host it
    cost a noticeable share of a short logging window: benchmarks/README.md);
    ``result()`` must then be a function of the metric's variables, as
    for every Keras metric. Otherwise eagerly, as ``keras.Model.evaluate`` reads them.
    Values are reduced over replicas and workers (Keras metric variables are
    ON_READ/SUM, read in cross-replica context): call on every worker. Host.
    """

    def __init__(self, loss_metric, metrics: dict, compiled: bool):
        self._metrics = {"loss": loss_metric, **metrics}
        self._compiled = compiled
        self._checked = False  # warn_idle ran
        self._read_and_reset = (per_object_function(self._read_and_reset_fn, autograph=False)
                                if compiled else self._read_and_reset_fn)

    def _read_and_reset_fn(self) -> dict[str, tf.Tensor]:
        values = {name: metric.result() for name, metric in self._metrics.items()}
        for metric in self._metrics.values():  # after the reads: same variables, in order
            metric.reset_state()
        return values

    def reset(self) -> None:
        if self._compiled:  # one call, the reads discarded
            self._read_and_reset()
            return
        for metric in self._metrics.values():
            metric.reset_state()

    def warn_idle(self, owner: str, steps: int) -> None:
        """Once per readout, before the first :meth:`take`: one warning naming the
        metrics (the loss aside) whose variables are all still 0 after ``steps`` steps:
        ``owner``'s step never updates them, and they would log 0 without a word."""
        if self._checked:
            return
        self._checked = True
        idle = [name for name, metric in self._metrics.items() if name != "loss"
                and metric.variables and not any(np.any(np.asarray(tf.convert_to_tensor(v)))
                                                 for v in metric.variables)]
        if idle:
            logging.warning(
                "train metric(s) %s: not updated in the first %d steps (%s.train_step does "
                "not update them), so they log 0. Update them in the step "
                "(self.update_metrics(self.train_metrics, batch, outputs)) or leave them out "
                "of build_metrics.", ", ".join(repr(n) for n in idle), steps, owner)

    def take(self) -> dict[str, float]:
        """The values accumulated since the last reset; resets."""
        return {name: float(value) for name, value in self._read_and_reset().items()}


def window_logs(trainer: Any, readout: MetricReadout, outputs: dict, steps: int,
                seconds: float) -> dict[str, float]:
    """The ``on_log`` values of a train window of ``steps`` steps in ``seconds`` host
    seconds (``outputs``: its last loop call's): the outputs, ``readout``'s metrics (then
    reset), the learning rate, the gradient norm, the rates. Every worker."""
    t = trainer
    values = {k: float(v) for k, v in outputs.items()}
    readout.warn_idle(type(t).__name__, steps)
    values.update(readout.take())
    seconds = host_collectives.mean_over_workers(t.strategy, seconds)
    logs = {f"train/{k}": v for k, v in values.items()}
    # The rate the next update uses: the schedule at optimizer.iterations.
    logs["train/learning_rate"] = float(tf.convert_to_tensor(t.optimizer.learning_rate))
    grad_norm = t.gradients.norms.take()
    if grad_norm is not None:
        logs["train/grad_norm"] = grad_norm
    logs["perf/steps_per_s"] = steps / max(seconds, 1e-9)
    logs["perf/examples_per_s"] = logs["perf/steps_per_s"] * t.batch.global_size
    return logs
