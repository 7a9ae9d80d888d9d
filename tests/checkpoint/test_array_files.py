"""trainer.checkpoint.storage.array_files: aligned-header .npy files written with O_DIRECT, and their
fallbacks (unaligned arrays, file systems that refuse O_DIRECT), read back bitwise."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from trainer.checkpoint.storage import array_files, checksums

CASES = [((), np.float32), ((), np.int64), ((3,), np.float32), ((1025, 3), np.float64),
         ((4096,), np.float32), ((7, 4096), np.int32), ((0,), np.float32), ((2, 3), np.bool_)]


def filled(shape, dtype, aligned: bool) -> np.ndarray:
    array = array_files.aligned_empty(shape, dtype) if aligned else np.empty(shape, dtype)
    array[...] = (np.arange(array.size).reshape(shape) % 7).astype(dtype)
    return array


@pytest.fixture
def opened(monkeypatch):
    """The flags of every os.open call, in order."""
    flags = []
    original = os.open

    def spy(path, flag, *args, **kwargs):
        flags.append(flag)
        return original(path, flag, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    return flags


@pytest.mark.parametrize("shape,dtype", CASES)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_round_trip_is_a_standard_npy_with_the_data_on_an_aligned_offset(
        tmp_path, shape, dtype, aligned):
    array = filled(shape, dtype, aligned)
    path = str(tmp_path / "a.npy")
    array_files.write_npy(path, array)
    assert os.path.getsize(path) == array_files.ALIGN + array.nbytes
    loaded = np.load(path)  # plain numpy reads it
    assert loaded.shape == array.shape and loaded.dtype == array.dtype
    np.testing.assert_array_equal(loaded, array)
    read, checksum = array_files.read_npy(path)
    np.testing.assert_array_equal(read, array)
    assert checksum == checksums.file_crc(path)  # of the bytes read, header included
    assert array_files.read_npy_header(path) == (array.shape, array.dtype)


def test_aligned_arrays_are_written_and_read_with_o_direct_unaligned_ones_buffered(
        tmp_path, opened):
    aligned = filled((1000, 5), np.float32, aligned=True)
    assert aligned.ctypes.data % array_files.ALIGN == 0
    unaligned = np.empty(20_001, np.float32)[1:].reshape(1000, 20)
    assert unaligned.ctypes.data % array_files.ALIGN != 0
    array_files.write_npy(str(tmp_path / "a.npy"), aligned)
    assert opened and opened[0] & os.O_DIRECT and opened[0] & os.O_WRONLY
    del opened[:]
    array_files.write_npy(str(tmp_path / "u.npy"), unaligned)
    assert not any(flag & os.O_DIRECT for flag in opened)
    np.testing.assert_array_equal(np.load(str(tmp_path / "u.npy")), unaligned)
    del opened[:]
    read, _ = array_files.read_npy(str(tmp_path / "a.npy"))
    assert opened == [os.O_RDONLY | os.O_DIRECT]
    assert read.ctypes.data % array_files.ALIGN == 0
    np.testing.assert_array_equal(read, aligned)


def test_any_npy_file_reads_without_a_checksum_of_its_bytes(tmp_path):
    array = np.arange(1000.0).reshape(10, 100)
    np.save(str(tmp_path / "plain.npy"), array)  # a 128-byte header
    read, checksum = array_files.read_npy(str(tmp_path / "plain.npy"))
    np.testing.assert_array_equal(read, array)
    assert checksum is None  # np.load read it: the check reads the file itself


@pytest.mark.parametrize("refused_at", ["open", "io"])
def test_a_file_system_that_refuses_o_direct_gets_buffered_io(
        tmp_path, monkeypatch, refused_at):
    original_open, original_write, original_preadv = os.open, os.write, os.preadv
    direct_fds = set()

    def refusing_open(path, flag, *args, **kwargs):
        if flag & os.O_DIRECT and refused_at == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = original_open(path, flag, *args, **kwargs)
        if flag & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def refusing_write(fd, data):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return original_write(fd, data)

    def refusing_preadv(fd, buffers, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return original_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(os, "write", refusing_write)
    monkeypatch.setattr(os, "preadv", refusing_preadv)
    array = filled((3000, 7), np.float32, aligned=True)
    path = str(tmp_path / "a.npy")
    array_files.write_npy(path, array)
    np.testing.assert_array_equal(np.load(path), array)
    assert os.path.getsize(path) == array_files.ALIGN + array.nbytes
    read, checksum = array_files.read_npy(path)
    np.testing.assert_array_equal(read, array)
    assert checksum == checksums.file_crc(path)  # counted once, from the buffered read
    assert len(direct_fds) == (2 if refused_at == "io" else 0)  # O_DIRECT was tried


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_file_is_a_value_error_naming_it(tmp_path, damage):
    path = str(tmp_path / "a.npy")
    array_files.write_npy(path, filled((100, 100), np.float32, aligned=True))
    if damage == "truncated":
        os.truncate(path, os.path.getsize(path) - 4)
    else:
        with open(path, "wb") as f:
            f.write(b"" if damage == "empty" else b"garbage" * 1000)
    with pytest.raises(ValueError, match=r"a\.npy is not a readable \.npy file"):
        array_files.read_npy(path)


def test_orbax_round_trip_writes_npy_files_and_sends_bfloat16_through_tensorstore(tmp_path):
    """The checkpoint's own handler: float and integer leaves become .npy files; a
    bfloat16 leaf (no .npy dtype) is stored by orbax's tensorstore handler; all restore."""
    import ml_dtypes

    from trainer.checkpoint.storage import handlers

    ocp = handlers.orbax()
    tree = {"f": [filled((300, 7), np.float32, aligned=True), np.array(7, np.int64)],
            "b": [np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)]}
    saver = ocp.Checkpointer(handlers.state_handler(ocp, fast_io=True))
    saver.save(tmp_path / "ckpt", args=ocp.args.PyTreeSave(tree))
    names = os.listdir(tmp_path / "ckpt")
    assert {"f.0.npy", "f.1.npy"} <= set(names) and "b.0.npy" not in names
    target = {group: [np.empty(a.shape, a.dtype) for a in arrays]
              for group, arrays in tree.items()}
    restored = saver.restore(tmp_path / "ckpt", args=ocp.args.PyTreeRestore(target))
    for group, arrays in tree.items():
        for got, want in zip(restored[group], arrays):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_every_handler_is_of_the_one_class_built_per_orbax_module():
    import orbax.checkpoint as ocp

    first, second = array_files.npy_file_handler(ocp), array_files.npy_file_handler(ocp)
    assert first is not second and type(first) is type(second)
