"""The one place that touches Keras- and TensorFlow-private names.

Checked against Keras 3.10 through 3.15 (TensorFlow backend). Each function says which
private name it uses and fails with a clear message when a Keras version lacks it.

* :func:`fresh_names`: Keras numbers auto-named layers and optimizers globally
  (``dense``, ``dense_1``, ...) through ``keras.src.backend.common.global_state``'s
  ``object_name_uids``. A Trainer builds its model and optimizers under fresh
  numbering, so its variable paths are the same in every process and for every
  Trainer built in one process: checkpoints match variables by those paths.
* :func:`make_reduction_switchable` / :func:`apply_reduced`: a Keras optimizer sums
  gradients across replicas inside ``apply`` (``_all_reduce_sum_gradients``). The
  gradient path all-reduces (then unscales, clips and checks) itself, so while it
  applies, that sum is skipped. A user step that calls ``optimizer.apply`` directly
  is reported to the gradient path at trace time (which refuses it unless the Trainer
  declares ``manual_optimization``, then Keras' sum applies).
* :func:`all_layers`: every layer of a model, nested ones included (the private
  ``Layer._flatten_layers``), e.g. to find its BatchNormalization layers.
* :func:`trainable_capable_variables`: the variables of frozen layers
  (``trainable=False``) that training updates once they are unfrozen, read from the
  private ``Layer._flatten_layers`` and ``Layer._trainable_variables`` (Keras 3 keeps a
  frozen layer's weights there; its public ``trainable_weights`` is then empty). The
  optimizer (and the EMA) are built over them too, so unfreezing needs no new optimizer.
* :func:`nested_function_graph`: the graph of a function a ``tf.function`` graph calls
  (``Graph._get_function(name).graph``; checked on TensorFlow 2.21), for counting the
  FLOPs inside nested calls and ``tf.cond`` branches (:mod:`trainer.telemetry.flops`).
* :func:`losses_per_replica`: the losses a forward pass adds (``Layer._losses``,
  private) kept per thread, so Mirrored replicas, which run in threads that take turns
  at synchronization points, never read one another's.
* :func:`summary_writer_handle`: the resource handle of a ``tf.summary`` file writer
  (``_ResourceSummaryWriter._resource``; checked on TensorFlow 2.21), so that ONE
  ``tf.function`` per process writes the scalars of every writer
  (:mod:`trainer.telemetry.summaries`).
* :func:`seed_key`: Keras' TensorFlow backend draws the seed of every random op
  (``keras.random.*`` and the layers built on it: Dropout, GaussianNoise, the random
  augmentations) through ``draw_seed`` (``keras.src.random.seed_generator``), which its
  private modules ``keras.src.backend.tensorflow.random`` and ``...tensorflow.image``
  import by name. Those two names are replaced, once, by a drawing that folds the key of
  the enclosing :func:`seed_key` blocks into the drawn seed (philox ``stateless_fold_in``):
  a replica's step draws its own stream, keyed by step, replica and device slice.
  The same modules see TensorFlow through their module global ``tf``; it is replaced by
  a view of TensorFlow whose stateless uniform, normal, truncated-normal and dropout
  draws default to the philox algorithm: TensorFlow's ``auto_select`` draws ThreeFry
  under XLA on a CPU (7x slower) and philox without. Even with philox, XLA's kernels
  draw other numbers than the CPU kernels from a seed known only at run time (a
  ``SeedGenerator``'s state, the step's key): compiling the step changes its dropout
  masks. Categorical, gamma and binomial draws take no algorithm and are left as they
  are. :mod:`trainer.runtime.pinned_draws` holds that view (and slices its draws by
  rows inside a :func:`~trainer.runtime.pinned_draws.draw_rows` block).
  :func:`rewindable_seeds` records the state of each ``SeedGenerator`` (public
  ``state``; Keras' global one for a draw without a seed) at its first draw, so steps
  traced one after another on one copy of it (manual data parallelism's slices) can
  draw the same seeds.
* :func:`global_seed_generator`: a Keras random op without a seed (``seed=None``) draws
  from Keras' global ``SeedGenerator``, made lazily at its first draw and kept in the
  private thread-local ``global_state`` attribute ``GLOBAL_SEED_GENERATOR``
  (``keras.src.random.seed_generator``). Inside the block, a given generator is that
  global one, so a Trainer's step draws from a generator the Trainer made in its
  strategy's scope and saves in its checkpoints.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import types
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.backend.tensorflow import image as keras_tf_image
from keras.src.backend.tensorflow import random as keras_tf_random
from keras.src.random import seed_generator as keras_seed_generator

from trainer.runtime import pinned_draws

_NAME_UIDS = "object_name_uids"
_PRE_REDUCED = threading.local()  # per replica thread: "gradients are already summed"
_SEED_KEY = threading.local()  # per replica thread: the int32 scalars folded into seeds
#: The private modules whose ``draw_seed`` (imported by name) every Keras random op calls.
SEED_DRAWING_MODULES: tuple[types.ModuleType, ...] = (keras_tf_random, keras_tf_image)


@contextlib.contextmanager
def fresh_names() -> Iterator[None]:
    """Keras auto-names objects created inside as in a fresh process (``dense``, ...).

    Afterwards the global numbering continues above every number used on either side,
    so objects created later outside still get unique names.
    """
    before = global_state.get_global_attribute(_NAME_UIDS, default=None)
    fresh = collections.defaultdict(int)
    global_state.set_global_attribute(_NAME_UIDS, fresh)
    try:
        yield
    finally:
        merged = collections.defaultdict(int, before or {})
        for name, count in fresh.items():
            merged[name] = max(merged[name], count)
        global_state.set_global_attribute(_NAME_UIDS, merged)


def make_reduction_switchable(optimizer: keras.optimizers.Optimizer,
                              on_direct_apply: Callable[[Any], None] | None = None) -> None:
    """Lets :func:`apply_reduced` skip ``optimizer``'s own cross-replica sum (idempotent).

    ``on_direct_apply(optimizer)`` is called when a traced function applies through
    ``optimizer`` without :func:`apply_reduced` (a user step that calls ``optimizer.apply``
    or ``apply_gradients`` itself); it may raise to refuse the step at trace time.
    """
    if getattr(optimizer, "_trainer_switchable", False):
        return
    if not hasattr(optimizer, "_all_reduce_sum_gradients"):
        raise RuntimeError(
            f"{type(optimizer).__name__} has no _all_reduce_sum_gradients: this Keras "
            f"version ({keras.__version__}) changed how optimizers reduce gradients; "
            f"use a Keras version from 3.10 to 3.15.")
    keras_reduce = optimizer._all_reduce_sum_gradients

    def reduce(grads_and_vars):
        if getattr(_PRE_REDUCED, "active", False):
            return list(grads_and_vars)
        if on_direct_apply is not None and not tf.executing_eagerly():
            on_direct_apply(optimizer)
        return keras_reduce(grads_and_vars)

    optimizer._all_reduce_sum_gradients = reduce
    optimizer._trainer_switchable = True


@tf.autograph.experimental.do_not_convert
def apply_reduced(optimizer: keras.optimizers.Optimizer, grads: list, variables: list) -> None:
    """Replica context: ``optimizer.apply`` of gradients that are already all-reduced."""
    _PRE_REDUCED.active = True
    try:
        optimizer.apply(grads, variables)
    finally:
        _PRE_REDUCED.active = False


def nested_function_graph(graph: tf.Graph, name: str) -> tf.Graph | None:
    """The traced graph of the function ``name`` that ``graph`` calls, or None.

    Reads TensorFlow's private ``Graph._get_function`` (the function registered while
    ``graph`` was traced, with every static shape); None where it is missing.
    """
    getter = getattr(graph, "_get_function", None)
    function = getter(name) if getter else None
    return getattr(function, "graph", None)


def all_layers(model: keras.Model) -> list:
    """Every layer of ``model``, nested models' included, each once (``model`` first).
    Uses the private ``Layer._flatten_layers``; without it, ``model.layers`` recursively."""
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is not None:
        return list(flatten(include_self=True, recursive=True))
    found, todo = [], [model]
    while todo:
        layer = todo.pop(0)
        if all(layer is not f for f in found):
            found.append(layer)
            todo.extend(getattr(layer, "layers", []))
    return found


def trainable_capable_variables(model: keras.Model) -> list:
    """``model.trainable_variables``, then the weights of its frozen layers that are
    trainable when unfrozen (not the non-trainable state such as batch statistics), in
    a fixed order. Uses the private ``_flatten_layers`` / ``_trainable_variables``; a
    Keras without them gives the trainable variables only."""
    found = list(model.trainable_variables)
    seen = {id(v) for v in found}
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is None:
        return found
    for layer in flatten(include_self=True, recursive=True):
        for variable in getattr(layer, "_trainable_variables", ()):
            if id(variable) not in seen:
                seen.add(id(variable))
                found.append(variable)
    return found


def summary_writer_handle(writer: tf.summary.SummaryWriter) -> tf.Tensor:
    """The resource tensor of a writer from ``tf.summary.create_file_writer``.

    Reads TensorFlow's private ``_ResourceSummaryWriter._resource``; raises RuntimeError
    naming the TensorFlow version when it is missing.
    """
    handle = getattr(writer, "_resource", None)
    if handle is None:
        raise RuntimeError(
            f"{type(writer).__name__} has no _resource: this TensorFlow version "
            f"({tf.__version__}) changed its summary writers; use TensorFlow 2.21.")
    return handle


class _PerThreadLosses:
    """A layer's list of losses added in its forward pass (``add_loss``, activity
    regularizers), one list per thread: the list operations Keras' ``Layer`` uses
    (extend, append, clear, slicing, iteration) on the calling thread's own list."""

    def __init__(self):
        self._local = threading.local()

    def _items(self) -> list:
        items = getattr(self._local, "items", None)
        if items is None:
            items = self._local.items = []
        return items

    def extend(self, values) -> None:
        self._items().extend(values)

    def append(self, value) -> None:
        self._items().append(value)

    def clear(self) -> None:
        self._items().clear()

    def __getitem__(self, index):
        return self._items()[index]

    def __iter__(self):
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())


