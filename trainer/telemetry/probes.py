"""Short timing probes of one Trainer's input pipeline and compute, used by telemetry
and the doctor.

With in-graph loops the host cannot see how long each step waited for its batch, so
the input wait is *estimated* from two probes run between train loops (cross-replica
context, on the host, eagerly calling small ``tf.function`` loops):

* :class:`InputProbe` pulls batches from a SECOND distributed copy of the train
  dataset (built once with the same ``build_train_dataset`` and options; the training
  iterator is never touched, so the run sees exactly the data it would see without
  telemetry) in an in-graph loop: seconds per global batch of the pipeline alone.
* :class:`ComputeProbe` runs the model's forward and backward pass (no optimizer
  update, no all-reduce) on one cached batch in an in-graph loop: seconds per step of
  compute alone. Its random draws are keyed as the step's
  (:func:`trainer.step.random_streams.keyed`). Non-trainable state the forward pass
  changes (BatchNorm statistics, dropout seed state, the random generators of
  ``run.random_states()``, the Trainer's Keras global generator included) is restored
  afterwards, so a probe leaves the run unchanged.

:func:`input_wait_fraction` combines them with the observed step time by the usual
overlap model (prefetch lets the pipeline run while the step computes, so a step
waits ``max(0, t_input - t_compute)``).
"""

from __future__ import annotations

import time

import tensorflow as tf

from trainer import data, precision
from trainer.data import iterator_release
from trainer.run_context import RunContext
from trainer.runtime.tracing import no_autograph, per_object_function
from trainer.step import random_streams


@no_autograph
def _local_tensors(value) -> list:
    """The tensors of a (possibly distributed) nested value on this worker."""
    out = []
    for item in tf.nest.flatten(value, expand_composites=False):
        values = getattr(item, "values", None)
        out.extend(values if isinstance(values, tuple) else [item])
    return out


class InputProbe:
    """Times the train input pipeline alone, on a second copy of the distributed dataset.

    The copy is built on first use and kept (its iterator stays warm between probes);
    it costs the memory of one more pipeline (e.g. its shuffle buffer) until
    :meth:`close`.
    """

    def __init__(self, run: RunContext):
        self._dataset = data.distribute(
            run.strategy, run.train_dataset_fn, run.batch,
            deterministic=run.config.train.deterministic)
        self._iterator = iter(self._dataset)

        @per_object_function
        def drain(iterator, num_batches):
            count = tf.constant(0, tf.int64)
            for _ in tf.range(num_batches):
                batch = next(iterator)
                # Depend on every pulled tensor so nothing is pruned away.
                count += tf.add_n([tf.cast(tf.size(t), tf.int64) for t in _local_tensors(batch)])
            return count

        self._drain = drain
        self._drain(self._iterator, tf.constant(1, tf.int64)).numpy()  # trace and warm up

    def close(self) -> None:
        """Drops the copy and its iterator, destroyed on a background thread
        (:mod:`trainer.data.iterator_release`: the autotune thread's wait stays off the
        training thread). Host; the probe is unusable afterwards."""
        held = [self._iterator, self._dataset]
        self._iterator = self._dataset = None
        iterator_release.release(held)

    def next_batch(self):
        """One distributed batch (a PerReplica structure) from the probe's copy."""
        return next(self._iterator)

    def seconds_per_batch(self, num_batches: int, floor_s: float = 0.0,
                          max_chunks: int = 16) -> float:
        """Steady-state wall seconds per global batch of the pipeline alone.

        Between probes the copy's prefetch buffers fill up (tf.data grows an AUTOTUNE
        prefetch buffer while its consumer waits, so it can hold many batches), and
        buffered batches come out almost instantly. First the stock is drained: while a
        chunk runs faster than ``floor_s`` per batch (the caller's "too fast to be the
        pipeline it suspects") and takes less than ``num_batches * floor_s`` in all, the
        next chunk is twice as large. Then chunks of ``num_batches`` are pulled until two
        consecutive ones take about the same time (within 25%; at most ``max_chunks``
        chunks in all): they time the pipeline itself. With ``floor_s=0`` there is no
        drain phase and a shallow buffer drains in the first chunks.
        """
        size, chunks = num_batches, []
        for _ in range(max_chunks):
            start = time.perf_counter()
            self._drain(self._iterator, tf.constant(size, tf.int64)).numpy()
            seconds = time.perf_counter() - start
            per_batch = seconds / size
            if not chunks and per_batch < floor_s and seconds < num_batches * floor_s:
                size *= 2  # stock (or a pipeline that fast): keep draining
            elif size != num_batches:
                size = num_batches  # drained: measure from the next chunk
            else:
                chunks.append(per_batch)
                if len(chunks) >= 2 and abs(chunks[-1] - chunks[-2]) <= 0.25 * max(chunks[-2:]):
                    return (chunks[-1] + chunks[-2]) / 2
        return per_batch


class ComputeUnavailable(RuntimeError):
    """The compute probe cannot represent this Trainer's step (the message says why)."""


