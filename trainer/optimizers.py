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
"""

from __future__ import annotations

import keras
import ml_collections


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
