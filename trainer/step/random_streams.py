"""Random draws that differ across replicas, repeat across runs and survive a resume.

Keras keeps a ``SeedGenerator``'s state in one variable; made in ``strategy.scope()`` it
is mirrored, so every replica read the same state and drew the same numbers (a Dropout
on 2 replicas dropped the same units in both halves of the global batch). Three parts:

* :func:`keyed`: the loops call the replica step through it. Every seed a Keras random
  op draws in the step (a layer's own generator, ``keras.random.*`` with a
  ``SeedGenerator``, an int or no seed) has the step (``step_counter``) and the
  replica's id in the sync group (unique across workers) folded in
  (:func:`trainer.runtime.keras_compat.seed_key`; under ``distribute.strategy=manual``
  the device slice's index too). Replicas draw independent streams; the same command
  draws the same numbers. With ``distribute.random_draws="global"`` the train step's
  key has no replica id and a draw led by the per-replica batch is drawn for the global
  batch, of which the replica keeps its rows
  (:func:`trainer.runtime.pinned_draws.draw_rows`; manual: the slice's rows): N replicas
  draw what one draws for the same global batch. A ``tf.random.Generator`` made in
  the scope already gives each replica its own stream and is left as it is. A
  stateful ``tf.random.*`` op (``tf.random.uniform(seed=...)``, ``tf.nn.dropout``)
  restarts its sequence in every new ``tf.function`` and process: it can be neither
  keyed nor saved, and the trace logs one warning naming it and the alternatives.
* :func:`seed`: ``keras.utils.set_random_seed(config.seed)``, then the Trainer's own
  Keras global ``SeedGenerator``, made in its strategy's scope with an initial seed
  that depends on ``config.seed`` only. A ``keras.random.*`` op without a seed
  (``keras.random.dropout(x, 0.5)``) in the step draws from it (:func:`keyed` installs
  it while the step is traced: :func:`trainer.runtime.keras_compat.global_seed_generator`),
  not from Keras' own global generator, which Keras made lazily at the first draw:
  outside any scope (on 2 Mirrored replicas the trace failed) and never saved (a
  resumed run drew other numbers).
* :func:`find`: the state of every ``keras.random.SeedGenerator`` and
  ``tf.random.Generator`` the Trainer holds (in public attributes, nested in lists,
  tuples and dicts) or a layer of its model holds, that is not a model variable
  already, and of the Trainer's global generator (named :data:`GLOBAL_NAME`): the
  checkpoint's ``random`` group (:mod:`trainer.checkpoint.state`), so a resumed run
  draws what an uninterrupted one draws.

Contexts: :func:`keyed`'s function runs in replica context at trace time; :func:`seed`
on the host in ``strategy.scope()``; :func:`find` on the host.
"""

from __future__ import annotations

import contextlib
import random
import weakref
from typing import Any, Callable, Mapping

import keras
import tensorflow as tf
from absl import logging

from trainer.runtime import keras_compat, pinned_draws
from trainer.step import owned_variables

#: Stateful TensorFlow random ops that take an op seed: their sequence restarts in every
#: new tf.function and process (and is the same on every replica).
STATEFUL_RANDOM_OPS = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "Multinomial", "RandomShuffle", "RandomGamma", "RandomPoisson", "RandomPoissonV2"})
_FUNCTION_ATTRS = ("f", "then_branch", "else_branch", "body", "cond")
# The stateful op types already named, per Trainer (by the id of its step counter, as
# long as it lives): one warning each, however many loops (plans) trace the step.
_WARNED: dict[int, set[str]] = {}
#: The name of a Trainer's global generator in the checkpoint's ``random`` group (no
#: attribute path has a dot).
GLOBAL_NAME = "keras.random.global_seed_generator"
# The global generator of each Trainer (by the id of its step counter, as long as it lives).
_GLOBAL: dict[int, "_GlobalSeedGenerator"] = {}


class _GlobalSeedGenerator(keras.random.SeedGenerator):
    """A Trainer's Keras global generator; ``drawn``: a traced step drew from it."""

    drawn = False

    def next(self, ordered: bool = True):
        self.drawn = True
        return super().next(ordered)


def seed(value: int, step_counter: tf.Variable) -> None:
    """``keras.utils.set_random_seed(value)`` (Python, NumPy, TensorFlow and Keras' global
    seeds), then the global generator of the Trainer whose step counter is
    ``step_counter``, made in the current scope (call it in ``strategy.scope()``) with an
    initial seed that depends on ``value`` only (see the module docstring)."""
    keras.utils.set_random_seed(value)
    initial = random.Random(f"{GLOBAL_NAME} {value}").randint(1, 10**9)
    _GLOBAL[id(step_counter)] = _GlobalSeedGenerator(initial, name="global_seed_generator")
    weakref.finalize(step_counter, _GLOBAL.pop, id(step_counter), None)


def drew_global(step_counter: tf.Variable) -> bool:
    """Whether a traced step of the Trainer whose step counter is ``step_counter`` drew
    from its global generator (a ``keras.random.*`` op without a seed)."""
    generator = _GLOBAL.get(id(step_counter))
    return generator is not None and generator.drawn


