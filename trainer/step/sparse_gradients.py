"""Sparse gradients (``tf.IndexedSlices``: embeddings, ``tf.gather``) across replicas.

Why not TensorFlow's own all-reduce of ``IndexedSlices``: it all-gathers (indices,
values) whose row count differs per replica and per step (a padded batch of another
length, another number of tokens), and inside the in-graph K-step loop a collective keeps
the shape of its first iteration: the next step fails with "Shape mismatch in the
collective". So the gradient path reduces sparse gradients itself, by the policy
``perf.sparse_reduce``:

* ``"dense"``: each sparse gradient is made dense (``[V, D]``) and joins the one batched
  all-reduce of the dense gradients. Fixed shape, works everywhere; moves the whole
  table every step (a 200k x 64 float32 embedding: 51 MB per replica per step).
* ``"gather"``: only the rows touched move. Each replica first sums its rows per index
  (``tf.unique``), then

  - one replica: nothing to communicate;
  - strategies that reduce through ``merge_call`` (Mirrored, OneDevice: every replica in
    one process and one graph): in cross-replica context the replicas' rows are
    concatenated on one device and summed per index (device copies, no collective, any
    shape);
  - strategies without ``merge_call`` (MultiWorkerMirrored): the rows are all-gathered,
    padded to a capacity taken from a fixed ladder (powers of two) by ``tf.switch_case``
    on the all-gathered largest row count, so each collective keeps one shape in every
    loop iteration; capacities at which gathering would move more than the dense
    all-reduce are left to a dense branch.

* ``"auto"`` (default): with a static row count, ``"gather"`` when replicas x rows x
  (D + 1) < V x D; with a dynamic one (padded batches), ``"gather"`` for tables of more
  than :data:`DENSE_TABLE_ELEMENTS` elements; else ``"dense"``. ``"dense"`` on TPU
  (``tf.unique`` has no fixed shape there).
  ``benchmarks/parallel/sparse_reduce.py`` measures both.

Every sparse gradient leaves here with UNIQUE indices, so its global norm (clipping,
the logged gradient norm) is the norm of the dense gradient on any replica count.

Compression (``distribute.grad_compression``, :func:`all_reduce_sum`): "bf16" / "fp16"
cast the float32 dense gradients to bfloat16 / float16 for the all-reduce and the sums
back to float32 (lossy: 8 / 11 significant bits). The extras (loss sum, example count)
and the gradients that arrived sparse or are not float32 stay as they are, exact, in a
second batched all-reduce (a collective batch concatenates its values, which must share
a dtype). One replica communicates nothing: nothing is cast. "fp16" is only allowed with dynamic loss
scaling (``trainer.config``): the gradients reduced here are the SCALED ones, so a sum
that overflows float16 is inf, and the finiteness check after it skips the step and
lowers the scale.

Contexts: :func:`all_reduce_sum` runs in REPLICA context while a step is traced.
"""

from __future__ import annotations

import tensorflow as tf
from absl import logging

from trainer.runtime.tracing import no_autograph
from trainer.step.update_context import in_update_context

_SUM = tf.distribute.ReduceOp.SUM
WIRE_DTYPES = {"bf16": tf.bfloat16, "fp16": tf.float16}  # distribute.grad_compression
_MIN_CAPACITY = 64
# "auto" with a dynamic row count: tables up to this many elements go dense. Measured on
# 2 Mirrored CPU replicas (benchmarks/parallel/sparse_reduce.py): a 2,000 x 16 table trains 1.18x
# faster dense, a 200,000 x 64 table 1.44x faster gathered; 2**20 (4 MB of float32)
# lies between.
DENSE_TABLE_ELEMENTS = 2 ** 20


