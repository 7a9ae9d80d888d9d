"""The input of a file-sharded run continues exactly on another pipeline/replica count.

In-process, on plain tf.data (no workers): a dataset of example ids, sharded by "file"
(each pipeline reads every N-th of 4 files), seeded-shuffled, repeated and batched
per replica, stands for a TFDS source read with ``ReadConfig(input_context=ctx)``.
The old run's global batch of step ``t`` is the concatenation, in pipeline order, of
its pipelines' per-replica batches; the new pipelines must yield exactly those
examples from the resumed step on.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from trainer import data
from trainer.data import resume
from trainer.errors import InputError

FILES, PER_FILE, GLOBAL = 4, 48, 24


def ids_dataset(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
    """Per-replica batches of ``(x, {"id"})`` from this pipeline's files, shuffled per
    epoch."""
    files = tf.data.Dataset.range(FILES)
    if ctx.num_input_pipelines > 1:
        files = files.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    ids = files.flat_map(lambda f: tf.data.Dataset.range(f * PER_FILE, (f + 1) * PER_FILE))
    return (ids.shuffle(FILES * PER_FILE, seed=7).repeat()
            .map(lambda i: (tf.fill([3], tf.cast(i, tf.float32)), {"id": i}))
            .batch(ctx.get_per_replica_batch_size(GLOBAL), drop_remainder=True))


def stream(ctx):
    return ids_dataset(ctx), True


def global_batches(pipelines: int, replicas: int, steps: int, skip: int = 0) -> np.ndarray:
    """``[steps, GLOBAL]`` ids of the run with this layout, from step ``skip``."""
    per_pipeline = replicas // pipelines
    iterators = [iter(ids_dataset(tf.distribute.InputContext(pipelines, p, replicas))
                      .skip(skip * per_pipeline)) for p in range(pipelines)]
    return np.stack([np.concatenate([next(it)[1]["id"].numpy() for it in iterators
                                     for _ in range(per_pipeline)]) for _ in range(steps)])


def continued(layout, pipelines: int, replicas: int, steps: int, skip: int) -> np.ndarray:
    per_pipeline = replicas // pipelines
    iterators = [iter(resume.continue_streams(
        stream, layout, tf.distribute.InputContext(pipelines, p, replicas), GLOBAL, skip))
        for p in range(pipelines)]
    rows = []
    for _ in range(steps):
        batches = [next(it) for it in iterators for _ in range(per_pipeline)]
        assert all(b[1]["id"].shape == [GLOBAL // replicas] for b in batches)
        assert all(b[0].shape == [GLOBAL // replicas, 3] for b in batches)
        rows.append(np.concatenate([b[1]["id"].numpy() for b in batches]))
    return np.stack(rows)


@pytest.mark.parametrize("old, new", [
    ((4, 4), (2, 2)), ((2, 2), (4, 4)), ((2, 4), (3, 3)), ((4, 8), (1, 1)), ((1, 1), (4, 4)),
    ((2, 2), (2, 4)),
], ids=lambda c: f"{c[0]}p{c[1]}r")
def test_new_pipelines_yield_the_old_runs_global_batches_from_the_resumed_step(old, new):
    skip, steps = 5, 12  # step 5 is mid-epoch (an epoch is 192 / 24 = 8 steps)
    layout = resume.InputLayout(old[0], old[1], True)
    want = global_batches(*old, steps, skip)
    got = continued(layout, *new, steps, skip)
    np.testing.assert_array_equal(got, want)
    # Every example once per epoch across the change: steps 0-4 on the old layout,
    # 5-15 on the new one.
    run = np.concatenate([global_batches(*old, skip), got])
    for epoch in range(2):
        seen = np.sort(run[8 * epoch:8 * (epoch + 1)].ravel())
        np.testing.assert_array_equal(seen, np.arange(FILES * PER_FILE))


def test_file_sharding_differs_between_counts_so_the_continuation_is_needed():
    # The negative control: the new count's own file-sharded streams skipped by the
    # same steps do not give the old run's batches.
    assert not np.array_equal(global_batches(2, 2, 4, skip=5), global_batches(4, 4, 4, skip=5))


def test_only_a_pipeline_sharded_layout_on_another_count_is_continued():
    ctx = tf.distribute.InputContext(2, 0, 2)
    sharded = resume.InputLayout(4, 4, True)
    assert resume.layout_to_continue(sharded, ctx, True) == sharded
    assert resume.layout_to_continue(sharded, ctx, False) == sharded
    assert resume.layout_to_continue(resume.InputLayout(4, 4, False), ctx, True) \
        == resume.InputLayout(4, 4, False)
    assert resume.layout_to_continue(resume.InputLayout(4, 4, False), ctx, False) \
        is None  # batch sharding: the same global batches on any count
    assert resume.layout_to_continue(resume.InputLayout(2, 2, True), ctx, True) is None
    assert resume.layout_to_continue(None, ctx, True) is None


def test_distribute_continues_a_two_pipeline_checkpoint_on_one_pipeline_and_reports_it():
    report: dict = {}
    layout = resume.InputLayout(2, 2, True)
    dist = data.distribute(tf.distribute.get_strategy(), ids_dataset, data.BatchSizes(GLOBAL, 1),
                           skip_batches=3, resume_layout=layout, report=report)
    got = np.stack([b[1]["id"].numpy() for _, b in zip(range(6), dist)])
    np.testing.assert_array_equal(got, global_batches(2, 2, 6, skip=3))
    assert report["input_layout"] == layout  # the next checkpoint keeps the old layout
    fresh: dict = {}
    data.distribute(tf.distribute.get_strategy(), ids_dataset, data.BatchSizes(GLOBAL, 1), report=fresh)
    assert fresh["input_layout"] == resume.InputLayout(1, 1, False)


def test_a_global_batch_the_old_replicas_do_not_divide_is_refused_naming_both():
    with pytest.raises(InputError, match=r"global_batch_size=24 is not divisible by 5 "
                                         r"\(the checkpoint's replicas\)"):
        resume.continue_streams(stream, resume.InputLayout(5, 5, True),
                                     tf.distribute.InputContext(2, 0, 2), GLOBAL, 3)


def test_a_dataset_that_no_longer_shards_itself_as_the_checkpoint_did_is_refused():
    def by_batch(ctx):  # ignores ctx.input_pipeline_id: the framework would shard it
        return ids_dataset(tf.distribute.InputContext(1, 0, ctx.num_replicas_in_sync)), False

    with pytest.raises(InputError, match=r"was sharded by input pipeline .* does not shard "
                                         r"itself, .* config\.data\.sharding"):
        resume.continue_streams(by_batch, resume.InputLayout(2, 2, True),
                                     tf.distribute.InputContext(1, 0, 1), GLOBAL, 3)


def test_the_layout_round_trips_through_the_manifest_and_the_broadcast_words():
    layout = resume.InputLayout(4, 8, True)
    assert resume.InputLayout.from_manifest({"input_layout": layout.to_manifest()}) == layout
    assert resume.InputLayout.from_words(layout.to_words()) == layout
    assert resume.InputLayout.from_words(np.zeros(3, np.int32)) is None
    # A manifest written before layouts were recorded: its workers and replicas.
    assert resume.InputLayout.from_manifest(
        {"workers": 2, "replicas": 2, "input_pipeline_sharded": True}) \
        == resume.InputLayout(2, 2, True)
