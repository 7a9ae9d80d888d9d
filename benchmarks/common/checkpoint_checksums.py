"""Part 4 of ``benchmarks/checkpoints/checkpoint.py``: what the CRC32C checksums of a
checkpoint cost.

Per array writer, median over rounds, next to a synchronous save and a restore of the
same writer (checksums included; ``PAUSE_S`` before the save). For the ``.npy`` writer,
whose CRC runs in a second thread while the bytes are written or read: by pairs, each
array's ``write_npy`` against the same O_DIRECT write without a CRC and its ``read_npy``
against the same read without a CRC (back to back, alternating which runs first), plus
the small files' checksums timed directly; in the same rounds, the earlier way (the CRC
of each array before its write; a check reading every file again). For the tensorstore
writer, whose finalize step reads every file back and whose check reads every file
again: that work timed directly.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from typing import Callable

from benchmarks.common.table import Row, format_table

PAUSE_S = 5.0  # before a timed save: a VM's kernel returns freed memory after ~2 s
WRITERS = ("npy", "tensorstore")  # checkpoint.fast_io True (trainer.checkpoint.storage.array_files); False


def _raw_write(path: str, array) -> None:
    """The ``.npy`` writer's O_DIRECT write of ``array`` without any CRC (the arm the
    writer's own ``write_npy`` is paired with)."""
    from trainer.checkpoint.storage import array_files

    array_files._write_direct(path, array_files._header(array), memoryview(array).cast("B"))


def _raw_read(path: str, nbytes: int) -> None:
    """A ``.npy`` file read as its reader does (its header parsed, then the data with
    O_DIRECT into an aligned buffer, 64 MB per call) without any CRC."""
    import numpy as np

    from trainer.checkpoint.storage import array_files

    array_files.read_npy_header(path)
    align = array_files.ALIGN
    out = memoryview(array_files.aligned_empty((nbytes + -nbytes % align,), np.uint8))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [out[done:done + 64 * 2**20]], align + done)
            if got <= 0:
                break
            done += got
    finally:
        os.close(fd)


def _paired(first, second, flip: bool) -> tuple[float, float]:
    """Seconds of ``first()`` and ``second()``, run back to back (``second`` first when
    ``flip``)."""
    times = {}
    for name, fn in ((("b", second), ("a", first)) if flip else (("a", first), ("b", second))):
        start = time.perf_counter()
        fn()
        times[name] = time.perf_counter() - start
    return times["a"], times["b"]


def _npy_checksum_cost(step_dir: str, state: dict, scratch: str
                       ) -> tuple[float, float, float]:
    """Seconds the checksums add to a ``.npy`` save and to its restore, and of the
    small files' part of the save's (the third value), measured on
    ``step_dir`` (a sync ``.npy`` save of ``state``): per array, ``write_npy`` (its CRC
    computed while writing) paired with the same O_DIRECT write without a CRC, and
    ``read_npy`` (its CRC computed while reading) paired with the same read without a
    CRC (alternating which runs first); plus the rest of the work, timed: the checksum
    tables of both items at save (the small files read back), the check of the step
    with the arrays' CRCs from the read (the small files read) at restore."""
    from trainer.checkpoint.storage import array_files, checksums

    save = restore = 0.0
    written, read = {}, {}
    arrays = [(f"{group}.{i}.npy", a) for group, items in state.items()
              for i, a in enumerate(items)]
    for n, (name, array) in enumerate(arrays):
        path = os.path.join(scratch, name)
        stored = os.path.join(step_dir, "state", name)
        with_crc, raw = _paired(lambda: written.update({stored: array_files.write_npy(
            path, array)}), lambda: _raw_write(path + ".raw", array), n % 2 == 1)
        save += with_crc - raw
        with_crc, raw = _paired(lambda: read.update({stored: array_files.read_npy(
            stored)[1]}), lambda: _raw_read(stored, array.nbytes), n % 2 == 1)
        restore += with_crc - raw
    start = time.perf_counter()
    checksums.write(os.path.join(step_dir, "state"), written.get)  # rewrites the same table
    checksums.write(os.path.join(step_dir, "manifest"))
    small = time.perf_counter() - start
    start = time.perf_counter()
    checksums.verify(step_dir, read.get)
    restore += time.perf_counter() - start
    return save + small, restore, small


