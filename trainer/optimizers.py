"""The default optimizer and learning-rate schedule built from ``config.optimizer``.

Schedules (``optimizer.schedule``) count OPTIMIZER UPDATES (``optimizer.iterations``):
with ``perf.grad_accum_steps=K`` one update takes K train steps, so ``warmup_steps`` and
``decay_steps`` are in updates and ``decay_steps`` defaults to ``train.steps // K``:

* ``constant``: ``learning_rate`` throughout;
* ``warmup_constant``: linear warmup over ``warmup_steps``, then constant;
* ``cosine`` / ``warmup_cosine``: (warmup, then) cosine decay to ``min_learning_rate``;
* ``linear``: (warmup, then) linear decay to ``min_learning_rate``.

Linear scaling (``optimizer.lr_scaling="linear"``) multiplies ``learning_rate`` by
``effective_batch / reference_batch_size``, where the effective batch is the global
batch times ``perf.grad_accum_steps``, so changing replicas or accumulation keeps the
per-example step size.

Gradient clipping is NOT set on the Keras optimizer (Keras clips per replica, before
the cross-replica sum); ``Trainer.apply_gradients`` clips the all-reduced gradients.

A user's optimizer (``build_optimizer``): :func:`adopt` takes a
``keras.optimizers.LossScaleOptimizer`` apart (the framework owns loss scaling,
:mod:`trainer.precision`) and :func:`check_arguments` refuses, in one line, the Keras
arguments that would change the update behind the gradient path's back
(``gradient_accumulation_steps``, ``loss_scale_factor``, ``ema_overwrite_frequency``).
``clipnorm``, ``clipvalue``, ``global_clipnorm`` and ``use_ema`` stay Keras': they act
inside ``optimizer.apply`` on the all-reduced, unscaled gradients (the same on every
replica). docs/training.md lists each.
"""

from __future__ import annotations

from typing import Any

import keras
import ml_collections
from absl import logging

from trainer.errors import HookError


def effective_learning_rate(config: ml_collections.ConfigDict) -> float:
    """The peak learning rate after the optional linear scaling rule."""
    ocfg = config.optimizer
    lr = float(ocfg.learning_rate)
    if ocfg.lr_scaling == "linear":
        if ocfg.reference_batch_size <= 0:
            raise ValueError(
                "config.optimizer.lr_scaling='linear' needs "
                "config.optimizer.reference_batch_size > 0 (the batch size that "
                "optimizer.learning_rate was tuned for).")
        effective_batch = config.train.global_batch_size * config.perf.grad_accum_steps
        lr *= effective_batch / ocfg.reference_batch_size
    return lr


def build_schedule(config: ml_collections.ConfigDict):
    """A float (constant) or a ``keras.optimizers.schedules.LearningRateSchedule``."""
    ocfg = config.optimizer
    peak = effective_learning_rate(config)
    if ocfg.schedule == "constant":
        return peak
    warmup = ocfg.warmup_steps if ocfg.schedule != "cosine" else 0
    total = ocfg.decay_steps or config.train.steps // config.perf.grad_accum_steps
    decay_steps = max(1, total - warmup)
    if ocfg.schedule == "warmup_constant":
        return _WarmupLinear(peak, warmup, decay_steps, end=peak)
    if ocfg.schedule in ("cosine", "warmup_cosine"):
        return keras.optimizers.schedules.CosineDecay(
            0.0 if warmup else peak, decay_steps, alpha=ocfg.min_learning_rate / peak if peak else 0.0,
            warmup_target=peak if warmup else None, warmup_steps=warmup)
    return _WarmupLinear(peak, warmup, decay_steps, ocfg.min_learning_rate)