class ComputeProbe:
    """Times forward + backward of ``run.model`` on one cached batch.

    Only for Trainers that keep the default ``train_step`` and ``(features, labels)`` /
    dict batches; otherwise the constructor raises :class:`ComputeUnavailable`. The
    optimizer update and the gradient all-reduce are NOT included, so this is a lower
    bound of the step's compute time.
    """

    def __init__(self, run: RunContext, batch):
        if run.overrides_train_step:
            raise ComputeUnavailable(
                f"{run.trainer_name} overrides train_step; the probe cannot know "
                f"which models it runs.")
        strategy, model = run.strategy, run.model
        # the forward pass's state and the generators outside the model (a layer's
        # tf.random.Generator, a Trainer's SeedGenerator compute_loss draws from)
        self._state = [*model.non_trainable_variables, *(v for _, v in run.random_states())]

        compute_loss = run.steps.compute_loss

        @no_autograph
        def replica_step(b):
            features, _ = data.split_batch(b)
            with tf.GradientTape() as tape:
                outputs = precision.outputs_to_float32(model(features, training=True))
                loss = tf.reduce_sum(tf.cast(compute_loss(b, outputs), tf.float32))
            grads = tape.gradient(loss, model.trainable_variables)
            sums = [tf.reduce_sum(tf.cast(g.values if isinstance(g, tf.IndexedSlices) else g,
                                          tf.float32)) for g in grads if g is not None]
            return tf.add_n(sums) if sums else loss

        # Its random draws keyed as the step's; unseeded ones from the Trainer's global
        # generator (Keras' own, made at the first draw, failed the trace on 2 replicas).
        keyed_step = no_autograph(random_streams.keyed(replica_step, run.step_counter))

        @per_object_function
        def run(b, num_steps):
            total = tf.constant(0.0)
            for _ in tf.range(num_steps):
                total += tf.add_n(strategy.experimental_local_results(
                    strategy.run(keyed_step, args=(b,))))
            return total

        self._batch = batch
        self._run = run
        try:
            self._timed(1)  # trace and warm up
        except ValueError as error:
            raise ComputeUnavailable(str(error)) from error

    def _timed(self, num_steps: int) -> float:
        saved = [tf.identity(v) for v in self._state]
        start = time.perf_counter()
        self._run(self._batch, tf.constant(num_steps, tf.int64)).numpy()
        seconds = time.perf_counter() - start
        for variable, value in zip(self._state, saved):
            variable.assign(value)
        return seconds

    def seconds_per_step(self, num_steps: int, repeats: int = 2) -> float:
        """Wall seconds per forward+backward step: the best of ``repeats`` timings of
        ``num_steps`` steps (the least disturbed by other work on the machine)."""
        return min(self._timed(num_steps) for _ in range(repeats)) / num_steps


class ProbeSchedule:
    """When telemetry runs the probes, over all ``fit()`` calls of one Trainer: at the
    first window after warm-up (window 2) once, when a regression alert fires (its cause
    is judged from the current input), and otherwise only while the probes so far took
    at most ``budget`` of the wall time since the schedule started (0: no limit): every
    ``every`` windows, and at the first slow window of a streak. ``every=0``: never.

    The budget keeps "always on" light where windows are short: a probe costs ~0.1 s
    on the 2-replica MLP, whose 100-step window lasts 0.3 s. A slow window is held to it
    too: in an input-bound run with short windows, the batches a probe lets the train
    pipeline stock up make the next windows fast and the one after "slow", so probing
    at every slow window fed itself (a probe every 5 to 15 windows). Host.
    """

    def __init__(self, every: int, budget: float):
        self.every, self.budget = every, budget
        self._start = time.perf_counter()
        self._spent = 0.0  # seconds in probes since the start

    def due(self, window: int, *, slow: bool = False, alert: bool = False) -> bool:
        """Whether to probe after logging window ``window`` of a fit (1-based, > 1);
        ``slow``: the window starts a slow streak; ``alert``: an alert fires at it."""
        if not self.every:
            return False
        if alert or not self._spent:
            return True
        elapsed = time.perf_counter() - self._start
        within = not self.budget or self._spent <= self.budget * elapsed
        return within and (slow or (window - 2) % self.every == 0)

    def spent(self, seconds: float) -> None:
        """Adds the host seconds one probe took."""
        self._spent += seconds


def input_wait_fraction(input_s: float, compute_s: float, step_s: float) -> float:
    """Estimated fraction of the step time spent waiting for input, in [0, 1].

    ``input_s``: the pipeline alone, seconds per global batch; ``compute_s``: compute
    alone, seconds per step; ``step_s``: the observed seconds per step. With prefetch
    the pipeline overlaps compute, so a step waits ``input_s - compute_s`` when that is
    positive. A window faster than the pipeline (``step_s < input_s``) was fed from the
    prefetch buffer (e.g. filled while a probe ran) and says nothing about the steady
    state, whose step time is at least ``input_s``: the fraction is taken of
    ``max(step_s, input_s, compute_s)``.
    """
    period = max(step_s, input_s, compute_s)
    if period <= 0:
        return 0.0
    return min(1.0, max(0.0, input_s - compute_s) / period)
