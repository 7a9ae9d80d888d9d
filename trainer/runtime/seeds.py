"""The seeds a Trainer's dataset hooks see, the same at every call.

``tf.random.set_seed(config.seed)`` makes TensorFlow's unseeded random ops
deterministic: each takes the next operation seed of a sequence the global seed
starts. ``dataset.shuffle(n)`` without a seed takes one when the dataset is built. A
Trainer builds its train dataset again after the execution plan's rehearsal
(:mod:`trainer.loop.rehearsal`) and in a resumed process, after other ops took other
seeds of the sequence: the rebuilt dataset shuffled in another order (a run measured
with ``perf.plan=auto`` ended 0.47 apart in its weights from its plan pinned).
:func:`reseeded` starts the sequence anew from ``config.seed`` for each call of a
dataset hook, and seeds Python's and NumPy's global generators from it (their states
put back afterwards): unseeded shuffles, ``random.shuffle(files)`` and
``np.random.permutation`` in ``build_train_dataset`` give the same order at every
build, in every process.

Contexts: host, around a ``build_*_dataset`` call.
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np
import tensorflow as tf


@contextlib.contextmanager
def reseeded(seed: int) -> Iterator[None]:
    """Inside: TensorFlow's global seed set to ``seed`` (its operation seeds start
    anew), Python's ``random`` and NumPy's global generator seeded with ``seed``;
    afterwards Python's and NumPy's states as they were (TensorFlow's sequence goes on
    from where the block left it)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    tf.random.set_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
