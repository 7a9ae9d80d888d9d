"""The loop driver's face towards the services: :class:`LoopContext`, the one
implementation of :class:`trainer.run_context.RunContext`.

It is built by the Trainer's wiring (:mod:`trainer.trainer`) over the Trainer and its
loop driver, plus the one answer that lives in a service (how to restore after pending
saves), so that no service holds another one. Only this
module, :mod:`trainer.loop.driver` and :mod:`trainer.trainer` touch the driver.
"""

from __future__ import annotations

from typing import Any, Callable

import keras

from trainer.distribution import strategies
from trainer.step import random_streams


class LoopContext:
    """See :class:`trainer.run_context.RunContext` for every member's contract.

    Args:
      trainer: the Trainer (its public attributes and hooks).
      driver: its :class:`trainer.loop.driver.LoopDriver`.
      restore: ``() -> step | None``: the latest checkpoint, after pending saves.
      service_states: ``() -> {checkpoint_key: state}`` of the services.
    """

    def __init__(self, trainer: Any, driver: Any, restore: Callable[[], int | None],
                 service_states: Callable[[], dict]):
        self._trainer, self._driver = trainer, driver
        self._restore = restore
        self._service_states = service_states
        self._announced: list[tuple[str, Any]] = []

    # ------------------------------------------------------------------ read
    # The Trainer's attributes, read when asked (a subclass may set them after __init__).
    config = property(lambda self: self._trainer.config)
    strategy = property(lambda self: self._trainer.strategy)
    workdir = property(lambda self: self._trainer.workdir)
    batch = property(lambda self: self._trainer.batch)
    model = property(lambda self: self._trainer.model)
    optimizer = property(lambda self: self._trainer.optimizer)
    ema = property(lambda self: self._trainer.ema)
    precision = property(lambda self: self._trainer.precision)
    gradients = property(lambda self: self._trainer.gradients)
    step_counter = property(lambda self: self._trainer.step_counter)
    steps = property(lambda self: self._trainer.steps)
    train_dataset_fn = property(lambda self: self._trainer.build_train_dataset)

    @property
    def step(self) -> int:
        return self._trainer.step

    @property
    def is_chief(self) -> bool:
        return strategies.is_chief(self.strategy)

    @property
    def trainer_name(self) -> str:
        return type(self._trainer).__name__

    @property
    def has_eval_dataset(self) -> bool:
        return self._trainer.has_eval_dataset()

    @property
    def overrides_train_step(self) -> bool:
        return self._trainer.overrides("train_step")

    @property
    def eval_metric_names(self) -> tuple[str, ...]:
        return tuple(self._trainer.eval_metrics)

    @property
    def last_loop(self) -> tuple[int, float]:
        return self._driver.last_loop

    @property
    def last_outputs(self) -> dict:
        return self._driver.last_outputs

    @property
    def input_report(self) -> dict:
        return self._driver.input_report

    @property
    def saved_plan(self) -> dict | None:
        return self._driver.planner.saved()

    @property
    def service_states(self) -> dict[str, dict]:
        return self._service_states()

    @property
    def last_resume(self) -> Any:
        return self._driver.resumed

    @property
    def stopped_by(self) -> str | None:
        return self._driver.stopped_by

    def other_models_and_optimizers(self) -> dict[str, Any]:
        trainer = self._trainer
        return {attr: value for attr, value in sorted(vars(trainer).items())
                if not attr.startswith("_") and attr not in ("model", "optimizer")
                and isinstance(value, (keras.Model, keras.optimizers.Optimizer))}

    def owned_variables(self) -> list[tuple[str, Any]]:
        return list(self._trainer.gradients.owned)

    def random_states(self) -> list[tuple[str, Any]]:
        trainer = self._trainer
        return random_streams.find(vars(trainer), trainer.model, trainer.step_counter)

    def train_graph(self) -> Any:
        return self._driver.train_graph()

    def train_batch_spec(self) -> Any:
        return self._driver.train_batch_spec()

    # ------------------------------------------------------------------- ask
    def request_stop(self, reason: str) -> None:
        self._driver.request_stop(reason)

    def request_preemption(self) -> None:
        self._driver.request_preemption()

    def ensure_built(self, dist_dataset: Any = None) -> None:
        self._driver.ensure_built(dist_dataset)

    def evaluate(self) -> dict[str, float]:
        return self._trainer.evaluate()

    def export(self, path: str) -> None:
        self._trainer.export(path)

    def restore(self) -> int | None:
        return self._restore()

    def resumed(self, resumed: Any) -> None:
        self._driver.resumed = resumed
        self._trainer.step = resumed.step

    def reset_train_window(self) -> None:
        self._driver.train_readout.reset()

    def announce_eval(self, logs: dict[str, float]) -> None:
        self._announced.append(("on_eval_end", logs))

    def announce_checkpoint(self, step: int) -> None:
        self._announced.append(("on_checkpoint", step))

    def take_announcements(self) -> list[tuple[str, Any]]:
        """The dispatcher's side: the ``(hook, argument)`` pairs announced since the last
        call, in order (and forgets them)."""
        announced, self._announced = self._announced, []
        return announced