def losses_per_replica(model: keras.Model) -> None:
    """Keeps each layer's forward-pass losses per thread, so per replica.

    Keras keeps the losses a call adds in the private ``Layer._losses``, one list per
    layer, cleared when an outermost call starts. MirroredStrategy runs its replicas in
    threads that take turns at every synchronization point: with a synchronized batch
    normalization inside the model, replica 1's forward pass cleared and refilled the
    list while replica 0 waited at the normalization's all-reduce, and replica 0 then
    read replica 1's losses (never differentiating its own). Idempotent; a Keras without
    ``_flatten_layers`` / ``_losses`` is left as it is.
    """
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is None:
        return
    for layer in flatten(include_self=True, recursive=True):
        current = getattr(layer, "_losses", None)
        if isinstance(current, list):
            replacement = _PerThreadLosses()
            replacement.extend(current)
            object.__setattr__(layer, "_losses", replacement)


def _keyed_drawing(draw: Callable) -> Callable:
    """Keras' ``draw_seed`` (``draw``), then the key of :func:`seed_key` folded in."""

    def draw_seed(seed):
        states = getattr(_SEED_KEY, "states", None)
        if states is not None:
            generator = keras_seed_generator.global_seed_generator() if seed is None else seed
            if isinstance(generator, keras.random.SeedGenerator) and id(generator) not in states:
                states[id(generator)] = (generator.state, tf.identity(generator.state.value))
        drawn = draw(seed)
        parts = getattr(_SEED_KEY, "parts", ())
        if not parts:
            return drawn
        if drawn.dtype != tf.int32:  # as Keras' _cast_seed: XLA's stateless ops need int32
            drawn = tf.cast(tf.math.floormod(drawn, tf.int32.max - 1), tf.int32)
        for part in parts:
            drawn = tf.random.experimental.stateless_fold_in(
                drawn, tf.cast(part, tf.int32), alg="philox")
        return drawn

    draw_seed.keras_draw_seed = draw
    return draw_seed


