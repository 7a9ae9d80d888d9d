"""A Keras layer the Trainer holds beside its model: nothing would train it.

A layer held in a public attribute of the Trainer (``self.head = keras.layers.Dense(3)``),
not a ``keras.Model``, with trainable weights is refused with one line (:func:`check`):
put it in the model, or freeze it. A ``keras.Model`` the Trainer holds is checkpointed
and trained by the step that updates it (a GAN's second model); a frozen one (a
teacher) is ``trainable=False``.

Checked twice (:class:`trainer.checks.hooks.Hooks`): when ``build_model`` returns, and
when the train or eval step has been traced, since a layer not built yet has no weights
until its first call inside the step.

Contexts: host, or replica context at trace time.
"""

from __future__ import annotations

from typing import Any, Mapping

import keras

from trainer.errors import HookError


def check(owner: str, attributes: Mapping[str, Any]) -> None:
    """Raises :class:`HookError` naming the first public attribute of ``attributes`` (a
    Trainer's ``vars()``; ``owner``: its class's name) that is a Keras layer, not a
    model, with trainable weights: outside the model, nothing would train or
    checkpoint it."""
    for attr in sorted(attributes):
        layer = attributes[attr]
        if (attr.startswith("_") or not isinstance(layer, keras.layers.Layer)
                or isinstance(layer, keras.Model) or not layer.trainable_weights):
            continue
        raise HookError(
            f"{owner}.{attr} is a Keras layer ({type(layer).__name__}) outside the model, "
            f"with {len(layer.trainable_weights)} trainable weights that nothing trains or "
            f"checkpoints: put it in the keras.Model build_model returns, or set "
            f"{owner}.{attr}.trainable = False if it stays frozen (e.g. a teacher).")
