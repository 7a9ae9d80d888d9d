"""Where the user's data meets the user's model: checks on the first batch, and the
translation of the runtime errors that cannot be checked ahead.

:func:`check_features` compares a dataset's feature spec with the inputs a model
declares (``keras.Input``: Sequential and functional models) before anything is traced,
so a wrong shape or dtype is one message naming the hooks, not a Keras traceback from
inside the traced step. :func:`runtime_error` turns an ``InvalidArgumentError``
raised by a compiled loop (a label outside the classes, a shape that only shows at
run time) into an :class:`trainer.errors.InputError` naming the step and the hook when
the data is recognisably the cause, else a :class:`trainer.errors.TensorFlowError`.

Both run on the host (cross-replica context).
"""

from __future__ import annotations

import re
from typing import Any

import keras
import tensorflow as tf

from trainer.data import describe_shape
from trainer.errors import InputError, TensorFlowError, UserError, user_error_in


def _model_inputs(model: keras.Model) -> list | None:
    """The model's declared inputs (KerasTensors), or None when it declares none
    (a subclassed model, or one built by calling it)."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    return list(inputs) if inputs else None


def _describe(shape: Any, dtype: Any) -> str:
    return f"shape {describe_shape(shape, dtype)}"


def _dtype_fits(data: tf.DType, wanted: tf.DType) -> bool:
    """False when the model would reject or silently mangle ``data``: a string for a
    number (or the reverse), or floats fed to an integer input (truncated)."""
    if data.is_floating and wanted.is_integer:
        return False
    return (data == tf.string) == (wanted == tf.string)


def _shapes_fit(data: tuple, wanted: tuple) -> bool:
    """Shapes past the batch dimension agree (``None`` matches anything). A trailing
    dimension of size 1 may be missing on either side: Keras adds or drops it itself
    (e.g. images ``(b, 28, 28)`` for ``keras.Input((28, 28, 1))``)."""
    if len(data) == len(wanted) - 1 and wanted[-1] == 1:
        wanted = wanted[:-1]
    elif len(data) == len(wanted) + 1 and data[-1] == 1:
        data = data[:-1]
    return len(data) == len(wanted) and all(
        a is None or b is None or a == b for a, b in zip(data[1:], wanted[1:]))


def check_features(features: Any, model: keras.Model, what: str,
                   custom_step: bool = False) -> None:
    """Raises :class:`InputError` when ``features`` (a structure of ``TensorSpec`` with
    the per-replica batch as first dimension) cannot feed ``model``'s declared inputs.

    Checked: the number of input tensors, each shape past the batch dimension
    (:func:`_shapes_fit`) and the dtype kind (see :func:`_dtype_fits`). Nothing is checked
    when the model declares no inputs or the features are a dict (matched by name at
    call time). ``what`` names the dataset hook (``build_train_dataset``...). Ragged
    features for dense inputs are refused unless ``custom_step`` (the user's own step,
    which may make them dense itself).
    """
    inputs = _model_inputs(model)
    if inputs is None or isinstance(features, dict):
        return
    specs = tf.nest.flatten(features, expand_composites=False)
    ragged = [i for i, spec in enumerate(specs) if isinstance(spec, tf.RaggedTensorSpec)]
    if ragged and not custom_step and not any(getattr(t, "ragged", False) for t in inputs):
        raise InputError(
            f"{what} yields ragged features (tf.RaggedTensor, feature #{ragged[0]}) but "
            f"build_model's model takes dense inputs (Keras layers take dense tensors); "
            f"pad them in the input pipeline: .padded_batch(batch, padded_shapes=...) "
            f"instead of .batch(batch), or .map(lambda x, y: (x.to_tensor(), y)).")
    if len(specs) != len(inputs):
        raise InputError(
            f"{what} yields {len(specs)} feature tensor(s) but build_model's model has "
            f"{len(inputs)} input(s); make the batch (features, labels) match the model's "
            f"keras.Input(s).")
    for i, (spec, tensor) in enumerate(zip(specs, inputs)):
        wanted_shape = tuple(tensor.shape)
        data_shape = tuple(spec.shape)
        name = str(getattr(tensor, "name", "") or "")
        name = f"'{name}'" if name and not name.startswith("keras_tensor") else f"#{i}"
        shape_ok = _shapes_fit(data_shape, wanted_shape)
        if not shape_ok or not _dtype_fits(tf.as_dtype(spec.dtype), tf.as_dtype(tensor.dtype)):
            raise InputError(
                f"{what} yields features of {_describe(data_shape, spec.dtype)} but "
                f"build_model's model input {name} expects "
                f"{_describe(wanted_shape, tensor.dtype)} (first dimension: the batch). "
                f"Fix the features in {what} (reshape/cast) or the keras.Input in "
                f"build_model.")


def _tf_message(error: tf.errors.OpError) -> str:
    """The one informative line of a TensorFlow runtime error (no node stacks)."""
    skip = ("Graph execution error", "Detected at node", "File ", "[[", "Traceback",
            "Stack trace", "defined at", "The error could be from a previous operation")
    lines = [line.strip() for line in str(error.message).splitlines()]
    lines = [line for line in lines if not re.match(r"\d+ derived errors ignored", line)]
    useful = [line for line in lines if line and not line.startswith(skip)
              and not line.startswith("Op:")]
    text = useful[-1] if useful else lines[0] if lines else type(error).__name__
    text = text.split("\t [[")[0].split(" [Op:")[0].strip()
    return re.sub(r"\s+Label values:.*", "", text).rstrip(".")


_LABEL_OUT_OF_RANGE = re.compile(r"label value of -?\d+ which is outside the valid range",
                                 re.IGNORECASE)
_INDEX_OUT_OF_RANGE = re.compile(r"indices\[[\d,]+\] = -?\d+ is not in \[0, \d+\)")
_COLLECTIVE = ("collective", "derived errors ignored", "error could be from a previous "
               "operation")


def runtime_error(error: tf.errors.OpError, what: str, where: str) -> UserError:
    """The user-facing error for a runtime error of a compiled loop fed by ``what``.

    ``where`` says when (``"step 7"``, ``"steps 1-50"``: one loop call runs many).
    Only what is recognised as the data's is an :class:`InputError` naming the hook: a
    label outside the classes, an index outside an embedding's table. Anything else is a
    :class:`TensorFlowError`: TensorFlow's one informative line, what to try, and
    ``--traceback`` (a failed collective says so: replicas that disagreed on a shape, or
    a peer that failed).
    """
    message = _tf_message(error)
    trace = "(add --traceback for TensorFlow's trace)"
    if _LABEL_OUT_OF_RANGE.search(message):
        return InputError(
            f"{where}: {message}. labels must lie in [0, number of classes): fix the labels "
            f"in {what}, or the output size of build_model's last layer {trace}.")
    if _INDEX_OUT_OF_RANGE.search(message):
        return InputError(
            f"{where}: {message}. An index (a token id) lies outside a table of "
            f"build_model's model (an Embedding's input_dim, a gather): fix the ids in "
            f"{what} or make the table larger {trace}.")
    full = str(error.message).lower()
    if any(marker in full for marker in _COLLECTIVE):
        return TensorFlowError(
            f"{where}: a collective across replicas failed: {message}. The replicas "
            f"disagreed on a shape or a peer failed; this is not traced to your hooks. To "
            f"narrow it down run with --config.train.steps_per_loop=1, or on one device "
            f"(--config.distribute.strategy=one_device) {trace}.")
    return TensorFlowError(
        f"{where}: TensorFlow stopped the compiled loop fed by {what}: {message}. This is "
        f"not traced to your hooks; to narrow it down run one step per call "
        f"(--config.train.steps_per_loop=1) on one device "
        f"(--config.distribute.strategy=one_device) {trace}.")


def _is_empty(dataset) -> bool:
    try:
        next(iter(dataset))
    except (tf.errors.OutOfRangeError, StopIteration):
        return True
    return False


def empty_dataset_message(what: str, per_replica: int) -> str:
    """The message for a dataset that yields no batch at all (also when repeated)."""
    return (f"{what} yields no batch at all: the dataset is empty, or has fewer examples "
            f"than one per-replica batch ({per_replica}) and drops the remainder "
            f"(.repeat() cannot help an empty dataset). Check the data source (files, "
            f"filters), or call .repeat() BEFORE .batch(..., drop_remainder=True).")


def loop_error(error: Exception, what: str, where: str) -> UserError | None:
    """The user error behind an exception of a compiled loop fed by ``what``, or None
    (a bug: keep the traceback). A :class:`UserError` raised while tracing (AutoGraph
    wraps it) comes back as itself; an ``InvalidArgumentError`` at run time becomes an
    :class:`InputError` or a :class:`TensorFlowError` (:func:`runtime_error`)."""
    found = user_error_in(error)
    if found is None and isinstance(error, tf.errors.InvalidArgumentError):
        found = runtime_error(error, what, where)
    return found


def train_loop_error(error: Exception, trainer: Any, dataset: Any,
                     num_steps: int) -> UserError | None:
    """:func:`loop_error` for a train loop call of ``num_steps`` from ``trainer.step``,
    plus the exhausted dataset (``OutOfRangeError``).

    When no step was done yet (``trainer.step == 0``), a new iterator of ``dataset``
    (the distributed train dataset) is asked for one batch, at error time only: none
    means the dataset is empty, whatever ``.repeat()`` it has. (The step counter cannot
    tell: TensorFlow may run its update before the failing read.)
    """
    step = trainer.step
    steps = f"step {step + 1}" if num_steps == 1 else f"steps {step + 1}-{step + num_steps}"
    if not isinstance(error, tf.errors.OutOfRangeError):
        return loop_error(error, "build_train_dataset", steps)
    if step == 0 and dataset is not None and _is_empty(dataset):
        return InputError(empty_dataset_message("build_train_dataset",
                                                trainer.batch.per_replica))
    at = f"at {steps}" if num_steps == 1 else f"during {steps}"
    return InputError(f"build_train_dataset ran out of data {at} of "
                      f"{trainer.config.train.steps}; end it with .repeat() so training can "
                      f"run for train.steps.")
