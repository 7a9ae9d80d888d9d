"""Each worker's share of a step's array files (trainer.checkpoint.storage.shares): the
split is balanced and the same whatever order the files are listed in, and a step orbax
wrote with the ``.npy`` writer is read back share by share, each checked against the
step's checksums (a damaged file is named by its variable, on the worker that owns it
only). The bucket side (uploads, markers, the commit, a restore over the collectives)
runs on simulated hosts: tests/cluster/test_gcs_shares.py."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from trainer.checkpoint.storage import bucket, shares
from trainer.checkpoint.storage.handlers import orbax, saving_registry
from trainer.checkpoint.storage.reader import Unreadable


def test_the_split_is_balanced_and_the_same_in_any_order():
    sizes = {f"state/model.{i}.npy": size for i, size in
             enumerate([900, 800, 700, 600, 500, 400, 300, 200, 100, 100])}
    owner = shares.assign(sizes, 4)
    assert owner == shares.assign(dict(reversed(list(sizes.items()))), 4)
    loads = [sum(sizes[n] for n, r in owner.items() if r == rank) for rank in range(4)]
    assert sorted(owner) == sorted(sizes) and max(loads) <= sum(sizes.values()) / 4 + 100, loads
    assert shares.assign(sizes, 1) == {n: 0 for n in sizes}
    assert sorted(f for rank in range(4) for f in shares.share_of(sizes, 4, rank)) == sorted(sizes)


def test_only_a_state_of_npy_files_is_read_in_shares():
    assert shares.splittable(["manifest/metadata", "state/_METADATA", "state/model.0.npy"])
    assert not shares.splittable(["manifest/metadata", "state/model.0.npy",
                                  "state/model.1/.zarray"])  # a leaf tensorstore wrote
    assert not shares.splittable(["state/_METADATA", "state/d/abc"])  # orbax's own format


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """A step written by orbax with the ``.npy`` writer and checksums, and its manifest."""
    ocp = orbax()
    directory = tmp_path_factory.mktemp("shares")
    rng = np.random.default_rng(0)
    state = {"model": [rng.normal(size=(64, 32)).astype(np.float32),
                       rng.normal(size=(32,)).astype(np.float32)],
             "optimizer": [rng.normal(size=(64, 32)).astype(np.float32), np.array(7, np.int64)]}
    manifest = {"groups": {g: [[f"{g}/v{i}", list(a.shape), a.dtype.name]
                               for i, a in enumerate(arrays)] for g, arrays in state.items()}}
    manager = ocp.CheckpointManager(
        str(directory), options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
        handler_registry=saving_registry(ocp, fast_io=True))
    manager.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                            manifest=ocp.args.JsonSave(manifest)))
    manager.wait_until_finished()
    return str(directory / "1"), state, manifest


def test_every_worker_reads_its_share_and_together_they_read_the_whole_state(step):
    path, state, manifest = step
    names = bucket.local_sizes(path)
    flat = [a for arrays in state.values() for a in arrays]
    read = [shares.read_share(path, manifest, names, 3, rank) for rank in range(3)]
    assert all(verified for _, verified in read)
    for index, want in enumerate(flat):
        owners = [arrays[index] for arrays, _ in read if arrays[index] is not None]
        assert len(owners) == 1, index
        np.testing.assert_array_equal(owners[0], want)


def test_a_damaged_file_is_named_by_the_worker_that_owns_it(step, tmp_path):
    path, _, manifest = step
    copy = tmp_path / "1"
    shutil.copytree(path, copy)
    names = bucket.local_sizes(str(copy))
    damaged = "state/optimizer.0.npy"
    with open(copy / damaged, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    owner = shares.assign(shares.array_files(names), 2)[damaged]
    with pytest.raises(Unreadable, match=r"cannot read variable 'optimizer/v0' \(state/optimizer"
                                         r"\.0\.npy does not match its checksum"):
        shares.read_share(str(copy), manifest, names, 2, owner)
    shares.read_share(str(copy), manifest, names, 2, 1 - owner)  # the other share is whole
