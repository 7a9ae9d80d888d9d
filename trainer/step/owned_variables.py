"""Trainable variables a Trainer holds itself, outside its model.

A learnable scalar next to the model (CLIP's log-temperature, a loss weight, an
uncertainty weighting) is naturally written ``self.log_temp = tf.Variable(0.0)`` in
``build_model``. PyTorch Lightning trains every parameter a module holds; so does the
framework: :func:`find` lists the trainable ``tf.Variable`` and ``keras.Variable``
objects in the Trainer's public attributes (directly, or in lists, tuples and dicts of
them, nested), by attribute path (``log_temp``, ``temps/0``, ``weights/text``). The
gradient path (:class:`trainer.step.gradients.GradientPath`) adds them to the model's
trainable variables: the default step and ``apply_gradients`` train them, the optimizer
and the EMA are built over them, checkpoints and the replica-consistency check cover
them.

Only variables created inside ``strategy.scope()`` (in a ``build_*`` hook) are one copy
per replica kept equal by the update; one created elsewhere (in ``__init__`` before
``super().__init__``) is refused with one line (:func:`check_in_scope`). A Keras layer
held beside the model (not a ``keras.Model``) with trainable weights is refused with
one line (:mod:`trainer.checks.held_layers`): put it in the model, or freeze it.

Host only: :func:`collect` is called once, after the ``build_*`` hooks.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import keras
import tensorflow as tf

from trainer.errors import HookError


def _is_variable(value: Any) -> bool:
    return isinstance(value, (tf.Variable, keras.Variable))


def _walk(path: str, value: Any, found: list) -> None:
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _walk(f"{path}/{i}", item, found)
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            _walk(f"{path}/{key}", value[key], found)
    else:
        found.append((path, value))


def leaves(attributes: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``[(attribute path, value)]``: every value in a public entry of ``attributes`` (an
    object's ``vars()``), lists, tuples and dicts opened (``temps/0``, ``weights/text``),
    sorted by path."""
    found: list = []
    for attr in sorted(attributes):
        if not attr.startswith("_"):
            _walk(attr, attributes[attr], found)
    return found


def find(attributes: Mapping[str, Any], known: Iterable) -> list[tuple[str, Any]]:
    """``[(attribute path, variable)]``: every trainable variable in a public entry of
    ``attributes`` (a Trainer's ``vars()``), sorted by path, each once, none of
    ``known`` (the model's and the optimizers' variables)."""
    found = [(path, value) for path, value in leaves(attributes) if _is_variable(value)]
    seen = {id(v) for v in known}
    owned = []
    for path, variable in found:
        if variable.trainable and id(variable) not in seen:
            seen.add(id(variable))
            owned.append((path, variable))
    return owned


def collect(owner: str, attributes: Mapping[str, Any],
            strategy: tf.distribute.Strategy) -> list[tuple[str, Any]]:
    """:func:`find` over a Trainer's ``vars()`` (``attributes``), leaving out the
    variables of the Keras layers, models and optimizers it holds, then
    :func:`check_in_scope` (``owner``: the Trainer class's name, for the message)."""
    held = [value for value in attributes.values()
            if isinstance(value, (keras.layers.Layer, keras.optimizers.Optimizer))]
    owned = find(attributes, [v for value in held for v in value.variables])
    check_in_scope(owner, owned, strategy)
    return owned


def check_in_scope(owner: str, owned: list[tuple[str, Any]],
                   strategy: tf.distribute.Strategy) -> None:
    """Raises :class:`HookError` naming the first of ``owned`` that was not created in
    ``strategy.scope()`` (it would be one copy outside the replicas' variables)."""
    for path, variable in owned:
        handle = variable.value if isinstance(variable, keras.Variable) else variable
        if not strategy.extended.variable_created_in_scope(handle):
            raise HookError(
                f"{owner}.{path} is a trainable variable created outside strategy.scope(): "
                f"the framework trains a Trainer's own variables, and they must be created "
                f"in build_model() (or as a weight of a layer of the model).")
