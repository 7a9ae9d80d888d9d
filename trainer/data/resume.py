"""Resuming the training input exactly on another number of workers (elastic by restart).

A run's input is the sequence of global batches its input pipelines produce. Under
batch sharding (the framework keeps one per-replica batch in N of one stream) that
sequence does not depend on the number of pipelines: a resume on any count skips the
consumed batches and continues it. A dataset that shards ITSELF by pipeline (by file:
it read ``ctx.input_pipeline_id``) has one stream per pipeline, and the global batch
of step ``t`` is the concatenation, in pipeline order, of each pipeline's ``t``-th
chunk of ``global_batch_size / N`` examples. Such a stream cannot be continued by
sharding files over another count.

:class:`InputLayout` names the pipelines whose streams define a run's input: their
number, the replica count they batched for, and whether they sharded themselves. The
checkpoint records it (``manifest["input_layout"]``). On a resume where the layout
sharded itself and the pipeline or replica count differs, :func:`continue_streams`
makes each NEW pipeline rebuild the OLD pipelines' streams it needs (the user's
dataset function called with the old ``InputContext``: old count, old id, old replica
count, so old per-replica batches), skip the consumed steps, and cut its share of every
old global batch: new pipeline ``j`` of ``M`` takes examples ``[j*G/M, (j+1)*G/M)`` of
it, as ``(M replicas per pipeline)`` per-replica batches of ``G/replicas``. The
sequence of global batches is then exactly the uninterrupted run's: every example of
every epoch is seen exactly once across the change (no skip, no repeat), and the
weights match an uninterrupted run on the old count up to the all-reduce order. The
layout stays the OLD one for the rest of the run (its checkpoints record it, so a
later resume on any count, the old one included, continues the same streams).

Costs and limits:

* every stream must be deterministic (``train.deterministic=True``, seeded shuffles
  and augmentation), as for any exact resume;
* each new pipeline reads (and decodes) the whole streams of the old pipelines whose
  chunks overlap its part: fewer pipelines (4 -> 2) read the same total as before;
  more (N -> M, 2 -> 4) read M/N times their share (2M/N when a new part straddles two
  old chunks, e.g. 2 -> 3), never more than batch sharding, which reads everything
  everywhere;
* a fresh layout on the new count (plain file sharding over M) needs a fresh workdir;
* elements must be batched in every component (no scalar in a batch structure), and
  ``global_batch_size`` divisible by the old and the new replica counts;
* the tf.data service path is not affected (its resume is inexact by design).

Contexts: host; the functions build ``tf.data`` graphs (no iteration).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import tensorflow as tf
from absl import logging

from trainer.errors import InputError

#: ``ctx -> (per-replica batches of this pipeline, as the framework shards them;
#: whether the user's dataset read ctx.input_pipeline_id)``.
StreamFn = Callable[[tf.distribute.InputContext], tuple[tf.data.Dataset, bool]]


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """The input pipelines whose streams define a run's global batches.

    ``pipelines``: their number; ``replicas``: the replica count their per-replica
    batches were sized for; ``sharded``: each stream depends on its pipeline (the
    dataset sharded itself, e.g. by file) rather than being one stream sharded by batch.
    """

    pipelines: int
    replicas: int
    sharded: bool

    @classmethod
    def of(cls, ctx: tf.distribute.InputContext, sharded: bool) -> "InputLayout":
        """The layout of the pipelines ``ctx`` belongs to."""
        return cls(ctx.num_input_pipelines, ctx.num_replicas_in_sync, bool(sharded))

    @classmethod
    def from_manifest(cls, manifest: dict) -> "InputLayout | None":
        """The layout a checkpoint manifest records (older manifests: its workers and
        replicas); None when it records neither."""
        saved = manifest.get("input_layout")
        if saved:
            return cls(int(saved["pipelines"]), int(saved["replicas"]), bool(saved["sharded"]))
        if manifest.get("workers") and manifest.get("replicas"):
            return cls(int(manifest["workers"]), int(manifest["replicas"]),
                       bool(manifest.get("input_pipeline_sharded")))
        return None

    def to_manifest(self) -> dict:
        return dataclasses.asdict(self)

    def to_words(self) -> np.ndarray:
        """Three int32 words (for a broadcast between workers)."""
        return np.array([self.pipelines, self.replicas, int(self.sharded)], np.int32)

    @classmethod
    def from_words(cls, words: np.ndarray) -> "InputLayout | None":
        """Inverse of :meth:`to_words`; None for zeros (no layout)."""
        if int(words[0]) <= 0:
            return None
        return cls(int(words[0]), int(words[1]), bool(words[2]))


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What a restored checkpoint says about the run that wrote it: its ``step``, its
    number of workers (``from_workers``), this run's (``to_workers``), the input
    layout its train input followed (None: not recorded), the execution plan it
    chose (:meth:`trainer.loop.plan.Planner.saved`; read on the chief only, None elsewhere
    or when not recorded), and the services' states
    (:meth:`trainer.run_context.Service.checkpoint_state`, by key; the same on every
    worker; empty when none was recorded); ``seconds``: the wall time the restore took
    (finding, reading, checking and broadcasting the state)."""

    step: int
    from_workers: int
    to_workers: int
    layout: InputLayout | None
    plan: dict | None = None
    services: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


