"""Every call of a Trainer subclass's hooks goes through here: what a hook returns is
checked, and what it raises is named.

:class:`Hooks` (``trainer.hooks``) calls the hooks of one Trainer. A hook that returns
the wrong kind of value raises :class:`trainer.errors.HookError` whose one line says
which hook of which class returned what, what it must return, and where the hook is
defined, e.g.::

    MyTrainer.build_callbacks returned a Callback (Stopper); it must return a list of
    trainer.Callback (wrap it: [Stopper()]). [my_trainer.py:42]

(:class:`trainer.errors.InputError`, a HookError, when the loss does not fit the batch.)
An exception raised INSIDE a hook (a Keras shape error, a structure mismatch, a typo in
the user's code) becomes a HookError naming the hook, with the original message on the
same line and the user's line where it was raised; ``--traceback`` shows the whole
trace. A :class:`trainer.errors.UserError` passes unchanged (on one line when Keras
wrapped it in lines of its own), and so does an exception whose innermost frame is in
this package (a bug of tf-trainer keeps its traceback).

Checks run at every call; for the hooks run in replica context (``compute_loss``,
``train_step``, ``eval_step``, ``update_metrics``) a call happens only while the step is
traced, so the checks cost nothing per step.

Contexts: ``build_*`` on the host; the traced hooks in replica context while tracing.
"""

from __future__ import annotations

import contextlib
import os
import re
import traceback
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import keras
import numpy as np
import tensorflow as tf

from trainer.callbacks import Callback
from trainer.checks import held_layers
from trainer.errors import HookError, InputError, UserError
from trainer.runtime import seeds
from trainer.runtime.tracing import user_hook

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Keras bolds parts of its messages
_GRAPH_NODE = re.compile(r" for '\{\{node [^']*'")  # TF's graph node in shape errors
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

#: What each hook must return (the end of the "it must return ..." sentence).
EXPECTED = {
    "build_model": "a keras.Model (e.g. keras.Sequential([keras.Input(shape), ...]))",
    "build_optimizer": "a keras optimizer (a keras.optimizers.Optimizer instance, e.g. "
                       "keras.optimizers.Adam(1e-3))",
    "build_metrics": "a dict of keras.metrics.Metric by name (e.g. {'accuracy': "
                     "keras.metrics.SparseCategoricalAccuracy()}; {} for none)",
    "build_callbacks": "a list of trainer.Callback ([] for none)",
    "build_train_dataset": "a tf.data.Dataset of per-replica batches",
    "build_eval_dataset": "a tf.data.Dataset of per-replica batches (or do not override "
                          "build_eval_dataset to train without evaluation)",
    "compute_loss": "the per-example loss: a float tensor of shape [per-replica batch]",
    "train_step": "a dict of scalar tensors with a 'loss' entry (e.g. {'loss': loss})",
    "eval_step": "a dict with a 'loss' entry, the per-example loss (e.g. {'loss': "
                 "per_example_loss})",
    "update_metrics": "None (update the metrics in place with metric.update_state(...))",
}

#: What a default hook does, for errors raised inside it (it calls the user's objects).
_DEFAULT_DOES = {
    "train_step": "build_model's model on a batch of build_train_dataset",
    "eval_step": "build_model's model on a batch of build_eval_dataset",
    "update_metrics": "metric.update_state(labels, outputs) for each metric of "
                      "build_metrics",
}


# TensorFlow's words when a replica synchronises inside a tf.cond or a loop of a replica
# step, and what a user does about it.
_MERGE_CALL_IN_CONTROL_FLOW = "`merge_call` called while defining a new graph"
_SYNC_IN_CONTROL_FLOW = (
    "updates, inside a tf.cond or a loop, a variable that every replica must agree on "
    "(a non-trainable weight its forward pass updates, which the framework averages over "
    "the replicas at each assign, or an optimizer): TensorFlow cannot synchronise "
    "replicas there. Compute the new value inside the control flow (tf.where, or a "
    "tf.cond that returns it) and assign it once outside; or create the weight with "
    "synchronization='on_read', aggregation='mean' to keep one copy per replica.")