def keyed_seed_drawing() -> None:
    """Makes Keras' random ops read :func:`seed_key` and draw with philox, sliced by
    rows inside a ``draw_rows`` block (:data:`trainer.runtime.pinned_draws.PINNED_TF`;
    idempotent); raises RuntimeError naming the Keras version when its TensorFlow
    backend no longer draws seeds through the private ``draw_seed`` of
    :data:`SEED_DRAWING_MODULES`."""
    for module in SEED_DRAWING_MODULES:
        draw = getattr(module, "draw_seed", None)
        if draw is None:
            raise RuntimeError(
                f"{module.__name__} has no draw_seed: this Keras version ({keras.__version__}) "
                f"changed how random ops draw seeds; use a Keras version from 3.10 to 3.15.")
        if not hasattr(draw, "keras_draw_seed"):
            module.draw_seed = _keyed_drawing(draw)
        if getattr(module, "tf", None) is tf:
            module.tf = pinned_draws.PINNED_TF


@contextlib.contextmanager
def seed_key(*parts) -> Iterator[None]:
    """Inside, on this thread, every seed a Keras random op draws (from a
    ``SeedGenerator``, an int or the global generator) has ``parts`` (integer scalars,
    tensors or ints) folded in, after those of the enclosing blocks. Trace time: the
    fold is part of the traced graph."""
    keyed_seed_drawing()
    before = getattr(_SEED_KEY, "parts", ())
    _SEED_KEY.parts = (*before, *parts)
    try:
        yield
    finally:
        _SEED_KEY.parts = before


