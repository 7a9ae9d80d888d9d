"""The implementations compared by :mod:`benchmarks.speed.throughput` (one class each).

Every implementation trains the same workload (model, Adam, synthetic in-memory data,
global batch) and exposes ``run(steps)``: train that many more steps. ``warm_up`` runs
before the timed rounds (tracing, compilation, and for the framework's default config
the plan's measuring). ``xla`` is the XLA state the implementation actually ran with.
``in_fit_s``: for the framework, the seconds of its last ``run`` inside the ``fit()``
(:func:`fit_clock`); None for the others, whose ``run`` is all loop calls.
"""

from __future__ import annotations

import math
import time

K = 100  # steps per loop / per execution of the hand-written loop and fixed configs
IMPLEMENTATIONS = ("a", "a-short", "a-fixed", "a+xla", "b", "c", "c+xla", "d", "e")
REFERENCES = ("c", "c+xla")  # always run: "vs c" and "vs best" are ratios to them
PLANNED_RUN_S = 600.0  # a's first fit: this long at the reference's step time, stopped
#                        once the plan is decided


def setup_devices(strategy_name: str):
    """The strategy of ``strategy_name`` ("mirrored2": 2 logical CPU devices; before TF
    initialises its devices)."""
    import tensorflow as tf

    if strategy_name == "mirrored2":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        return tf.distribute.MirroredStrategy(
            [d.name for d in tf.config.list_logical_devices("CPU")])
    return tf.distribute.get_strategy()


class _Impl:
    """One implementation: ``run(steps)`` trains that many steps (after ``warm_up``)."""

    xla = False
    in_fit_s: float | None = None

    def warm_up(self, steps: int, step_s: float | None = None) -> None:
        """Trace and warm up: ``steps`` steps (``step_s``: the reference's seconds per
        step, when known)."""
        self.run(steps)


def _stop_after_plan():
    """A callback that stops the Trainer's first fit at the first loop end after the
    plan event; later fits run to their end."""
    from trainer import Callback

    class StopAfterPlan(Callback):
        armed = True

        def on_loop_end(self, trainer) -> None:
            if self.armed and any(r["kind"] == "plan" for r in trainer.events.records):
                self.armed = False
                trainer.request_stop("benchmark: plan decided")

    return StopAfterPlan()


def fit_clock():
    """A :class:`FitClock` (a ``trainer.Callback``; built here so that importing this
    module does not import the framework)."""
    from trainer import Callback

    class FitClock(Callback):
        """Times the loop calls of one ``fit()`` and the host work between them.

        ``calls`` (the last fit's): per loop call, ``(steps, seconds of the compiled
        call, host seconds)``: the call's span as the loop timed it
        (``trainer.context.last_loop``) and the rest of the time between two
        ``on_loop_end`` (the first counts from the end of ``on_fit_start``: user
        callbacks run after the framework's services). ``in_fit_s``: the seconds the
        fit's steps take at the rate of its calls after the first, host work included:
        the fit without its start and end. The first call is part of the start: a
        fit that builds a new iterator skips the batches consumed before it there (a
        resume); one that continues the kept iterator does not."""

        def __init__(self):
            self.start = self.end = 0.0  # the end of on_fit_start, the last on_loop_end
            self.calls: list[tuple[int, float, float]] = []

        def on_fit_start(self, trainer) -> None:
            self.start = self.end = time.perf_counter()
            self.calls = []

        def on_loop_end(self, trainer) -> None:
            now = time.perf_counter()
            steps, seconds = trainer.context.last_loop
            self.calls.append((steps, seconds, now - self.end - seconds))
            self.end = now

        @property
        def in_fit_s(self) -> float:
            later = self.calls[1:] or self.calls
            seconds = sum(s + h for _, s, h in later)
            return seconds * sum(n for n, _, _ in self.calls) / sum(n for n, _, _ in later)

    return FitClock()


