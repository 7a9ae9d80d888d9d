"""Checkpoint arrays as ``.npy`` files written around the page cache (``O_DIRECT``).

Why: a buffered write of a 577 MB training state costs 1.6-2.2 s of kernel CPU on a
VM that returns freed memory to its host (every page-cache page is a fresh page to
fault in), and an async save's background write takes that CPU from training. The
same bytes written with ``O_DIRECT`` from page-aligned host buffers cost 0.1 s
(``benchmarks/checkpoints/checkpoint.py``). Reads use ``O_DIRECT`` too, for the same reason.

File format: a standard ``.npy`` (version 1.0) whose header is padded with spaces to
:data:`ALIGN` bytes, so the data starts on an aligned offset; ``np.load`` reads it.

``NpyFileHandler`` (:func:`npy_file_handler`) is the orbax ``TypeHandler`` for
``np.ndarray`` leaves that writes these files (``<param>.npy`` in the item directory);
orbax keeps the rest: temporary step directories, the atomic commit, retention, async
threads, the pytree metadata. Non-local paths (``gs://`` ...), dtypes ``.npy`` cannot
name (bfloat16) and checkpoints written by orbax's own tensorstore handler go through
that handler instead. A reader without this handler (plain orbax) cannot read the
``.npy`` leaves; ``np.load`` can.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from typing import Any, Sequence

import numpy as np

from tf_cluster.storage_schemes import is_local
from trainer.checkpoint.storage import checksums

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers (a page; >= any block)
_CHUNK = 64 * 2**20  # bytes per write() call (Linux writes at most ~2 GiB per call)
BACKGROUND_CRC_BYTES = 2**20  # arrays this large have their CRC32C computed in a thread
_MAGIC = b"\x93NUMPY\x01\x00"


def aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an :data:`ALIGN` boundary.

    Allocated like any numpy array (so memory freed by earlier arrays is reused warm,
    where a fresh mapping would fault in every page) and offset to the boundary.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _header(array: np.ndarray) -> bytes:
    """The ``.npy`` 1.0 header of ``array``, padded to exactly :data:`ALIGN` bytes."""
    fields = repr({"descr": np.lib.format.dtype_to_descr(array.dtype),
                   "fortran_order": False, "shape": tuple(array.shape)}).encode("latin1")
    length = ALIGN - len(_MAGIC) - 2
    if len(fields) + 1 > length:
        raise ValueError(f"an array of shape {array.shape} needs a header longer than {ALIGN}")
    return _MAGIC + length.to_bytes(2, "little") + fields.ljust(length - 1) + b"\n"


def _is_aligned(array: np.ndarray) -> bool:
    return array.ctypes.data % ALIGN == 0


def _write_all(fd: int, data: memoryview) -> None:
    for start in range(0, len(data), _CHUNK):
        view = data[start:start + _CHUNK]
        while view:
            view = view[os.write(fd, view):]


class _Refused(Exception):
    """O_DIRECT is refused for this file (platform, file system or driver)."""


@contextlib.contextmanager
def _direct(path: str, flags: int):
    """An fd of ``path`` opened with ``flags | O_DIRECT``, closed on exit. Raises
    :class:`_Refused` when O_DIRECT is unavailable or EINVAL comes at open or during
    the I/O (tmpfs, a block size above ALIGN ...); other errors pass."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        raise _Refused
    try:
        fd = os.open(path, flags | flag, 0o644)
    except OSError as error:
        if error.errno == errno.EINVAL:
            raise _Refused from error
        raise
    try:
        yield fd
    except OSError as error:
        if error.errno == errno.EINVAL:
            raise _Refused from error
        raise
    finally:
        os.close(fd)


def _write_direct(path: str, header: bytes, data: memoryview) -> None:
    """Writes header + data with O_DIRECT (:class:`_Refused` if it cannot)."""
    with _direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) as fd:
        body = len(data) - len(data) % ALIGN
        edge = aligned_empty((2 * ALIGN,), np.uint8)  # header page, then the tail page
        edge[:ALIGN] = np.frombuffer(header, np.uint8)
        _write_all(fd, memoryview(edge)[:ALIGN])
        _write_all(fd, data[:body])
        if body < len(data):
            tail = edge[ALIGN:]
            tail[:len(data) - body] = np.frombuffer(data[body:], np.uint8)
            tail[len(data) - body:] = 0
            _write_all(fd, memoryview(tail))
            os.ftruncate(fd, ALIGN + len(data))
        os.fsync(fd)


