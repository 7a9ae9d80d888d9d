"""Which variables the traced train step updates, and when that set changes.

A traced step differentiates the model's trainable variables as they were when it was
traced. A layer frozen or unfrozen later (between two ``fit()`` calls, or by a callback
at a loop boundary) changes that set: :class:`TrainableWatch` tells the loop driver, which
then traces the step again, once. The optimizer already holds state for every weight of
a frozen layer (:func:`trainer.keras_compat.trainable_capable_variables`). Host only.
"""

from __future__ import annotations

import keras
from absl import logging


class TrainableWatch:
    """Remembers the trainable variables the step was last traced with."""

    def __init__(self):
        self._traced: tuple[int, ...] | None = None

    def changed(self, model: keras.Model, step: int) -> bool:
        """True (with one log line) when ``model``'s trainable variables differ from those
        of the last call; records the current set either way."""
        current = tuple(id(v) for v in model.trainable_variables)
        changed = self._traced is not None and current != self._traced
        if changed:
            logging.info("trainable variables changed (%d -> %d) at step %d: the train "
                         "step is traced again.", len(self._traced), len(current), step)
        self._traced = current
        return changed