def cost(trainer, rounds: int, fit: Callable) -> dict[str, list[float]]:
    """Per array writer and round: a sync save and a restore (checksums
    included), and what the checksums add to each: for the ``.npy`` writer measured by
    pairs (:func:`_npy_checksum_cost`), for the tensorstore writer timed directly (its
    finalize reads every file back; the check reads every file again). Also the CRC32C
    of the arrays in memory alone (the work the ``.npy`` writer overlaps with its I/O)."""
    import numpy as np

    from trainer.checkpoint.storage import checksums
    from trainer.checkpoint import state as checkpoint_state
    from trainer.checkpoint.resume import load
    from trainer.checkpoint.service import Checkpointer

    out: dict[str, list[float]] = {f"{writer}_{what}": [] for writer in WRITERS
                                   for what in ("save_s", "crc_s", "restore_s", "verify_s")}
    out.update(crc_work_s=[], npy_sequential_crc_s=[], npy_reread_check_s=[])
    for _ in range(rounds):
        fit(trainer, 1, 0, True)  # a new step (its own save is not timed)
        groups = checkpoint_state.state_variables(trainer.context)
        for writer in WRITERS:
            cfg = trainer.config.checkpoint
            cfg.async_save, cfg.fast_io = False, writer == "npy"
            kind = f"bench_crc_{writer}"
            saver = Checkpointer(trainer.config, trainer.workdir, trainer.is_chief)
            time.sleep(PAUSE_S)
            start = time.perf_counter()
            saver.save(trainer.context, kind=kind, wait=True)
            out[f"{writer}_save_s"].append(time.perf_counter() - start)
            saver.on_fit_end(trainer.context, {})
            step_dir = os.path.join(trainer.workdir, kind, str(trainer.step))
            start = time.perf_counter()
            checkpoint_state.assign(groups, load(step_dir, groups)[0])  # read, check, assign
            out[f"{writer}_restore_s"].append(time.perf_counter() - start)
            if writer == "npy":
                state, _ = checkpoint_state.snapshot(trainer.context)
                scratch = os.path.join(trainer.workdir, "bench_crc_scratch")
                os.makedirs(scratch)
                save, restore, small = _npy_checksum_cost(step_dir, state, scratch)
                shutil.rmtree(scratch)
                start = time.perf_counter()
                checksums.verify(step_dir)  # every file read again: the earlier check
                out["npy_reread_check_s"].append(time.perf_counter() - start)
            else:
                start = time.perf_counter()
                for item in ("state", "manifest"):  # as the finalize step does
                    checksums.write(os.path.join(step_dir, item))
                save = time.perf_counter() - start
                start = time.perf_counter()
                checksums.verify(step_dir)
                restore = time.perf_counter() - start
            out[f"{writer}_crc_s"].append(save)
            out[f"{writer}_verify_s"].append(restore)
            shutil.rmtree(os.path.join(trainer.workdir, kind))
        start = time.perf_counter()
        for arrays in state.values():
            for array in arrays:
                checksums.extend(0, np.ascontiguousarray(array))
        out["crc_work_s"].append(time.perf_counter() - start)
        # the earlier .npy writer: the CRC of each array in memory before its write
        out["npy_sequential_crc_s"].append(out["crc_work_s"][-1] + small)
    return out


def report(costs: dict[str, list[float]], state_mb: float) -> dict:
    """Prints the medians of :func:`cost` (and the earlier way's); returns them all."""
    median = {k: statistics.median(v) for k, v in costs.items()}
    rows = []
    for writer in WRITERS:
        save, crc = median[f"{writer}_save_s"], median[f"{writer}_crc_s"]
        restore, verify = median[f"{writer}_restore_s"], median[f"{writer}_verify_s"]
        median[f"{writer}_crc_pct_of_save"] = 100 * crc / save
        median[f"{writer}_verify_pct_of_restore"] = 100 * verify / restore
        rows += [Row(f"{writer} writer: sync save", save, "s"),
                 Row(f"{writer} writer: checksums add", crc, "s",
                     note=f"{100 * crc / save:.1f}% of the save (goal <= 5%); per round "
                          f"{[round(x, 3) for x in costs[f'{writer}_crc_s']]}"),
                 Row(f"{writer} writer: restore", restore, "s"),
                 Row(f"{writer} writer: the check adds", verify, "s",
                     note=f"{100 * verify / restore:.1f}% of the restore; per round "
                          f"{[round(x, 3) for x in costs[f'{writer}_verify_s']]}")]
    seq, reread = median["npy_sequential_crc_s"], median["npy_reread_check_s"]
    rows += [Row("npy writer, the earlier way: the CRC before each write", seq, "s",
                 note=f"{100 * seq / median['npy_save_s']:.1f}% of the save, same rounds"),
             Row("npy writer, the earlier way: the check reading every file again", reread,
                 "s", note=f"{100 * reread / median['npy_restore_s']:.1f}% of the restore"),
             Row("the CRC32C of the arrays in memory alone", median["crc_work_s"], "s")]
    print(format_table(f"checkpoint checksums (CRC32C, google-crc32c), {state_mb:.0f} MB "
                       f"state, median of {len(costs['npy_save_s'])} rounds", rows))
    return {**{f"checksum_{k}": v for k, v in costs.items()},
            **{f"checksum_{k}_median": v for k, v in median.items()}}