def layout_to_continue(resumed: InputLayout | None, ctx: tf.distribute.InputContext,
                       sharded_now: bool) -> InputLayout | None:
    """The resumed layout when this run must continue ITS streams, else None.

    None (the pipeline's own stream, skipped, continues exactly) when nothing was
    resumed, when the counts match, or when neither run sharded by pipeline (batch
    sharding gives the same global batches on any count)."""
    if resumed is None:
        return None
    same = (resumed.pipelines, resumed.replicas) == (ctx.num_input_pipelines,
                                                     ctx.num_replicas_in_sync)
    if same or not (resumed.sharded or sharded_now):
        return None
    return resumed


def _check_divisible(layout: InputLayout, ctx: tf.distribute.InputContext,
                     global_batch_size: int, what: str) -> None:
    for count, whose in ((layout.replicas, "the checkpoint's replicas"),
                         (layout.pipelines, "the checkpoint's input pipelines"),
                         (ctx.num_replicas_in_sync, "this run's replicas")):
        if global_batch_size % count:
            raise InputError(
                f"{what}: train.global_batch_size={global_batch_size} is not divisible by "
                f"{count} ({whose}), so the interrupted run's global batches cannot be "
                f"split over this run's pipelines; resume with a global batch size that "
                f"both runs divide, or start in a fresh --workdir.")


def _per_step_chunks(ds: tf.data.Dataset, replicas_per_pipeline: int, what: str
                     ) -> tf.data.Dataset:
    """Groups a pipeline's per-replica batches by step: one element of
    ``replicas_per_pipeline * b`` examples per step (the pipeline's part of the
    global batch, in replica order)."""
    for spec in tf.nest.flatten(ds.element_spec):
        if getattr(spec, "shape", None) is None or spec.shape.rank == 0:
            raise InputError(
                f"{what} yields a component that is not batched ({spec}); resuming on "
                f"another number of workers splits every component of a batch along its "
                f"first axis, so every component needs one.")

    def flatten_replicas(*components):  # Dataset.map passes a tuple's parts apart
        batch = components if isinstance(ds.element_spec, tuple) else components[0]
        return tf.nest.map_structure(lambda x: _reshape(x, [-1], x.shape[2:], 2), batch)

    return ds.batch(replicas_per_pipeline, drop_remainder=True).map(flatten_replicas)


def _reshape(x: tf.Tensor, lead: list[int], rest: tf.TensorShape, kept_from: int) -> tf.Tensor:
    """``x`` reshaped to ``lead + rest`` (``rest``: ``x``'s dims from ``kept_from`` on),
    with static dims where ``rest`` is fully known."""
    if rest.is_fully_defined():
        return tf.reshape(x, lead + rest.as_list())
    return tf.reshape(x, tf.concat([lead, tf.shape(x)[kept_from:]], 0))


def continue_streams(stream_fn: StreamFn, layout: InputLayout,
                     ctx: tf.distribute.InputContext, global_batch_size: int,
                     skip_steps: int, what: str = "build_train_dataset") -> tf.data.Dataset:
    """This pipeline's per-replica batches, continuing ``layout``'s streams at step
    ``skip_steps`` (see the module docstring).

    ``stream_fn`` builds one pipeline's stream for a given ``InputContext``; it is
    called with the OLD layout's contexts. Returns a dataset of per-replica batches of
    ``global_batch_size / ctx.num_replicas_in_sync`` examples, in local replica order.

    Raises:
      InputError: a batch size that does not divide, an unbatched component, or a
        dataset that no longer shards itself as the checkpoint's run did.
    """
    _check_divisible(layout, ctx, global_batch_size, what)
    old_chunk = global_batch_size // layout.pipelines
    old_per_pipeline = layout.replicas // layout.pipelines
    new_chunk = global_batch_size // ctx.num_input_pipelines
    new_per_pipeline = ctx.num_replicas_in_sync // ctx.num_input_pipelines
    new_batch = global_batch_size // ctx.num_replicas_in_sync
    lo = ctx.input_pipeline_id * new_chunk
    hi = lo + new_chunk
    first, last = lo // old_chunk, (hi - 1) // old_chunk
    parts = []
    for old_id in range(first, last + 1):
        old_ctx = tf.distribute.InputContext(layout.pipelines, old_id, layout.replicas)
        stream, sharded = stream_fn(old_ctx)
        if sharded != layout.sharded:
            raise InputError(
                f"{what}: the checkpoint's input {'was' if layout.sharded else 'was not'} "
                f"sharded by input pipeline (e.g. by file), but called with that run's "
                f"InputContext ({layout.pipelines} pipelines) it "
                f"{'does not shard itself' if layout.sharded else 'now shards itself'}, so "
                f"its streams cannot be rebuilt. Resume with the data settings that wrote "
                f"the checkpoint (e.g. config.data.sharding), or start in a fresh --workdir.")
        parts.append(_per_step_chunks(stream.skip(skip_steps * old_per_pipeline),
                                      old_per_pipeline, what))
    start, stop = lo - first * old_chunk, hi - first * old_chunk

    def cut(*chunks: Any):
        def one(*xs):
            piece = tf.concat(xs, 0)[start:stop]
            return _reshape(piece, [new_per_pipeline, new_batch], piece.shape[1:], 1)
        return tf.nest.map_structure(one, *chunks)

    logging.info("%s: input pipeline %d of %d continues the checkpoint's %d pipeline "
                 "stream(s) (pipelines %d-%d, examples %d-%d of each global batch of %d) "
                 "from step %d", what, ctx.input_pipeline_id, ctx.num_input_pipelines,
                 layout.pipelines, first, last, lo, hi - 1, global_batch_size, skip_steps)
    return tf.data.Dataset.zip(tuple(parts)).map(cut).unbatch()