class Framework(_Impl):
    """``Trainer.fit`` on the workload.

    ``plan="auto"``: the DEFAULT config (``perf.plan="auto"``, the default
    ``train.steps_per_loop``). Its warm-up starts a fit declared ``PLANNED_RUN_S`` long
    at the reference's step time, as a real run would be (the planner measures only
    runs longer than ``perf.plan_min_run_s`` and sizes its trials by the run's
    length), and stops it at the first loop end after the plan event (callback), then
    warms the chosen plan up; the timed fits reuse the plan. ``plan="short"``: the
    same default config in short fits only, as a user iterating runs them (never
    measured): the plan the cache holds for its key (a's measurement, earlier in the
    same process and cache), else the configured one. ``plan="fixed"``:
    ``perf.plan="fixed"``, ``steps_per_loop=K``, ``perf.jit_compile=jit``: exactly the
    config as written. ``clock``: a :func:`fit_clock` of every fit, which
    ``in_fit_s`` reads.
    """

    clock = None

    def __init__(self, workload, strategy, plan: str, jit: bool = False, **overrides):
        from benchmarks.common.workloads import framework_trainer

        self.auto = plan == "auto"
        self.clock = fit_clock()
        callbacks = [_stop_after_plan(), self.clock] if self.auto else [self.clock]
        if plan == "fixed":
            overrides = {"perf.plan": "fixed", "perf.jit_compile": jit, **overrides}
        # ``overrides``: "section.field" -> value set on the config, in every mode.
        self.trainer = framework_trainer(workload, K if plan == "fixed" else None,
                                         strategy=strategy, callbacks=callbacks, **overrides)
        self.xla = self.trainer.steps.jit_compiled  # off with 2+ replicas (logged)

    def warm_up(self, steps: int, step_s: float | None = None) -> None:
        if self.auto:  # a fit of PLANNED_RUN_S (at least) that stops after the plan
            self.run(max(steps, math.ceil(PLANNED_RUN_S / (step_s or 1e-3))))
        self.run(steps)
        if self.plan() is not None:
            self.xla = self.plan()["chosen"]["xla"]  # "off" | "grads" | "step"

    def run(self, steps: int) -> None:
        self.trainer.config.train.steps = self.trainer.step + steps
        self.trainer.fit()

    @property
    def in_fit_s(self) -> float | None:
        return self.clock.in_fit_s if self.clock else None

    def plan(self) -> dict | None:
        """The plan event of this Trainer (``trainer.events.records``), or None."""
        return next((r for r in self.trainer.events.records if r["kind"] == "plan"), None)


def _hand_written_step(workload, strategy, xla: bool):
    """``(replica_step, distributed iterator)``; ``xla``: the replica step (forward,
    backward and update) is a ``tf.function(jit_compile=True)``."""
    import keras
    import tensorflow as tf

    with strategy.scope():
        model = workload.build_model()
        optimizer = keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)
    batch = workload.batch_size

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    x, y = workload.data(4096)

    def dataset_fn(ctx):
        per_replica = ctx.get_per_replica_batch_size(batch)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
            per_replica, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    step = tf.function(replica_step, jit_compile=True) if xla else replica_step
    return step, iterator


class HandPerStep(_Impl):
    """A hand-written ``tf.function`` called once per step."""

    def __init__(self, workload, strategy):
        import tensorflow as tf

        replica_step, self.iterator = _hand_written_step(workload, strategy, xla=False)

        @tf.function
        def step(iterator):
            strategy.run(replica_step, args=next(iterator))

        self.step = step

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step(self.iterator)


class HandInGraph(_Impl):
    """A hand-written ``tf.function`` running ``per_call`` (default K) steps in a
    ``tf.range`` loop; ``xla``: the replica step inside it is XLA-compiled."""

    def __init__(self, workload, strategy, xla: bool, per_call: int = K):
        import tensorflow as tf

        replica_step, self.iterator = _hand_written_step(workload, strategy, xla)
        self.xla, self.per_call = xla, per_call

        @tf.function
        def loop(iterator, n):
            for _ in tf.range(n):
                strategy.run(replica_step, args=next(iterator))

        self.loop = loop

    def run(self, steps: int) -> None:
        import tensorflow as tf

        for _ in range(steps // self.per_call):
            self.loop(self.iterator, tf.constant(self.per_call))


class KerasFit(_Impl):
    """``keras.Model.fit`` with ``steps_per_execution``."""

    def __init__(self, workload, strategy, steps_per_execution: int):
        import keras
        import tensorflow as tf

        x, y = workload.data(4096)
        with strategy.scope():
            self.model = workload.build_model()
            self.model.compile(
                optimizer=keras.optimizers.Adam(),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=steps_per_execution)
        self.dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
            workload.batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    def run(self, steps: int) -> None:
        self.model.fit(self.dataset, steps_per_epoch=steps, epochs=1, verbose=0)
        self.xla = bool(self.model.jit_compile)


def build(name: str, workload, strategy) -> _Impl:
    """The implementation ``name`` (one of ``IMPLEMENTATIONS``), built, not warmed up."""
    return {
        "a": lambda: Framework(workload, strategy, "auto"),
        "a-short": lambda: Framework(workload, strategy, "short"),
        "a-fixed": lambda: Framework(workload, strategy, "fixed"),
        "a+xla": lambda: Framework(workload, strategy, "fixed", jit=True),
        "b": lambda: HandPerStep(workload, strategy),
        "c": lambda: HandInGraph(workload, strategy, xla=False),
        "c+xla": lambda: HandInGraph(workload, strategy, xla=True),
        "d": lambda: KerasFit(workload, strategy, 1),
        "e": lambda: KerasFit(workload, strategy, K),
    }[name]()
