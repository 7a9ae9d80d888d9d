"""An exponential moving average (EMA) of the model's weights: ``optimizer.ema_decay``.

The EMA of every trainable variable starts at the variable's value when it is built
(the initial weights, or the restored ones) and, after every optimizer update that is
applied, becomes

    ema = d * ema + (1 - d) * w

with ``d = optimizer.ema_decay`` exactly: no bias correction, no warm-up. With
``optimizer.ema_every_steps = N > 1`` the average moves only after the applied updates
whose count (the optimizer's ``iterations`` after the update: checkpointed, so a resumed
run moves at the same updates) is a multiple of N, by ``ema = d^N * ema + (1 - d^N) * w``:
the same horizon at 1/N of the cost, an approximation of the per-update average (it
samples the weights every N updates instead of averaging each). Steps whose
update is skipped (non-finite gradients) and the micro-steps of a gradient accumulation
window (``perf.grad_accum_steps``) do not update it. Training continues on the raw
weights; ``Trainer.evaluate()``, the best-checkpoint metric and ``Trainer.export()``
use the EMA weights (:meth:`ExponentialMovingAverage.swapped`), and the model holds the
raw weights again afterwards.

The EMA variables are created in ``strategy.scope()`` like the weights (mirrored, the
same on every replica and worker: every replica computes the same update from identical
values), are saved in checkpoints (group ``ema``) and restored exactly.

Keras's own ``use_ema`` is not used: it starts the average at the first update's
weights, and its update lives inside ``optimizer.apply`` with the Keras-private
reduction the gradient path switches off.

Cost: the update reads every weight and its average once per applied update. Where
the variables are not distributed (one replica: the default or ``one_device`` strategy,
``distribute.strategy="manual"``) it runs as ONE small XLA-compiled function over all
the averages (one fused pass per variable: ~2.5x cheaper than three TensorFlow ops per
variable, which cost the MLP benchmark ~10% of its step time; benchmarks/README.md,
"Training controls"). Under multi-replica strategies (mirrored
variables: each assignment goes through the strategy) and with ``fused=False`` it runs
as three ops per variable. Both compute ``ema - (1-d) * (ema - w)`` in float32; they
may differ in the last bit (XLA may contract the multiply-subtract), not more.

Contexts: :meth:`build` and :meth:`swapped` on the host; :meth:`update` wherever the
gradient path applies an update (replica context, or cross-replica inside its
``merge_call``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import tensorflow as tf

from trainer.runtime.tracing import no_autograph


class ExponentialMovingAverage:
    """The EMA of a set of variables (see the module docstring).

    Args:
      decay: ``d`` in ``[0, 1)``.
      fused: True (default): one XLA-compiled update over all averages where no variable
        is distributed, else three ops per variable; False: always three ops per variable.
      every: N: move the averages after every N-th applied update, by ``decay ** N``
        (``decay`` below is that per-move decay).
    """

    def __init__(self, decay: float, fused: bool = True, every: int = 1):
        self.every = int(every)
        self.decay = float(decay) ** self.every  # per move
        self.fused = fused
        self.pairs: list[tuple[tf.Variable, tf.Variable]] = []  # (weight, average)
        self._index: dict[int, int] = {}
        self._fused_updates: dict[tuple[int, ...], Callable[[], None]] = {}

    @property
    def built(self) -> bool:
        return bool(self.pairs)

    @property
    def variables(self) -> list[tf.Variable]:
        """The average variables, in the order of the weights given to :meth:`build`."""
        return [average for _, average in self.pairs]

    def build(self, strategy: tf.distribute.Strategy, weights: list) -> None:
        """Host: creates one average per weight (once), starting at the weight's value."""
        if self.pairs:
            return
        with strategy.scope():
            for weight in weights:
                name = getattr(weight, "path", None) or weight.name.split(":")[0]
                average = tf.Variable(
                    tf.convert_to_tensor(weight), trainable=False, name=f"ema/{name}",
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                self._index[id(weight)] = len(self.pairs)
                self.pairs.append((weight, average))

    @no_autograph
    def update(self, weights: list, updates: tf.Variable | None = None) -> None:
        """After an applied update of ``weights``: moves their averages (others ignored);
        with ``every > 1`` only when ``updates`` (the optimizer's update count after this
        update) is a multiple of it.

        Traced inside the training step (replica context, or cross-replica inside the
        gradient path's ``merge_call``); see the module docstring for the two forms.
        """
        indices = tuple(self._index[id(w)] for w in weights if id(w) in self._index)
        if not indices:
            return
        if self.every > 1:
            def move() -> tf.Tensor:
                self._move_averages(indices)
                return tf.constant(True)

            count = tf.cast(tf.convert_to_tensor(updates), tf.int64)
            tf.cond(tf.equal(count % self.every, 0), move,
                    lambda: tf.constant(False))
            return
        self._move_averages(indices)

    def _move_averages(self, indices: tuple[int, ...]) -> None:
        """Moves the averages of the weights at ``indices`` by ``decay`` (traced)."""
        pairs = [self.pairs[i] for i in indices]
        if not (self.fused and not any(isinstance(v, tf.distribute.DistributedValues)
                                       for pair in pairs for v in pair)):
            _move(pairs, 1.0 - self.decay)
            return
        if indices not in self._fused_updates:  # one compiled function per variable set
            rate = 1.0 - self.decay
            self._fused_updates[indices] = tf.function(
                lambda: _move(pairs, rate), jit_compile=True, autograph=False)
        self._fused_updates[indices]()

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Host: the weights hold their averages inside the block, the raw values after."""
        raw = [tf.identity(tf.convert_to_tensor(weight)) for weight, _ in self.pairs]
        try:
            for weight, average in self.pairs:
                weight.assign(tf.cast(tf.convert_to_tensor(average), weight.dtype))
            yield
        finally:
            for (weight, _), value in zip(self.pairs, raw):
                weight.assign(value)


def _move(pairs: list[tuple[tf.Variable, tf.Variable]], rate: float) -> None:
    """``average -= rate * (average - weight)`` for each (weight, average) pair."""
    for weight, average in pairs:
        value = tf.convert_to_tensor(weight)
        if value.dtype != average.dtype:
            value = tf.cast(value, average.dtype)
        # ema - (1-d)(ema - w) == d*ema + (1-d)*w (as tf.train's assign_moving_average).
        average.assign_sub(rate * (average - value), read_value=False)