def write_npy(path: str, array: np.ndarray) -> tuple[int, int]:
    """Writes ``array`` to ``path`` as an aligned-header ``.npy`` file and fsyncs it;
    returns the file's ``(size, CRC32C)``, computed from memory while the same bytes
    are written (:class:`~trainer.checkpoint.storage.checksums.Running`: in a worker thread for
    arrays of :data:`BACKGROUND_CRC_BYTES` or more; never read back).

    Uses O_DIRECT when ``array`` is C-contiguous and starts on an :data:`ALIGN`
    boundary (see :func:`aligned_empty`) and the file system accepts it; otherwise an
    ordinary buffered write. Runs in the calling thread; ``array`` must not change
    until it returns.
    """
    if not fits_npy(array.dtype):
        raise ValueError(f"a .npy file cannot hold dtype {array.dtype}")
    header = _header(array)
    contiguous = array.flags.c_contiguous
    data = memoryview(np.ascontiguousarray(array)).cast("B")
    with checksums.Running(background=len(data) >= BACKGROUND_CRC_BYTES) as crc:
        crc.feed(header)
        crc.feed(data)  # runs while the bytes go to disk
        if not (contiguous and _is_aligned(array) and _written_direct(path, header, data)):
            with open(path, "wb") as f:
                f.write(header)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        return crc.result()


def _written_direct(path: str, header: bytes, data: memoryview) -> bool:
    """Whether :func:`_write_direct` wrote the file (False: O_DIRECT was refused)."""
    try:
        _write_direct(path, header, data)
        return True
    except _Refused:
        return False


def _read_header(f) -> tuple[tuple[int, ...], np.dtype, int]:
    """``(shape, dtype, data offset)`` from an open ``.npy`` file; ValueError if it is
    not a C-ordered version-1.0 one."""
    version = np.lib.format.read_magic(f)
    if version != (1, 0):
        raise ValueError(f".npy version {version}, expected (1, 0)")
    shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    if fortran:
        raise ValueError("Fortran-ordered data")
    return shape, dtype, f.tell()


