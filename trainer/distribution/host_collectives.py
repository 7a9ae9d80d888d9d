"""Small host-side collectives between the workers of a run (cross-replica context).

Between ``tf.function`` calls the workers sometimes have to agree on a host value: a
stop flag, the chief's checkpoint step, the chief's restored state. These helpers do
it with the strategy's own all-reduce (no second communication channel), so they work
wherever training works. On a single worker they are local and cost nothing.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import tensorflow as tf

_SUM = tf.distribute.ReduceOp.SUM


def num_workers(strategy: tf.distribute.Strategy) -> int:
    """Number of worker processes taking part in ``strategy`` (1 unless multi-worker)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return 1
    spec = resolver.cluster_spec().as_dict()
    return len(spec.get("chief", [])) + len(spec.get("worker", []))


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """True on the one process that writes files (checkpoints, summaries, config)."""
    return bool(strategy.extended.should_checkpoint)


def worker_index(strategy: tf.distribute.Strategy) -> int:
    """This worker's index in ``0..num_workers-1``: the chief 0, then the ``worker`` tasks
    in order (0 on a single worker)."""
    if num_workers(strategy) == 1:
        return 0
    resolver = strategy.cluster_resolver
    if resolver.task_type == "chief":
        return 0
    has_chief = bool(resolver.cluster_spec().as_dict().get("chief"))
    return int(resolver.task_id) + (1 if has_chief else 0)


def gather_ints(strategy: tf.distribute.Strategy, value: int) -> list[int]:
    """Every worker's ``value``, by :func:`worker_index` (one all-reduce of a vector
    holding each worker's value in its slot, zeros elsewhere). Every worker must call it
    at the same point."""
    words = np.zeros(num_workers(strategy), np.int32)
    words[worker_index(strategy)] = value
    return [int(v) for v in sum_over_workers(strategy, words)]


def mean_over_workers(strategy: tf.distribute.Strategy, seconds: float) -> float:
    """A host number (e.g. a window's seconds) averaged over workers, so logs agree
    everywhere. Every worker must call it at the same point."""
    workers = num_workers(strategy)
    if workers == 1:
        return seconds
    return float(sum_over_workers(strategy, np.array([seconds], np.float32))[0]) / workers


def sum_over_workers(strategy: tf.distribute.Strategy, values: np.ndarray) -> np.ndarray:
    """Sums a numeric vector over workers; each worker contributes it once.

    The worker's first local replica holds ``values``, the others zeros, and one
    all-reduce sums them (in ``values``' dtype): with zeros everywhere but the chief it
    is a broadcast. Every worker must call it at the same point.
    """
    if num_workers(strategy) == 1:
        return np.array(values, copy=True)
    first = [True]

    def value(_):
        contribution = values if first[0] else np.zeros_like(values)
        first[0] = False
        return tf.constant(contribution)

    per_replica = strategy.experimental_distribute_values_from_function(value)
    return strategy.reduce(_SUM, per_replica, axis=None).numpy()


def from_chief(strategy: tf.distribute.Strategy, value: int) -> int:
    """The chief's ``value`` on every worker (the others' ``value`` is ignored)."""
    return int(words_from_chief(strategy, np.array([value], np.int32))[0])


def words_from_chief(strategy: tf.distribute.Strategy, words: np.ndarray) -> np.ndarray:
    """The chief's int32 ``words`` on every worker (the others' are ignored); no
    communication on one worker. Every worker must call it at the same point."""
    if num_workers(strategy) == 1:
        return words
    return sum_over_workers(strategy, words if is_chief(strategy) else np.zeros_like(words))


def _sends(strategy: tf.distribute.Strategy, source: int | None) -> bool:
    """Whether this worker is ``source`` (None: the chief)."""
    return is_chief(strategy) if source is None else worker_index(strategy) == source


def json_from_chief(strategy: tf.distribute.Strategy, value: Any,
                    source: int | None = None) -> Any:
    """The chief's JSON-able ``value`` (or worker ``source``'s, by :func:`worker_index`)
    on every worker (the others' is ignored), as ``json`` reads it back; no
    communication on one worker. Every worker must call it at the same point."""
    if num_workers(strategy) == 1:
        return value
    sends = _sends(strategy, source)
    raw = json.dumps(value).encode() if sends else b""
    size = int(sum_over_workers(strategy, np.array([len(raw)], np.int32))[0])
    words = (np.frombuffer(raw.ljust(size + -size % 4, b"\0"), np.int32).copy() if sends
             else np.zeros((size + 3) // 4, np.int32))
    return json.loads(sum_over_workers(strategy, words).tobytes()[:size])


def barrier(strategy: tf.distribute.Strategy) -> None:
    """Returns on every worker once all have reached it."""
    if num_workers(strategy) > 1:
        sum_over_workers(strategy, np.zeros(1, np.int32))


def _pack(arrays: list[np.ndarray]) -> np.ndarray:
    raw = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    raw += b"\0" * (-len(raw) % 4)
    return np.frombuffer(raw, np.int32).copy()


def _unpack(words: np.ndarray, like: list[tuple[list, str]]) -> list[np.ndarray]:
    raw = words.tobytes()
    out, offset = [], 0
    for shape, dtype in like:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        out.append(np.frombuffer(raw[offset:offset + size], dtype).reshape(shape).copy())
        offset += size
    return out


def broadcast_arrays(strategy: tf.distribute.Strategy, arrays: list[np.ndarray] | None,
                     like: list[tuple[list, str]], source: int | None = None
                     ) -> list[np.ndarray]:
    """The chief's ``arrays`` (or worker ``source``'s, by :func:`worker_index`) on every
    worker, bit for bit.

    ``like``: ``(shape, dtype name)`` of each array, known on every worker; ``arrays``
    is ignored (may be None) off the source. The bytes travel as int32 words summed with
    zeros, so any dtype arrives unchanged.
    """
    return gather_owned(strategy, arrays if _sends(strategy, source) else [None] * len(like), like)


def gather_owned(strategy: tf.distribute.Strategy, arrays: list[np.ndarray | None],
                 like: list[tuple[list, str]]) -> list[np.ndarray]:
    """Every array on every worker, each sent by the one worker that holds it, bit for bit.

    ``arrays[i]`` is the array on the worker that owns it and None on every other one
    (exactly one owner each); ``like``: ``(shape, dtype name)`` of each, known on every
    worker. Each worker packs its arrays' bytes and zeros elsewhere, and one sum over the
    workers of those int32 words joins them: no two workers set a bit of the same word,
    so no carry, and any dtype arrives unchanged. Every worker must call it at the same
    point.
    """
    parts = [np.zeros(shape, dtype) if array is None else array
             for array, (shape, dtype) in zip(arrays, like)]
    return _unpack(sum_over_workers(strategy, _pack(parts)), like)