@keras.saving.register_keras_serializable("trainer")
class _WarmupLinear(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup from 0 to ``peak`` over ``warmup`` steps, then linear decay."""

    def __init__(self, peak: float, warmup: int, decay_steps: int, end: float):
        self.peak, self.warmup, self.decay_steps, self.end = peak, warmup, decay_steps, end

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        warm = self.peak * step / max(1, self.warmup)
        frac = keras.ops.clip((step - self.warmup) / self.decay_steps, 0.0, 1.0)
        decay = self.peak + (self.end - self.peak) * frac
        return keras.ops.where(step < self.warmup, warm, decay)

    def get_config(self):
        return dict(peak=self.peak, warmup=self.warmup, decay_steps=self.decay_steps,
                    end=self.end)


def build_optimizer(config: ml_collections.ConfigDict) -> keras.optimizers.Optimizer:
    """The Keras optimizer ``config.optimizer.name`` with its schedule."""
    ocfg = config.optimizer
    lr = build_schedule(config)
    wd = ocfg.weight_decay or None
    name = ocfg.name
    if name == "sgd":
        return keras.optimizers.SGD(lr, momentum=ocfg.momentum, weight_decay=wd)
    if name == "rmsprop":
        return keras.optimizers.RMSprop(lr, momentum=ocfg.momentum, weight_decay=wd)
    cls = {"adam": keras.optimizers.Adam, "adamw": keras.optimizers.AdamW,
           "adagrad": keras.optimizers.Adagrad, "lamb": keras.optimizers.Lamb,
           "lion": keras.optimizers.Lion}[name]
    if name == "adamw":
        return cls(lr, weight_decay=ocfg.weight_decay)
    return cls(lr, weight_decay=wd)


def describe(config: ml_collections.ConfigDict, optimizer: keras.optimizers.Optimizer) -> str:
    """One line for the start of a run: the optimizer, its learning rate and batch."""
    batch = config.train.global_batch_size
    accum = config.perf.grad_accum_steps
    try:
        current = f"{float(keras.ops.convert_to_numpy(optimizer.learning_rate)):.6g}"
    except (AttributeError, TypeError, ValueError):
        current = "n/a"
    base = config.optimizer.learning_rate or 1.0
    scaling = (f", linear scaling x{effective_learning_rate(config) / base:g}"
               f" (reference batch {config.optimizer.reference_batch_size})"
               if config.optimizer.lr_scaling == "linear" else "")
    return (f"optimizer {type(optimizer).__name__}: learning rate now {current}; config "
            f"peak {effective_learning_rate(config):.6g}{scaling}, schedule "
            f"{config.optimizer.schedule} (in optimizer updates); effective batch {batch} x "
            f"{accum} accumulation step(s) = {batch * accum}")


def check_arguments(optimizer: keras.optimizers.Optimizer, where: str) -> None:
    """Raises :class:`HookError` (one line naming ``where``, e.g. ``"MyTrainer.
    build_optimizer returned"``) for Keras arguments the gradient path cannot honour:
    ``gradient_accumulation_steps`` (Keras accumulates inside ``apply`` under a
    ``tf.cond``, where replicas cannot synchronise: ``perf.grad_accum_steps`` does it),
    ``use_ema`` with ``ema_overwrite_frequency`` (the same ``tf.cond``)
    and ``loss_scale_factor`` (Keras divides the gradients by it, expecting a loss
    multiplied by ``optimizer.scale_loss``, which the framework does not call)."""
    name = type(optimizer).__name__
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if steps:
        raise HookError(
            f"{where} {name}(gradient_accumulation_steps={steps}): Keras accumulates inside "
            f"the optimizer's update, where replicas cannot synchronise, and the framework "
            f"already all-reduces each update; leave gradient_accumulation_steps unset and "
            f"set perf.grad_accum_steps={steps} (--config.perf.grad_accum_steps={steps}).")
    factor = getattr(optimizer, "loss_scale_factor", None)
    if factor is not None:
        raise HookError(
            f"{where} {name}(loss_scale_factor={factor:g}): Keras divides every gradient by "
            f"it, expecting a loss multiplied by optimizer.scale_loss, which the framework's "
            f"step does not call (updates {factor:g}x too small); leave it unset: under "
            f"precision.policy='mixed_float16' the framework scales the loss itself "
            f"(precision.initial_loss_scale).")
    every = getattr(optimizer, "ema_overwrite_frequency", None)
    if getattr(optimizer, "use_ema", False) and every:
        raise HookError(
            f"{where} {name}(use_ema=True, ema_overwrite_frequency={every}): Keras overwrites "
            f"the weights with their average inside the update, under a tf.cond where "
            f"replicas cannot synchronise; leave ema_overwrite_frequency unset, or use the "
            f"framework's average (optimizer.ema_decay, used by evaluate() and export()).")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise HookError(
            f"{where} a LossScaleOptimizer: the framework scales the loss itself (one scale "
            f"for every optimizer, precision.policy='mixed_float16'); pass its "
            f"inner_optimizer ({type(optimizer.inner_optimizer).__name__}) instead.")


def adopt(optimizer: keras.optimizers.Optimizer, where: str, policy: str,
          loss_scale: Any) -> keras.optimizers.Optimizer:
    """The optimizer to train with, for what ``build_optimizer`` returned. A
    ``LossScaleOptimizer`` is taken apart, with one info line: its inner optimizer trains,
    and its ``initial_scale`` and ``dynamic_growth_steps`` become the framework's loss
    scaling (``loss_scale``: the :class:`trainer.precision.PrecisionState`, its ``scale``
    assigned, its ``growth_interval`` set) under ``policy`` mixed_float16; other policies
    scale no loss. Keras' own scaling would divide the update by a second scale and
    decide overflows on one replica's gradients. Then :func:`check_arguments`. Host,
    before the first trace."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        wrapper, optimizer = optimizer, optimizer.inner_optimizer
        inner = type(optimizer).__name__
        if policy == "mixed_float16":
            loss_scale.scale.assign(float(wrapper.initial_scale))
            loss_scale.growth_interval = int(wrapper.dynamic_growth_steps)
            line = (f"{where} a LossScaleOptimizer: training with its inner {inner}; its "
                    f"initial_scale={float(wrapper.initial_scale):g} and "
                    f"dynamic_growth_steps={int(wrapper.dynamic_growth_steps)} become the "
                    f"framework's loss scaling (precision.initial_loss_scale, "
                    f"precision.growth_interval), whose overflow check sees every "
                    f"replica's gradients.")
        else:
            line = (f"{where} a LossScaleOptimizer: training with its inner {inner}; "
                    f"precision.policy={policy!r} scales no loss (only 'mixed_float16' "
                    f"does), so its loss scaling is not used.")
        logging.info("%s", line)
    check_arguments(optimizer, where)
    return optimizer