def describe(value: Any) -> str:
    """A short description of ``value`` for a message: ``a function 'make'``, ``a dict
    with keys ['a']``, ``a tensor of shape (32, 3) float32``, ``None``..."""
    if value is None:
        return "None"
    if isinstance(value, type):
        return f"the class {value.__name__} (not an instance)"
    if tf.is_tensor(value) or isinstance(value, np.ndarray):
        dtype = getattr(value.dtype, "name", value.dtype)
        return f"a tensor of shape {tuple(value.shape)} {dtype}"
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(map(str, value))}"
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {len(value)} ({', '.join(kinds) or 'empty'})"
    if isinstance(value, Callback):
        return f"a Callback ({type(value).__name__})"
    if callable(value) and hasattr(value, "__name__"):
        return f"a function '{value.__name__}'"
    return f"a {type(value).__name__}"


# ------------------------------------------------------------------- the checks
# Each returns None when the value is right, else a hint ("" when there is none).
def _model(value: Any, args: tuple) -> str | None:
    if isinstance(value, keras.Model):
        return None
    if isinstance(value, keras.layers.Layer):
        return " (wrap the layer: keras.Sequential([keras.Input(shape), layer]))"
    if callable(value) and not isinstance(value, type):
        return " (call the function that builds the model and return its result)"
    return ""


def _optimizer(value: Any, args: tuple) -> str | None:
    if isinstance(value, keras.optimizers.Optimizer):
        return None
    if isinstance(value, str):
        return f" (keras.optimizers.get({value!r}) makes one)"
    return " (instantiate it)" if isinstance(value, type) else ""


def _metrics(value: Any, args: tuple) -> str | None:
    if isinstance(value, Mapping):
        wrong = {k: v for k, v in value.items() if not isinstance(v, keras.metrics.Metric)}
        if not wrong:
            return None
        name, metric = next(iter(wrong.items()))
        if isinstance(metric, type):
            fix = "instantiate it"
        elif callable(metric):
            fix = (f"wrap a function: keras.metrics.MeanMetricWrapper("
                   f"{getattr(metric, '__name__', 'fn')}, name={name!r})")
        else:
            fix = "use a keras.metrics.Metric"
        return f" ({name!r} is {describe(metric)}: {fix})"
    if isinstance(value, (list, tuple)):
        return " (name them: {'accuracy': metric, ...})"
    if isinstance(value, keras.metrics.Metric):
        return f" (name it: {{{value.name!r}: metric}})"
    return ""


def _callbacks(value: Any, args: tuple) -> str | None:
    if isinstance(value, (list, tuple)):
        wrong = [c for c in value if not isinstance(c, Callback)]
        if not wrong:
            return None
        keras_cb = (": subclass trainer.Callback, not keras.callbacks.Callback"
                    if isinstance(wrong[0], keras.callbacks.Callback) else "")
        return f" ({describe(wrong[0])} is not a trainer.Callback{keras_cb})"
    if isinstance(value, Callback):
        return f" (wrap it: [{type(value).__name__}()])"
    return ""


def _dataset(value: Any, args: tuple) -> str | None:
    if isinstance(value, tf.data.Dataset):
        return None
    if isinstance(value, (tuple, list, np.ndarray)) or tf.is_tensor(value):
        return (" (wrap the arrays: tf.data.Dataset.from_tensor_slices((x, y)).batch("
                "ctx.get_per_replica_batch_size(global_batch_size)))")
    if isinstance(value, tf.distribute.DistributedDataset):
        return " (return the tf.data.Dataset itself: the framework distributes it)"
    return ""


def _tensor_like(value: Any) -> bool:
    return tf.is_tensor(value) or isinstance(value, (np.ndarray, np.number, float, int))


def _loss(value: Any, args: tuple) -> str | None:
    if isinstance(value, Mapping):
        return " (return the loss tensor itself, not a dict)"
    if not _tensor_like(value):
        return ""
    dtype = tf.as_dtype(getattr(value, "dtype", tf.float32))
    if not dtype.is_floating:
        return f" (its dtype is {dtype.name}: tf.cast it to float32)"
    return None


def _step_outputs(value: Any, args: tuple, hook: str) -> str | None:
    if not isinstance(value, Mapping):
        return (" (return {'loss': loss})" if _tensor_like(value) else "")
    if "loss" not in value:
        return " (add the 'loss' entry)"
    wrong = [k for k, v in value.items() if not _tensor_like(v)]
    if wrong:
        return f" (its {wrong[0]!r} is {describe(value[wrong[0]])})"
    if hook == "train_step":
        unknown = [k for k, v in value.items() if not tf.TensorShape(
            getattr(v, "shape", ())).is_fully_defined()]
        if unknown:
            return (f" (its {unknown[0]!r} with shape {tuple(value[unknown[0]].shape)} is "
                    f"not fully known while tracing: return scalars, e.g. tf.reduce_mean "
                    f"of it)")
    return None