@no_autograph
def sum_duplicates(indices: tf.Tensor, values: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``(unique indices [u], values summed per index [u, ...])`` of sparse rows."""
    unique, position = tf.unique(indices)
    return unique, tf.math.unsorted_segment_sum(values, position, tf.shape(unique)[0])


def _rows(variable) -> tuple[int, int]:
    """(table rows V, elements per row D) of a sparse gradient's variable."""
    shape = variable.shape
    return int(shape[0]), int(shape[1:].num_elements() or 1)


def chooses_dense(policy: str, grad: tf.IndexedSlices, variable,
                  strategy: tf.distribute.Strategy) -> bool:
    """Whether ``policy`` reduces this sparse gradient densely (module docstring)."""
    if policy == "dense" or isinstance(strategy, tf.distribute.TPUStrategy):
        return True
    if policy == "gather":
        return False
    table, width = _rows(variable)
    rows = grad.indices.shape[0]
    if rows is None:
        return table * width <= DENSE_TABLE_ELEMENTS
    return strategy.num_replicas_in_sync * rows * (width + 1) >= table * width


def _capacities(replicas: int, table: int, width: int) -> list[int]:
    """The ladder of gather capacities cheaper than the dense all-reduce."""
    capacities, capacity = [], _MIN_CAPACITY
    while capacity < table and replicas * capacity * (width + 1) < table * width:
        capacities.append(capacity)
        capacity *= 2
    return capacities


def _padded(capacity: int, table: int):
    """Replica fn: ``(indices, values)`` padded to ``capacity`` rows (that static shape)
    with zero rows at index ``table``, one past the last row (:func:`_drop_padding`)."""
    def pad(indices, values):
        extra = capacity - tf.shape(indices)[0]
        rows = tf.ensure_shape(tf.pad(indices, [[0, extra]], constant_values=table),
                               [capacity])
        padding = [[0, extra]] + [[0, 0]] * (values.shape.rank - 1)
        return rows, tf.ensure_shape(tf.pad(values, padding), [capacity, *values.shape[1:]])
    return pad


def _drop_padding(indices, values, table: int):
    """The rows of a gathered sparse gradient without the padding row (index ``table``)."""
    keep = indices < table
    return tf.boolean_mask(indices, keep), tf.boolean_mask(values, keep)


@no_autograph
def _gather_rows(ops, indices, values, table: int, width: int, replicas: int):
    """Where a collective may branch (:func:`in_update_context`): every replica's summed
    rows as ``(unique indices, values)``, the same on every replica.

    One process (all replicas in this graph): concatenated, no collective. Else
    all-gathered at the smallest capacity of the ladder that holds the largest replica's
    rows, or all-reduced densely past the ladder.
    """
    if ops.one_process:
        return sum_duplicates(tf.concat(ops.local_values(indices), 0),
                              tf.concat(ops.local_values(values), 0))
    capacities = _capacities(replicas, table, width)

    def dense():
        summed = ops.each(lambda i, v: tf.math.unsorted_segment_sum(v, i, table),
                          indices, values)
        return tf.range(table, dtype=indices.dtype), ops.first(ops.all_reduce([summed])[0])

    if not capacities:
        return dense()

    def gather_at(capacity: int):
        def branch():
            rows, vals = ops.each(_padded(capacity, table), indices, values)
            return _drop_padding(*sum_duplicates(ops.all_gather(rows), ops.all_gather(vals)),
                                 table)
        return branch

    counts = ops.all_gather(ops.each(lambda i: tf.reshape(tf.shape(i)[0], [1]), indices))
    bucket = tf.reduce_sum(tf.cast(tf.reduce_max(counts) > tf.constant(capacities),
                                   tf.int32))
    return tf.switch_case(bucket, [gather_at(c) for c in capacities] + [dense])


@no_autograph
def _gather(grad: tf.IndexedSlices, variable, replicas: int) -> tf.IndexedSlices:
    """Replica context: ``grad`` summed over replicas, rows touched only."""
    dense_shape = tf.shape(variable, out_type=grad.indices.dtype)
    indices, values = sum_duplicates(grad.indices, grad.values)
    if replicas > 1:
        table, width = _rows(variable)
        indices, values = in_update_context(
            lambda ops, args: _gather_rows(ops, *args, table, width, replicas),
            (indices, values))
    return tf.IndexedSlices(values, indices, dense_shape)


def _log_choice(variable, dense: bool, policy: str, strategy) -> None:
    """One log line per sparse gradient when the step is traced: how it is reduced."""
    shape = " x ".join(str(d) for d in variable.shape)
    name = getattr(variable, "path", None) or variable.name
    how = ("made dense, all-reduced" if dense else
           "rows summed per index" if strategy.num_replicas_in_sync == 1 else
           "rows touched gathered")
    logging.info("sparse gradient of %s [%s]: %s (perf.sparse_reduce=%s).", name, shape,
                 how, policy)


def _log_compression(ctx, strategy, compression: str, wire, compressed: int,
                     exact: int) -> None:
    """One log line per trace of the step with compression on (from each process's first
    replica): what is cast."""
    replicas = strategy.num_replicas_in_sync
    if replicas == 1:  # (the default strategy has no worker_devices)
        logging.info("distribute.grad_compression=%s: 1 replica, nothing is communicated, "
                     "nothing is cast.", compression)
        return
    replica = tf.get_static_value(ctx.replica_id_in_sync_group)
    if replica is not None and replica % len(strategy.extended.worker_devices):
        return
    logging.info("distribute.grad_compression=%s: %d dense gradients are all-reduced in %s "
                 "over %d replicas (lossy); %d others (sparse, or not float32) as they are, "
                 "the loss sum and the example count in float32.", compression, compressed,
                 wire.name, replicas, exact)


def _sum_per_wire_dtype(ctx, values: list, wires: list, options) -> list:
    """Replica context: ``values`` summed over replicas, each sent as its ``wires`` dtype
    (None: as it is) and cast back; one batched all-reduce per wire dtype, in the order
    of first appearance (the same on every replica)."""
    out = [None] * len(values)
    for wire in dict.fromkeys(wires):
        group = [i for i, w in enumerate(wires) if w == wire]
        sent = [values[i] if wire is None else tf.cast(values[i], wire) for i in group]
        for i, total in zip(group, ctx.all_reduce(_SUM, sent, options=options)):
            out[i] = total if wire is None else tf.cast(total, values[i].dtype)
    return out


@no_autograph
def all_reduce_sum(grads: list, variables: list, extras: list, policy: str,
                   strategy: tf.distribute.Strategy, pack_bytes: int = 0,
                   compression: str = "none") -> tuple[list, list]:
    """Replica context: ``(grads summed over replicas, extras summed over replicas)``.

    ``grads`` pair with ``variables``; dense ones and ``extras`` (scalars) go through one
    batched all-reduce, sparse ones by ``policy`` (module docstring) and come back as
    ``IndexedSlices`` with unique indices, or dense where the policy densifies them.
    ``pack_bytes`` > 0 (``distribute.grad_pack_bytes``): the batched all-reduce is
    issued in packs of about that many bytes, the last gradients (the first the backward
    pass computes) first, so that each pack's collective can run while the backward
    pass goes on (TensorFlow's collective all-reduce of MultiWorkerMirroredStrategy;
    other strategies reduce as one batch). The same sums per element either way.
    ``compression`` "bf16" / "fp16" (``distribute.grad_compression``, more than one
    replica): the float32 dense gradients are all-reduced in that type, the rest in a
    second batch (module docstring).
    """
    ctx = tf.distribute.get_replica_context()
    replicas = strategy.num_replicas_in_sync
    wire = WIRE_DTYPES.get(compression) if replicas > 1 else None
    sparse = {}
    dense_values, wires = [], []
    for i, (grad, variable) in enumerate(zip(grads, variables)):
        arrived_sparse = isinstance(grad, tf.IndexedSlices)
        if arrived_sparse:
            dense = chooses_dense(policy, grad, variable, strategy)
            _log_choice(variable, dense, policy, strategy)
            if dense:
                grad = tf.convert_to_tensor(grad)
            else:
                sparse[i] = grad
                continue
        dense_values.append(grad)
        wires.append(wire if grad.dtype == tf.float32 and not arrived_sparse else None)
    if compression != "none":
        compressed = sum(w is not None for w in wires)
        _log_compression(ctx, strategy, compression, wire, compressed, len(grads) - compressed)
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=pack_bytes)
    extras = list(extras)
    reduced = iter(_sum_per_wire_dtype(ctx, dense_values + extras,
                                       wires + [None] * len(extras), options))
    reduced_dense = [next(reduced) for _ in dense_values]
    reduced_extras = list(reduced)
    dense_iter = iter(reduced_dense)
    out = [_gather(sparse[i], variables[i], replicas) if i in sparse else next(dense_iter)
           for i in range(len(grads))]
    return out, reduced_extras
