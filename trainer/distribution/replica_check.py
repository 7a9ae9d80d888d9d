"""Do the copies of every variable agree, on every replica and every worker?

Every replica (and every worker) holds its own copy of a mirrored variable; they must
stay equal, else the replicas train different models and a checkpoint keeps replica 0's.
:func:`disagreements` checks it cheaply: each copy is reduced ON ITS OWN DEVICE to one
int32 fingerprint (the wrapping sum of its bit patterns: equal copies give equal
fingerprints, copies that differ almost surely do not), one ``tf.function`` for all
variables; the host compares the fingerprints of the local replicas, then those of each
worker with the chief's (two small host collectives on multi-worker runs). Only for a
variable whose fingerprints differ are values compared, to report by how much.

Variables synchronised on read (per-replica by design, such as metrics) are skipped.
Cross-replica context, every worker at the same point.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from trainer.distribution import host_collectives
from trainer.runtime.tracing import per_object_function


@dataclasses.dataclass(frozen=True)
class Disagreement:
    """One variable whose copies differ: its name, which copy, and by how much."""

    name: str
    variable: Any
    where: str  # "replica 1 vs replica 0", "a worker of 2 vs the chief"
    max_abs_diff: float


def _fingerprint(value: tf.Tensor) -> tf.Tensor:
    """int32 wrapping sum of ``value``'s bit patterns (on the device it runs on)."""
    size = value.dtype.size
    if value.dtype == tf.bool or size == 1:
        bits = tf.cast(value, tf.int32)
    elif size == 2:
        bits = tf.cast(tf.bitcast(value, tf.int16), tf.int32)
    else:
        bits = tf.bitcast(value, tf.int32)  # 8-byte types gain a last axis of 2
    return tf.reduce_sum(tf.reshape(bits, [-1]))


def _tf_variable(variable: Any) -> Any:
    """The TensorFlow variable of a Keras variable (``.value``); a tf.Variable as it is
    (its ``value`` is a method)."""
    return variable if isinstance(variable, tf.Variable) else getattr(variable, "value",
                                                                      variable)


def _copies(strategy: tf.distribute.Strategy, variable: Any) -> list:
    """The local per-replica copies of ``variable`` (one unless mirrored)."""
    return list(strategy.experimental_local_results(_tf_variable(variable)))


def _checked(variables: Sequence[Any]) -> list:
    """``variables`` less those synchronised on read (one value per replica by design)."""
    synchronization = tf.VariableSynchronization.ON_READ
    return [v for v in variables
            if getattr(_tf_variable(v), "synchronization", None) != synchronization]


class ReplicaCheck:
    """Compares the copies of ``variables`` (built once; call :meth:`disagreements`)."""

    def __init__(self, strategy: tf.distribute.Strategy, variables: Sequence[Any]):
        self.strategy = strategy
        self.variables = _checked(variables)
        self.names = [getattr(v, "path", None) or v.name for v in self.variables]
        self._copies = [_copies(strategy, v) for v in self.variables]
        self.replicas = max([len(c) for c in self._copies] or [1])
        self._fingerprints = per_object_function(self._compute, autograph=False)

    def _compute(self) -> tf.Tensor:
        rows = []
        for r in range(self.replicas):
            row = []
            for copies in self._copies:
                copy = copies[r] if r < len(copies) else copies[0]
                with tf.device(copy.device):
                    row.append(_fingerprint(tf.convert_to_tensor(copy)))
            rows.append(tf.stack(row) if row else tf.zeros([0], tf.int32))
        return tf.stack(rows)

    def disagreements(self) -> list[Disagreement]:
        """The variables whose copies differ (empty: all agree), local replicas first,
        then workers against the chief. Every worker must call it at the same point."""
        if not self.variables:
            return []
        prints = self._fingerprints().numpy()  # [local replicas, variables]
        found = [self._local(k, int(r)) for k, r in _differing(prints)]
        chief = host_collectives.words_from_chief(self.strategy, prints[0].astype(np.int32))
        mine = (prints[0] != chief).astype(np.int32)
        # Every worker learns which variables differ on any worker, so all stop together.
        differ = host_collectives.sum_over_workers(self.strategy, mine)
        for k in np.flatnonzero(differ):
            found.append(self._across_workers(int(k), bool(mine[k])))
        return found

    def _local(self, k: int, replica: int) -> Disagreement:
        copies = self._copies[k]
        diff = np.max(np.abs(np.asarray(copies[replica], np.float64)
                             - np.asarray(copies[0], np.float64)), initial=0.0)
        return Disagreement(self.names[k], self.variables[k], f"replica {replica} vs replica 0",
                            float(diff))

    def _across_workers(self, k: int, this_worker_differs: bool) -> Disagreement:
        value = np.asarray(self._copies[k][0])
        chief = host_collectives.broadcast_arrays(
            self.strategy, [value], [(list(value.shape), value.dtype.name)])[0]
        diff = np.max(np.abs(value.astype(np.float64) - chief.astype(np.float64)), initial=0.0)
        # Every worker reports the same figure: the differences from the chief, summed.
        total = host_collectives.sum_over_workers(
            self.strategy, np.array([diff if this_worker_differs else 0.0], np.float32))
        workers = host_collectives.num_workers(self.strategy)
        return Disagreement(self.names[k], self.variables[k],
                            f"a worker of {workers} vs the chief", float(total[0]))


def _differing(prints: np.ndarray) -> list[tuple[int, int]]:
    """(variable, first replica whose fingerprint differs from replica 0's) pairs."""
    pairs = []
    for k in range(prints.shape[1]):
        others = np.flatnonzero(prints[:, k] != prints[0, k])
        if others.size:
            pairs.append((k, int(others[0])))
    return pairs