def read_npy_header(path: str) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, dtype)`` of the ``.npy`` file at ``path``; ValueError if it is not one."""
    with open(path, "rb") as f:
        shape, dtype, _ = _read_header(f)
    return shape, dtype


def _read_direct(path: str, out: memoryview, size: int, crc: checksums.Running) -> None:
    """Reads ``size`` data bytes (from offset :data:`ALIGN`) into ``out`` (aligned, its
    length rounded up to ALIGN) with O_DIRECT (:class:`_Refused` if it cannot), each
    chunk fed to ``crc`` once read (its CRC runs while the next one is read)."""
    with _direct(path, os.O_RDONLY) as fd:
        done = 0
        while done < size:
            got = os.preadv(fd, [out[done:done + _CHUNK]], ALIGN + done)
            if got <= 0 or (got % ALIGN and done + got < size):
                raise _Refused  # an odd short read: the buffered path reads it all
            crc.feed(out[done:min(done + got, size)])
            done += got


def _read_data(path: str, f, header: bytes, out: memoryview, nbytes: int
               ) -> tuple[int, int]:
    """Reads the ``nbytes`` data bytes of the open file ``f`` into ``out`` (O_DIRECT,
    else buffered); returns the file's ``(size, CRC32C)`` from ``header`` and the bytes
    read, computed while they are read."""
    background = nbytes >= BACKGROUND_CRC_BYTES
    with checksums.Running(background) as crc:
        crc.feed(header)
        try:
            _read_direct(path, out, nbytes, crc)
            return crc.result()
        except _Refused:
            pass
    with checksums.Running(background) as crc:  # the buffered read, from the start
        crc.feed(header)
        f.seek(ALIGN)
        f.readinto(out[:nbytes])
        crc.feed(out[:nbytes])
        return crc.result()


def read_npy(path: str) -> tuple[np.ndarray, tuple[int, int] | None]:
    """The array stored at ``path`` by :func:`write_npy` (page-aligned, read with
    O_DIRECT where possible; any other ``.npy`` through ``np.load``) and the file's
    ``(size, CRC32C)`` computed from the bytes read (None for another ``.npy``: then
    the file must be read again to check it). ValueError naming the file if it is not
    a whole ``.npy`` (wrong magic, truncated data ...)."""
    try:
        with open(path, "rb") as f:
            shape, dtype, offset = _read_header(f)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            size = os.fstat(f.fileno()).st_size
            if size != offset + nbytes:
                raise ValueError(f"{size} bytes, expected {offset + nbytes} for {dtype} "
                                 f"{list(shape)}")
            if offset != ALIGN:
                return np.load(path, allow_pickle=False), None
            f.seek(0)
            header = f.read(ALIGN)  # the file's first bytes, for its CRC
            padded = aligned_empty((nbytes + -nbytes % ALIGN,), np.uint8)
            checksum = _read_data(path, f, header, memoryview(padded), nbytes)
        return padded[:nbytes].view(dtype).reshape(shape), checksum
    except (ValueError, EOFError, SyntaxError) as error:
        raise ValueError(f"{path} is not a readable .npy file: {error}") from error


def fits_npy(dtype: np.dtype) -> bool:
    """Whether a ``.npy`` header names ``dtype`` (not so for ml_dtypes' bfloat16 ...)."""
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    return np.lib.format.descr_to_dtype(descr) == dtype


def _where(mask: Sequence[bool], *lists: Sequence) -> list[list]:
    """Each of ``lists`` reduced to the items where ``mask`` is true."""
    return [[item for item, keep in zip(items, mask) if keep] for items in lists]


def _not(mask: Sequence[bool]) -> list[bool]:
    return [not keep for keep in mask]


def _npy_path(info) -> str:
    """The ``.npy`` file of the orbax ParamInfo ``info``."""
    return os.path.join(os.fspath(info.parent_dir), f"{info.name}.npy")


def _is_local(info) -> bool:
    """Whether ``info``'s directory is on a local file system (not ``gs://`` ...)."""
    return is_local(str(info.parent_dir))


@functools.cache
def _handler_class(ocp):
    """:class:`NpyFileHandler` for the ``orbax.checkpoint`` module ``ocp`` (built once)."""

    class NpyFileHandler(ocp.type_handlers.NumpyHandler):
        """Orbax TypeHandler: each ``np.ndarray`` leaf as ``<item dir>/<name>.npy``.

        ``serialize`` returns a commit future that writes the files (O_DIRECT where
        possible) in orbax's background thread; the arrays must stay unchanged until
        that future is done (no defensive copy is made). Leaves that ``.npy`` cannot
        hold (dtypes numpy only knows through ml_dtypes, e.g. bfloat16) and remote
        paths go through orbax's tensorstore handler. ``deserialize`` reads a leaf's
        ``.npy`` if it exists (ValueError when damaged) and otherwise asks that
        handler (which also reads checkpoints written before this format).

        ``checksummed`` maps each file written or read and not yet claimed
        (:func:`claim`) to its ``(size, CRC32C)``, computed from the bytes written or
        read: the checksum file of the item takes them from there at save, and the
        check of a restore (:func:`trainer.checkpoint.storage.checksums.verify`) at restore.
        """

        def __init__(self):
            super().__init__(deepcopy_host_arrays=False)
            self.checksummed: dict[str, tuple[int, int]] = {}

        _file, _local = staticmethod(_npy_path), staticmethod(_is_local)

        def _stored(self, info) -> bool:
            return self._local(info) and os.path.exists(self._file(info))

        async def _write(self, values, infos) -> None:
            for info in infos:
                await info.await_path_creation()
            for value, info in zip(values, infos):
                path = self._file(info)
                self.checksummed[os.path.normpath(path)] = write_npy(path, value)

        async def serialize(self, values, infos, args=None):
            args = list(args) if args else [ocp.SaveArgs()] * len(values)
            own = [isinstance(v, np.ndarray) and fits_npy(v.dtype) and self._local(info)
                   for v, info in zip(values, infos)]
            futures = []
            if not all(own):
                futures += await super().serialize(*_where(_not(own), values, infos, args))
            if any(own):
                mine, my_infos = _where(own, values, infos)
                futures.append(ocp.future.CommitFutureAwaitingContractedSignals(
                    self._write(mine, my_infos), name="npy_file_handler"))
            return futures

        async def deserialize(self, infos, args=None):
            args = list(args) if args else [ocp.RestoreArgs()] * len(infos)
            stored = [self._stored(info) for info in infos]
            others = iter(await super().deserialize(*_where(_not(stored), infos, args))
                          if not all(stored) else [])
            return [self._read(info) if own else next(others)
                    for info, own in zip(infos, stored)]

        def _read(self, info) -> np.ndarray:
            path = self._file(info)
            array, checksum = read_npy(path)
            if checksum is not None:
                self.checksummed[os.path.normpath(path)] = checksum
            return array

        async def metadata(self, infos):
            stored = [self._stored(info) for info in infos]
            others = iter(await super().metadata(*_where(_not(stored), infos))
                          if not all(stored) else [])
            out = []
            for info, own in zip(infos, stored):
                if not own:
                    out.append(next(others))
                    continue
                shape, dtype = read_npy_header(self._file(info))
                out.append(ocp.metadata.ArrayMetadata(
                    name=info.name, directory=info.parent_dir, shape=shape,
                    sharding=None, dtype=dtype))
            return out

    return NpyFileHandler


def claim(handler, path: str) -> tuple[int, int] | None:
    """``(size, CRC32C)`` of the file the ``NpyFileHandler`` ``handler`` wrote or read
    at ``path`` and no one claimed yet, or None (then the file must be read)."""
    return handler.checksummed.pop(os.path.normpath(path), None)


def npy_file_handler(ocp):
    """A new ``NpyFileHandler``, an orbax TypeHandler built on the ``orbax.checkpoint``
    module ``ocp`` (the caller imports orbax, so this module does not)."""
    return _handler_class(ocp)()
