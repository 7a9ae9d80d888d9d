"""How framework and user code meet ``tf.function`` tracing.

Framework code that runs while a step is traced is marked :data:`no_autograph` (it
branches on tensors with ``tf.cond`` itself), so a run does not pay AutoGraph's
conversion of every framework function at its first step. A hook the user overrides
(``train_step``, ``eval_step``, ``compute_loss``, ``update_metrics``) is still converted
(:func:`user_hook`): Python ``if``/``for`` on tensors works there as in any
``tf.function``.

A ``tf.function`` made per object (a bound method, a closure over one object's
variables) is made with :func:`per_object_function`: TensorFlow's frequent-retracing
warning otherwise counts the first traces of every object's function as retraces of
one function, and the fifth Trainer in a process (a notebook) is warned of retracing it
does not do.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import tensorflow as tf

no_autograph = tf.autograph.experimental.do_not_convert


def user_hook(method: Callable, default: Callable) -> Callable:
    """``method`` (a bound hook) ready to call while a step is traced.

    ``default`` is the framework's own function for that hook (e.g.
    ``Trainer.compute_loss``). An override is AutoGraph-converted (once per function;
    AutoGraph caches it); the framework's default is returned as is (it is
    ``no_autograph``).
    """
    func = getattr(method, "__func__", None)
    if func is None or func is default:
        return method
    converted = tf.autograph.to_graph(func)
    return lambda *args, **kwargs: converted(method.__self__, *args, **kwargs)


def per_object_function(fn: Callable | None = None, **options: Any) -> Any:
    """``tf.function(fn, **options)`` for a function made per object, whose traces
    TensorFlow's frequent-retracing warning counts apart from other objects' (it keys
    its counts by the Python code object; a ``functools.partial`` has none, so the
    function itself is the key). Usable as a decorator, with or without ``options``.
    Tracing and calling are unchanged."""
    if fn is None:
        return functools.partial(per_object_function, **options)
    keyed = functools.partial(fn)
    keyed.__name__ = fn.__name__  # the graph functions' names (e.g. __inference_train_N)
    return tf.function(keyed, **options)