def _none(value: Any, args: tuple) -> str | None:
    return None if value is None else ""


_CHECKS: dict[str, Callable[[Any, tuple], str | None]] = {
    "build_model": _model, "build_optimizer": _optimizer, "build_metrics": _metrics,
    "build_callbacks": _callbacks, "build_train_dataset": _dataset,
    "build_eval_dataset": _dataset, "compute_loss": _loss,
    "train_step": lambda v, a: _step_outputs(v, a, "train_step"),
    "eval_step": lambda v, a: _step_outputs(v, a, "eval_step"), "update_metrics": _none,
}


def _check_loss_shape(owner: str, loss: Any, batch: Any, where: str) -> None:
    """The per-example loss is rank 1 and has the batch's length (InputError)."""
    loss = tf.convert_to_tensor(loss)
    expected = tf.nest.flatten(batch)[0].shape[:1] if batch is not None else None
    size = expected[0] if expected is not None and expected.rank else None
    wanted = f"shape [per-replica batch]{f' = [{size}]' if size is not None else ''}"
    if loss.shape.rank == 0:
        raise InputError(
            f"{owner}.compute_loss returned a scalar; it must return the PER-EXAMPLE loss, "
            f"{wanted} (e.g. keras.losses.sparse_categorical_crossentropy(labels, logits, "
            f"from_logits=True) without reducing): the framework averages by the GLOBAL "
            f"batch so every replica count trains the same.{where}")
    if loss.shape.rank != 1:
        raise InputError(
            f"{owner}.compute_loss returned shape {tuple(loss.shape)}; it must return the "
            f"per-example loss, {wanted}. Reduce the other axes yourself (e.g. "
            f"tf.reduce_mean(loss, axis=-1) over timesteps).{where}")
    if expected is not None and not loss.shape[:1].is_compatible_with(expected):
        raise InputError(
            f"{owner}.compute_loss returned {loss.shape[0]} losses for a batch of {size} "
            f"examples; it must return one loss per example, {wanted}.{where}")


# ------------------------------------------------------------------ locations
def _check_model_step(owner: str, model: keras.Model, where: str) -> None:
    """Raises HookError when ``model``'s class overrides Keras' ``train_step`` (the Keras
    guide "Customizing what happens in fit()"): the Trainer's loop never calls it."""
    step = getattr(type(model), "train_step", None)
    if step is None or step is getattr(keras.Model, "train_step", None):
        return
    raise HookError(
        f"{owner}.build_model returned a {type(model).__name__} whose train_step is "
        f"overridden: the Trainer never calls a model's train_step (its loop runs "
        f"{owner}.train_step on every replica), so that logic would be skipped. Move it "
        f"into {owner}.train_step(batch) and update with self.apply_gradients(tape, "
        f"per_example_loss), and drop the model's train_step.{where}")


def _source(fn: Callable | None) -> tuple[str, int] | None:
    """(file, first line) of ``fn``'s code, or None."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return (code.co_filename, code.co_firstlineno) if code is not None else None


def _location(fn: Callable | None, error: BaseException | None = None) -> str:
    """`` [file.py:LINE]``: where ``error`` was raised in ``fn``'s file (its innermost
    line there), else where ``fn`` is defined; "" when unknown."""
    source = _source(fn)
    if source is None:
        return ""
    path, line = source
    for tb_frame, tb_line in _frames(error):
        if tb_frame.f_code.co_filename == path:
            line = tb_line
    return f" [{os.path.basename(path)}:{line}]"


def _frames(error: BaseException | None) -> list:
    if error is None:
        return []
    return list(traceback.walk_tb(error.__traceback__))


def _raised_here(error: BaseException) -> bool:
    """True when ``error``'s innermost frame is in this package (a bug of tf-trainer)."""
    frames = _frames(error)
    return bool(frames) and os.path.abspath(
        frames[-1][0].f_code.co_filename).startswith(_PACKAGE_DIR + os.sep)


def one_line(error: BaseException) -> str:
    """``error``'s message on one line (Keras' multi-line messages condensed)."""
    text = _ANSI.sub("", str(getattr(error, "message", None) or error))
    text = _GRAPH_NODE.sub("", text)
    lines = [line.strip() for line in text.splitlines()]
    keep = [line for line in lines if line and not line.startswith(
        ("Arguments received by", "•", "Traceback", "File ", "[[", "Detected at node"))]
    joined = " ".join(keep).strip() or type(error).__name__
    return joined if len(joined) <= 600 else joined[:597] + "..."