@contextlib.contextmanager
def global_seed_generator(generator: keras.random.SeedGenerator) -> Iterator[None]:
    """Inside, on this thread, Keras' random ops without a seed draw from ``generator``
    (Keras' global ``SeedGenerator``); the previous global one again afterwards. Raises
    RuntimeError naming the Keras version when Keras no longer keeps its global
    generator in the private ``GLOBAL_SEED_GENERATOR`` attribute."""
    name = getattr(keras_seed_generator, "GLOBAL_SEED_GENERATOR", None)
    if name is None or not hasattr(keras_seed_generator, "global_seed_generator"):
        raise RuntimeError(
            f"keras.src.random.seed_generator has no GLOBAL_SEED_GENERATOR: this Keras "
            f"version ({keras.__version__}) changed where unseeded random ops draw from; "
            f"use a Keras version from 3.10 to 3.15.")
    before = global_state.get_global_attribute(name)
    global_state.set_global_attribute(name, generator)
    try:
        yield
    finally:
        global_state.set_global_attribute(name, before)


@contextlib.contextmanager
def rewindable_seeds() -> Iterator[Callable[[], None]]:
    """Inside, on this thread, every ``SeedGenerator`` a Keras random op draws from (Keras'
    global one for an op without a seed) is recorded with its state before its first
    draw; the function yielded sets each back to that state (assign ops, trace time): a
    step traced again on the same copy of the state (manual data parallelism's device
    slices) draws the same seeds again."""
    keyed_seed_drawing()
    before = getattr(_SEED_KEY, "states", None)
    states = _SEED_KEY.states = {}

    def rewind() -> None:
        for variable, value in states.values():
            variable.assign(value)

    try:
        yield rewind
    finally:
        _SEED_KEY.states = before
