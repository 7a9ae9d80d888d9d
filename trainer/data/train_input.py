"""A Trainer's train iterator across its ``fit()`` calls: :class:`TrainInput`.

A ``fit()`` starts with an iterator positioned at the Trainer's step. The iterator the
last ``fit()`` kept is continued when it is positioned there and was kept in an equal
context (:func:`continuation_context`: the input layout a restored checkpoint asked to
continue and the config without ``train.steps``); otherwise the dataset is built
positioned there, which skips the batches already consumed: the input pipeline runs
again for every one of them (its decoding and augmentation too). At its end a
``fit()`` keeps the iterator (returned) or releases it (raised: its position is
unknown). A kept iterator is never destroyed on the Trainer's thread (its destruction
waits for tf.data's autotune thread: seconds to a minute):
:class:`trainer.data.iterator_release.KeptObjects` hands it to a background thread when it
is replaced or released, when the Trainer is collected, or drops it at exit before
TensorFlow's teardown.

Host only (cross-replica context).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from trainer.data.iterator_release import KeptObjects, release


def continuation_context(config: Any, resumed: Any) -> tuple:
    """What a kept train iterator must have been kept with to be continued, besides its
    position: the input layout of ``resumed`` (the restored checkpoint's record
    (:class:`trainer.data.resume.Resumed`), or None) and ``config`` (a ConfigDict) without
    ``train.steps`` (a notebook raises it to train on), as JSON (compared as text)."""
    values = config.to_dict()
    values["train"].pop("steps", None)
    layout = resumed.layout if resumed is not None else None
    return layout, json.dumps(values, sort_keys=True, default=repr)


class TrainInput:
    """The train iterator of the current ``fit()`` (``iterator``, from ``dataset``) and
    the one kept between two ``fit()`` calls.

    Args:
      build: ``step -> distributed dataset`` whose first batch is the one of ``step``
        (built from the user's hook, skipping the consumed batches); called by
        :meth:`start` when no kept iterator can continue.
      context: ``() -> `` the current :func:`continuation_context`.
    """

    def __init__(self, build: Callable[[int], Any], context: Callable[[], Any]):
        self._build, self._context = build, context
        self.iterator: Any = None  # the current fit()'s distributed iterator
        self.dataset: Any = None  # the distributed dataset it iterates
        self._position = 0  # the step of the iterator's next batch
        self._kept = KeptObjects()  # [iterator, dataset] between fit() calls

    def start(self, step: int) -> None:
        """Sets ``iterator`` (and ``dataset``) for a ``fit()`` starting at ``step``: the
        kept one when it is positioned at ``step`` and was kept in the current context,
        else a new one from ``build(step)`` (a kept one is released)."""
        self._position = step
        kept = self._kept.take((step, self._context()))
        if kept is not None:
            self.iterator, self.dataset = kept
            return
        self.dataset = self._build(step)
        self.iterator = iter(self.dataset)

    def advance(self, steps: int) -> None:
        """The iterator gave the batches of ``steps`` steps (a loop call returned)."""
        self._position += steps

    def end(self, keep: bool) -> None:
        """Drops the references to ``iterator`` and ``dataset``: ``keep`` keeps them for a
        ``fit()`` starting at their position in the current context; otherwise they are
        released with whatever was kept."""
        held = [x for x in (self.iterator, self.dataset) if x is not None]
        self.iterator = self.dataset = None
        if keep and held:  # start() sets both
            self._kept.keep(held, (self._position, self._context()))
            return
        self._kept.release()
        release(held)
