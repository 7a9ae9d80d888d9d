"""TensorFlow's stateless draws as Keras' random modules see them: philox, sliced by rows.

:data:`PINNED_TF` is a view of TensorFlow (public names only) that
:func:`trainer.runtime.keras_compat.keyed_seed_drawing` gives Keras' random modules as
their module global ``tf``: its stateless uniform, normal and truncated-normal draws and
its stateless dropout default to the philox algorithm (why: the docstring of
:mod:`trainer.runtime.keras_compat`). Inside a :func:`draw_rows` block the same view
draws a uniform, normal or truncated-normal tensor, or a dropout mask, whose leading
dimension is the block's rows at the block's total rows and keeps its rows: a replica's
slice of one global draw (``distribute.random_draws="global"``,
:func:`trainer.step.random_streams.keyed`). Trace time: the draws are graph ops.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import tensorflow as tf

_ROWS = threading.local()  # per replica thread: the (start, size, total) rows of draw_rows


class _PinnedDraws:
    """A module (``tf``, ``tf.random``, ``tf.nn``) as Keras' random modules see it:
    its attributes, but those of ``replaced`` (pinned draws, pinned sub-modules)."""

    def __init__(self, module: Any, replaced: dict[str, Any]):
        self._module, self._replaced = module, replaced

    def __getattr__(self, name: str) -> Any:
        return self._replaced[name] if name in self._replaced else getattr(self._module, name)


def _in_rows(draw: Callable[[Any], tf.Tensor], shape: Any) -> tf.Tensor:
    """``draw(shape)``; inside :func:`draw_rows`, when ``shape`` leads with the block's
    rows (known at trace time, else decided in the graph): ``draw`` at the block's total
    rows, then the block's rows of it."""
    rows = getattr(_ROWS, "rows", None)
    given = tf.convert_to_tensor(shape) if rows is not None else None
    if given is None or given.shape.rank != 1 or given.shape[0] == 0:
        return draw(shape)
    dims = tf.cast(given, tf.int32)
    start, size, total = (tf.cast(v, tf.int32) if tf.is_tensor(v) else v for v in rows)

    def sliced():
        return draw(tf.concat([tf.reshape(total, [1]), dims[1:]], 0))[start:start + size]

    leading = tf.get_static_value(given, partial=True)
    leading, wanted = (None if leading is None else leading[0]), tf.get_static_value(size)
    if leading is not None and wanted is not None:
        return sliced() if int(leading) == int(wanted) else draw(shape)
    return tf.cond(tf.equal(dims[0], size), sliced, lambda: draw(shape))


def _philox_default(draw: Callable, keyword: str) -> Callable:
    def pinned(shape, *args, **kwargs):
        kwargs.setdefault(keyword, "philox")
        return _in_rows(lambda s: draw(s, *args, **kwargs), shape)

    return pinned


def _pinned_dropout(x, rate, seed, rng_alg="philox", noise_shape=None, name=None):
    """``tf.nn.experimental.stateless_dropout`` drawing with philox; inside
    :func:`draw_rows` its mask is a uniform draw of :func:`_in_rows` (what TensorFlow's
    dropout computes: ``x / (1 - rate)`` where the draw is ``>= rate``, else 0)."""
    if getattr(_ROWS, "rows", None) is None:
        return tf.nn.experimental.stateless_dropout(x, rate, noise_shape=noise_shape,
                                                    seed=seed, rng_alg=rng_alg, name=name)
    x = tf.convert_to_tensor(x)
    noise = _in_rows(lambda s: tf.random.stateless_uniform(s, seed, dtype=x.dtype, alg=rng_alg),
                     tf.shape(x) if noise_shape is None else noise_shape)
    rate = tf.cast(rate, x.dtype)
    return tf.where(noise >= rate, x * (1 / (1 - rate)), tf.zeros([], x.dtype))


#: TensorFlow as Keras' random modules see it (see the module docstring).
PINNED_TF = _PinnedDraws(tf, {
    "random": _PinnedDraws(tf.random, {
        name: _philox_default(getattr(tf.random, name), "alg")
        for name in ("stateless_uniform", "stateless_normal", "stateless_truncated_normal")}),
    "nn": _PinnedDraws(tf.nn, {"experimental": _PinnedDraws(tf.nn.experimental, {
        "stateless_dropout": _pinned_dropout})}),
})


@contextlib.contextmanager
def draw_rows(start: Any, size: Any, total: Any) -> Iterator[None]:
    """Inside, on this thread, a Keras uniform, normal or truncated-normal draw, or dropout
    mask, whose leading dimension is ``size`` is drawn with ``total`` rows and rows
    ``[start, start + size)`` of it are kept: a replica's ``size`` rows of a batch of
    ``total`` draw its rows of what one replica draws for the whole batch, with the same
    seed. Other draws are drawn whole. ``start``, ``size``, ``total``: ints or integer
    scalars; the innermost block applies. Trace time: the slicing is part of the traced
    graph. Keras draws through :data:`PINNED_TF` once
    :func:`trainer.runtime.keras_compat.keyed_seed_drawing` ran (every
    ``keras_compat.seed_key`` block runs it)."""
    before = getattr(_ROWS, "rows", None)
    _ROWS.rows = (start, size, total)
    try:
        yield
    finally:
        _ROWS.rows = before
