"""How framework and user code meet ``tf.function`` tracing.

Framework code that runs while a step is traced is marked :data:`no_autograph` (it
branches on tensors with ``tf.cond`` itself), so a run does not pay AutoGraph's
conversion of every framework function at its first step. A hook the user overrides
(``train_step``, ``eval_step``, ``compute_loss``, ``update_metrics``) is still converted
(:func:`user_hook`): Python ``if``/``for`` on tensors works there as in any
``tf.function``.
"""

from __future__ import annotations

from typing import Callable

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
