"""Where the user's data meets the user's model: checks on the first batch, and the
translation of the runtime errors that cannot be checked ahead.

:func:`check_features` compares a dataset's feature spec with the inputs a model
declares (``keras.Input``: Sequential and functional models) before anything is traced,
so a wrong shape or dtype is one message naming the hooks, not a Keras traceback from
inside the traced step. :func:`runtime_input_error` turns an ``InvalidArgumentError``
raised by a compiled loop (a label outside the classes, a shape that only shows at
run time) into an :class:`trainer.errors.InputError` naming the step and the hooks.

Both run on the host (cross-replica context).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from trainer.errors import InputError


def _model_inputs(model: keras.Model) -> list | None:
    """The model's declared inputs (KerasTensors), or None when it declares none
    (a subclassed model, or one built by calling it)."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    return list(inputs) if inputs else None


def _describe(shape: Any, dtype: Any) -> str:
    dims = ", ".join("None" if d is None else str(d) for d in tuple(shape))
    return f"shape ({dims}) {tf.as_dtype(dtype).name}"


def _dtype_fits(data: tf.DType, wanted: tf.DType) -> bool:
    """False when the model would reject or silently mangle ``data``: a string for a
    number (or the reverse), or floats fed to an integer input (truncated)."""
    if data.is_floating and wanted.is_integer:
        return False
    return (data == tf.string) == (wanted == tf.string)


def check_features(features: Any, model: keras.Model, what: str) -> None:
    """Raises :class:`InputError` when ``features`` (a structure of ``TensorSpec`` with
    the per-replica batch as first dimension) cannot feed ``model``'s declared inputs.

    Checked: the number of input tensors, each shape past the batch dimension (``None``
    matches anything) and the dtype kind (see :func:`_dtype_fits`). Nothing is checked
    when the model declares no inputs or the features are a dict (matched by name at
    call time). ``what`` names the dataset hook (``build_train_dataset``...).
    """
    inputs = _model_inputs(model)
    if inputs is None or isinstance(features, dict):
        return
    specs = tf.nest.flatten(features)
    if len(specs) != len(inputs):
        raise InputError(
            f"{what} yields {len(specs)} feature tensor(s) but build_model's model has "
            f"{len(inputs)} input(s); make the batch (features, labels) match the model's "
            f"keras.Input(s).")
    for i, (spec, tensor) in enumerate(zip(specs, inputs)):
        wanted_shape = tuple(tensor.shape)
        data_shape = tuple(spec.shape)
        name = getattr(tensor, "name", None) or f"input {i}"
        shape_ok = len(data_shape) == len(wanted_shape) and all(
            a is None or b is None or a == b
            for a, b in zip(data_shape[1:], wanted_shape[1:]))
        if not shape_ok or not _dtype_fits(tf.as_dtype(spec.dtype), tf.as_dtype(tensor.dtype)):
            raise InputError(
                f"{what} yields features of {_describe(data_shape, spec.dtype)} but "
                f"build_model's model input '{name}' expects "
                f"{_describe(wanted_shape, tensor.dtype)} (first dimension: the batch). "
                f"Fix the features in {what} (reshape/cast) or the keras.Input in "
                f"build_model.")


def _tf_message(error: tf.errors.OpError) -> str:
    """The one informative line of a TensorFlow runtime error (no node stacks)."""
    skip = ("Graph execution error", "Detected at node", "File ", "[[", "Traceback",
            "Stack trace", "defined at")
    lines = [line.strip() for line in str(error.message).splitlines()]
    useful = [line for line in lines if line and not line.startswith(skip)
              and not line.startswith("Op:")]
    text = useful[-1] if useful else lines[0] if lines else type(error).__name__
    return text.split("\t [[")[0].split(" [Op:")[0].strip()


def runtime_input_error(error: tf.errors.OpError, what: str, step: int) -> InputError:
    """An :class:`InputError` for a runtime error of a compiled loop at ``step``.

    ``what`` is the dataset hook that fed the loop. The message keeps TensorFlow's one
    informative line and names the hooks to fix; a label out of range gets the rule.
    """
    message = _tf_message(error)
    if "label" in message.lower():
        hint = (f"labels must lie in [0, number of classes): fix the labels in {what}, or "
                f"the output size of build_model's last layer")
    else:
        hint = (f"the batches of {what} do not fit build_model's model or compute_loss; "
                f"fix the hook that produces the wrong value")
    return InputError(f"step {step}: {message}. {hint} (add --traceback for TensorFlow's "
                      f"trace).")