def global_rows(config: Any, batch: Any) -> int:
    """The per-replica batch (``batch``: :class:`trainer.data.BatchSizes`) under
    ``config.distribute.random_draws="global"``, else 0: :func:`keyed`'s ``rows``."""
    return batch.per_replica if config.distribute.random_draws == "global" else 0


def keyed(step_fn: Callable, step_counter: tf.Variable, rows: int = 0) -> Callable:
    """``step_fn`` (a replica step ``batch -> outputs``) drawing its Keras random numbers
    from a stream keyed by (seed, step, replica), its unseeded ones from the global
    generator :func:`seed` made for the Trainer (``step_counter``), if any; warns once
    per stateful random op type the Trainer's traces hold (see the module docstring).
    ``rows`` > 0 (the per-replica batch): keyed by (seed, step), a draw led by ``rows``
    is the replica's rows of the draw for all replicas' rows."""
    if id(step_counter) not in _WARNED:
        _WARNED[id(step_counter)] = set()
        weakref.finalize(step_counter, _WARNED.pop, id(step_counter), None)
    warned = _WARNED[id(step_counter)]

    def keyed_step(batch):
        graph = tf.compat.v1.get_default_graph()
        first_op = len(graph.get_operations())
        context = tf.distribute.get_replica_context()
        replica = context.replica_id_in_sync_group
        step = tf.cast(tf.math.floormod(step_counter.read_value(), tf.int32.max),
                       tf.int32)
        if rows:
            start = tf.cast(replica, tf.int32) * rows
            key = pinned_draws.draw_rows(start, rows, rows * context.num_replicas_in_sync)
        else:
            key = keras_compat.seed_key(replica)
        generator = _GLOBAL.get(id(step_counter))
        with (keras_compat.seed_key(step), key, contextlib.nullcontext()
              if generator is None else keras_compat.global_seed_generator(generator)):
            outputs = step_fn(batch)
        if not tf.executing_eagerly():
            for op_type, name in stateful_random_ops(graph, first_op):
                if op_type not in warned:
                    warned.add(op_type)
                    logging.warning("%s", stateful_warning(op_type, name))
        return outputs

    return keyed_step


def stateful_random_ops(graph: tf.Graph, first_op: int = 0) -> list[tuple[str, str]]:
    """``[(op type, op name)]`` of the stateful random ops (:data:`STATEFUL_RANDOM_OPS`)
    of ``graph`` from its ``first_op``-th op on, and of the functions those ops call."""
    found = []
    for op in graph.get_operations()[first_op:]:
        if op.type in STATEFUL_RANDOM_OPS:
            found.append((op.type, op.name))
        for attr in _FUNCTION_ATTRS:
            try:
                name = op.get_attr(attr).name
            except (ValueError, AttributeError):  # no such attribute / not a function
                continue
            body = keras_compat.nested_function_graph(graph, name)
            if body is not None:
                found.extend(stateful_random_ops(body))
    return found


def stateful_warning(op_type: str, name: str) -> str:
    """The one line that names a stateful random op of the step and what to use."""
    return (f"The train step draws with the stateful TensorFlow op {op_type} ('{name}', "
            f"e.g. tf.random.uniform(seed=...) or tf.nn.dropout): its sequence restarts in "
            f"every new tf.function and process and is the same on every replica, so it is "
            f"neither keyed per replica nor saved in checkpoints; use keras.random.* with a "
            f"keras.random.SeedGenerator (or a Keras layer), tf.random.stateless_* or a "
            f"tf.random.Generator made in build_model instead.")


def _state(value: Any) -> Any | None:
    """The state variable of a Keras ``SeedGenerator`` or a ``tf.random.Generator``."""
    if isinstance(value, (keras.random.SeedGenerator, tf.random.Generator)):
        return value.state
    return None


def find(attributes: Mapping[str, Any], model: keras.Model,
         step_counter: tf.Variable | None = None) -> list[tuple[str, Any]]:
    """``[(name, state variable)]``: the random generators' states of a Trainer
    (``attributes``: its ``vars()``; public entries, named by attribute path) and of the
    layers of ``model`` and of the Keras layers in its public attributes (named
    ``LAYER_PATH/attribute``), each once, none of ``model.variables``, in a fixed order;
    last, as :data:`GLOBAL_NAME`, the global generator :func:`seed` made for the Trainer
    whose step counter is ``step_counter``, if any (drawn from or not: :func:`drew_global`)."""
    found = owned_variables.leaves(attributes)
    holders = [model, *(v for _, v in found if isinstance(v, keras.layers.Layer))]
    layers = {id(layer): layer for holder in holders for layer in keras_compat.all_layers(holder)}
    for layer in layers.values():
        prefix = getattr(layer, "path", None) or layer.name
        found += [(f"{prefix}/{path}", value)
                  for path, value in owned_variables.leaves(vars(layer))]
    seen = {id(v) for v in model.variables}
    states = []
    for name, value in found:
        state = _state(value)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            states.append((name, state))
    if step_counter is not None and id(step_counter) in _GLOBAL:
        states.append((GLOBAL_NAME, _GLOBAL[id(step_counter)].state))
    return states