# ----------------------------------------------------------------------- Hooks
class Hooks:
    """Calls the hooks of ``trainer`` with the checks of this module.

    Args:
      trainer: the Trainer (``overrides(hook)`` tells a user's hook from a default).
    """

    def __init__(self, trainer: Any):
        self._trainer = trainer
        self.owner = type(trainer).__name__

    def _user_fn(self, hook: str) -> Callable | None:
        """The user's override of ``hook`` (for locations), or None for a default."""
        return getattr(self._trainer, hook) if self._trainer.overrides(hook) else None

    @contextlib.contextmanager
    def _naming(self, hook: str) -> Iterator[None]:
        """Turns an exception raised inside ``hook`` into a HookError naming it."""
        try:
            yield
        except UserError as error:
            if "\n" in str(error):  # Keras wraps one raised in a layer's call in its own lines
                error.args = (one_line(error),)
            raise
        except NotImplementedError as error:
            if self._trainer.overrides(hook):
                raise HookError(f"{self.owner}.{hook} raised NotImplementedError: "
                                f"{one_line(error)}{_location(self._user_fn(hook), error)}"
                                ) from error
            raise HookError(f"{self.owner} does not override {hook}: {one_line(error)}"
                            ) from error
        except Exception as error:  # noqa: BLE001 - named below, or re-raised as a bug
            if _raised_here(error):
                raise
            if self._trainer.overrides(hook):
                subject = f"{self.owner}.{hook}"
                where = _location(self._user_fn(hook), error)
            else:
                subject = (f"{self.owner}.{hook} (the default: "
                           f"{_DEFAULT_DOES.get(hook, 'the framework')})")
                where = ""
            if _MERGE_CALL_IN_CONTROL_FLOW in str(error):
                raise HookError(f"{subject} {_SYNC_IN_CONTROL_FLOW}{where}") from error
            raise HookError(f"{subject} raised {type(error).__name__}: "
                            f"{one_line(error)}{where}") from error

    def check(self, hook: str, value: Any, args: tuple = ()) -> Any:
        """Raises HookError unless ``value`` is what ``hook`` must return; returns it."""
        hint = _CHECKS[hook](value, args)
        if hint is not None:
            raise HookError(f"{self.owner}.{hook} returned {describe(value)}; it must "
                            f"return {EXPECTED[hook]}{hint}."
                            f"{_location(self._user_fn(hook))}")
        if hook == "compute_loss":
            _check_loss_shape(self.owner, value, args[0] if args else None,
                              _location(self._user_fn(hook)))
        if hook == "build_model":
            _check_model_step(self.owner, value, _location(self._user_fn(hook)))
        if hook in ("build_model", "train_step", "eval_step"):  # a step builds a layer
            held_layers.check(self.owner, vars(self._trainer))
        return value

    def call(self, hook: str, *args: Any) -> Any:
        """Calls the host hook ``hook`` (``build_*``) and checks what it returns."""
        with self._naming(hook):
            value = getattr(self._trainer, hook)(*args)
        return self.check(hook, value, args)

    def dataset(self, hook: str) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
        """``ctx -> dataset`` calling ``hook`` (``build_train_dataset`` or
        ``build_eval_dataset``) with the checks, under seeds the same at every call
        (:func:`trainer.runtime.seeds.reseeded`: ``config.seed``)."""
        def build(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
            with seeds.reseeded(self._trainer.config.seed):
                return self.call(hook, ctx)

        return build

    def traced(self, hook: str, default: Callable) -> Callable:
        """The replica-context hook ``hook`` ready to trace (AutoGraph-converted when
        overridden, see :func:`trainer.runtime.tracing.user_hook`), with the checks.
        ``default`` is the framework's own function for it (``Trainer.<hook>``)."""
        fn = user_hook(getattr(self._trainer, hook), default)
        # compute_loss(batch, outputs): the batch gives the per-replica batch size.
        batch_arg = 0 if hook == "compute_loss" else None

        def checked(*args: Any, **kwargs: Any) -> Any:
            with self._naming(hook):
                value = fn(*args, **kwargs)
            if hook in ("train_step", "eval_step") and isinstance(value, Mapping):
                self.check(hook, value)
                return {k: tf.convert_to_tensor(v) for k, v in value.items()}
            return self.check(hook, value, (args[batch_arg],) if batch_arg is not None
                              and args else ())

        return checked
