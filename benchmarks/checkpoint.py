"""Checkpoint cost on a ~50M-parameter model: save / restore times and the training stall.

    python -m benchmarks.checkpoint [--width 2048 --layers 12] [--interval 25] [--rounds 3] [--pairs 8]
                                    [--json benchmarks/results/checkpoint.json]

Model: an MLP of ``layers`` Dense(width) layers (50.4M parameters at the defaults),
Adam (so the saved state is 3x the parameters: weights, two slots), fp32, batch 32,
synthetic in-memory data, one device. Everything runs in ONE process through the
public path: ``Trainer.fit`` with ``config.checkpoint.*``, ``Trainer.restore`` and
(for 1.) ``trainer.checkpoint.service.Checkpointer.save``.

The two array writers are compared through ``config.checkpoint.fast_io``: the
O_DIRECT ``.npy`` files of ``trainer.checkpoint.array_files`` (``fast_io=True``: the "sync" and
"async" arms) and orbax's stock tensorstore handler (``fast_io=False``, the default:
the "async_tensorstore" arm).

1. Save and restore times, median over rounds, for a synchronous save
   (``async_save=False``), an asynchronous one, and an asynchronous one whose arrays
   are written by orbax's stock tensorstore handler: the time the train loop is held
   (snapshot to host + dispatch; all of it for sync), the time until committed, and
   the process CPU until committed (every thread): what one async save can take from a
   training that keeps every core busy (memory-bandwidth and cache effects come on
   top). The timed save starts ``PAUSE_S`` after the previous one, as in a run: a VM
   that returns freed memory to its host has done so by then, which matters for
   page-cache writes. Then a restore of the latest step (read + assign).
2. Training stall of one async save, side by side: each round runs, in rotating order,
   ``fit()`` over ``R = 3`` save intervals of ``interval`` steps with a checkpoint
   every ``interval`` steps (async; async with the arrays written by orbax's stock
   tensorstore handler; sync for contrast)
   and the same ``fit()`` with ``every_steps=0``. Both end with one (waited-for) save, so the difference is
   ``R - 1`` mid-run saves; divided by ``R - 1`` it is the stall of one save, and
   divided by the baseline time of one interval it is the overhead averaged over a
   save interval (the goal: < 2% for async). Differences are paired within a round
   (the arms of one round run back to back) and the median over rounds is reported,
   so a slow drift of the machine between rounds cancels. The process CPU time of the
   same runs is reported too: the extra CPU one save costs.
3. The same stall from adjacent windows of ONE run, which is far less noisy: ``fit()``
   over ``2 * --pairs`` intervals with one logging window per interval and an async
   save every second interval, so windows alternate between "the save's background
   write runs during it" and "clean". The loop time of each such pair differs by the
   CPU the background write took from training; the stall of one save is that
   difference (median over pairs, from ``metrics.jsonl``) plus the time the save held
   the loop (1., measured directly). Run for both array writers; the last lines
   print the ratio of their stalls.
4. The cost of the checksums (``trainer/checkpoint/checksums.py``), per array writer,
   median over rounds, next to a synchronous save and a restore of the same writer
   (checksums included; ``PAUSE_S`` before the save). What the checksums add: for the
   ``.npy`` writer, whose CRC runs in a second thread while the bytes are written or
   read, by pairs: each array's ``write_npy`` against the same O_DIRECT write without
   a CRC, and its ``read_npy`` against the same read without a CRC (back to back,
   alternating which runs first), plus the small files' checksums timed directly; for
   the tensorstore writer, whose finalize step reads every file back and whose check
   reads every file again, the same work timed directly. Also the CRC32C of the arrays
   in memory alone, and in the same rounds the ``.npy`` writer's earlier way: that CRC
   before each write, and a check that reads every file again.
   ``--only checksums`` runs the warm-up and this part alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

INTERVALS_PER_RUN = 3
ARMS = ("async", "async_tensorstore", "sync")  # the arms with saves, besides "baseline"
PAUSE_S = 5.0  # before a timed save: a VM's kernel returns freed memory after ~2 s
SAVES = (("sync", False, False), ("async", True, False),  # (name, async_save, tensorstore)
         ("async_tensorstore", True, True))
WRITERS = ("npy", "tensorstore")  # checkpoint.fast_io True (trainer.checkpoint.array_files); False


def _trainer(args, workdir: str):
    import keras
    import numpy as np
    import tensorflow as tf

    import trainer
    from trainer import config as config_lib

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, args.width)).astype(np.float32)
    y = rng.integers(0, 10, size=(1024,)).astype(np.int32)

    class MLPTrainer(trainer.Trainer):
        def build_model(self):
            layers = [keras.Input((args.width,))]
            layers += [keras.layers.Dense(args.width, activation="relu")
                       for _ in range(args.layers)]
            return keras.Sequential(layers + [keras.layers.Dense(10)])

        def build_train_dataset(self, ctx):
            batch = ctx.get_per_replica_batch_size(self.config.train.global_batch_size)
            return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
                batch, drop_remainder=True)

        def compute_loss(self, batch, outputs):
            return keras.losses.sparse_categorical_crossentropy(batch[1], outputs,
                                                                from_logits=True)

    config = config_lib.get_config()
    config.train.global_batch_size = 32
    config.train.steps_per_loop = args.interval
    config.train.log_every_steps = 10**9
    config.train.steps = 1
    config.optimizer.name = "adam"
    config.distribute.strategy = "one_device"
    config.checkpoint.max_to_keep = 1
    config.checkpoint.fast_io = True  # the .npy writer unless an arm asks for tensorstore
    config.telemetry.progress = "off"
    config.telemetry.probe_every_windows = 0  # no input probes inside the timed windows
    return MLPTrainer(config, workdir)


def _fit(trainer, steps: int, every: int, async_save: bool,
         tensorstore: bool = False) -> tuple[float, float]:
    """Wall and process-CPU seconds of ``fit()`` over ``steps`` more steps; with
    ``tensorstore`` the arrays are written by orbax's stock handler (``fast_io=False``)."""
    cfg = trainer.config
    cfg.train.steps = trainer.step + steps
    cfg.checkpoint.every_steps = every
    cfg.checkpoint.async_save = async_save
    cfg.checkpoint.fast_io = not tensorstore
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit()
    return time.perf_counter() - start, time.process_time() - cpu


def _save_times(trainer, rounds: int) -> dict[str, list[float]]:
    """Per kind of save (:data:`SAVES`): seconds the loop is held, seconds until
    committed, process CPU seconds until committed (all threads); and restore seconds.

    Each save is the second of one ``Checkpointer`` (its host buffers already filled),
    as every save of a run but its first is.
    """
    from trainer.checkpoint.service import Checkpointer

    out: dict[str, list[float]] = {f"{name}_{what}": [] for name, _, _ in SAVES
                                   for what in ("hold_s", "total_s", "cpu_s")}
    out["restore_s"] = []
    for _ in range(rounds):
        _fit(trainer, 1, 0, True)  # one more step (its own save is not timed)
        for name, async_save, tensorstore in SAVES:
            cfg = trainer.config.checkpoint
            cfg.async_save, cfg.fast_io = async_save, not tensorstore
            kind = f"bench_{name}"  # a directory of its own
            # Its store reads checkpoint.async_save / fast_io when it opens a directory.
            saver = Checkpointer(trainer.config, trainer.workdir, trainer.is_chief)
            saver.save(trainer.context, kind=kind, wait=True)  # fills the host buffers
            # So the step saves again: close the store (it remembers the step), delete
            # the step and reopen the directory outside the timed save.
            saver.store.close()
            shutil.rmtree(os.path.join(trainer.workdir, kind, str(trainer.step)))
            if saver.store.has(kind, trainer.step):
                raise RuntimeError(f"step {trainer.step} is still in {kind} after deleting it")
            time.sleep(PAUSE_S)  # the freed pages go back to the host, as between saves
            start, cpu = time.perf_counter(), time.process_time()
            saver.save(trainer.context, kind=kind)
            out[f"{name}_hold_s"].append(time.perf_counter() - start)
            saver.on_fit_end(trainer.context, {})  # waits for the commit, closes the store
            out[f"{name}_total_s"].append(time.perf_counter() - start)
            out[f"{name}_cpu_s"].append(time.process_time() - cpu)
            shutil.rmtree(os.path.join(trainer.workdir, kind))
        start = time.perf_counter()
        trainer.restore(trainer.step)
        out["restore_s"].append(time.perf_counter() - start)
    return out


def _raw_write(path: str, array) -> None:
    """The ``.npy`` writer's O_DIRECT write of ``array`` without any CRC (the arm the
    writer's own ``write_npy`` is paired with)."""
    from trainer.checkpoint import array_files

    array_files._write_direct(path, array_files._header(array), memoryview(array).cast("B"))


def _raw_read(path: str, nbytes: int) -> None:
    """The data of a ``.npy`` file read as its reader does (O_DIRECT into an aligned
    buffer, 64 MB per call) without any CRC."""
    import numpy as np

    from trainer.checkpoint import array_files

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
    from trainer.checkpoint import array_files, checksums

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


def _checksum_cost(trainer, rounds: int) -> dict[str, list[float]]:
    """Per array writer and round (see 4.): a sync save and a restore (checksums
    included), and what the checksums add to each: for the ``.npy`` writer measured by
    pairs (:func:`_npy_checksum_cost`), for the tensorstore writer timed directly (its
    finalize reads every file back; the check reads every file again). Also the CRC32C
    of the arrays in memory alone (the work the ``.npy`` writer overlaps with its I/O)."""
    import numpy as np

    from trainer.checkpoint import checksums, state as checkpoint_state
    from trainer.checkpoint.resume import load
    from trainer.checkpoint.service import Checkpointer

    out: dict[str, list[float]] = {f"{writer}_{what}": [] for writer in WRITERS
                                   for what in ("save_s", "crc_s", "restore_s", "verify_s")}
    out.update(crc_work_s=[], npy_sequential_crc_s=[], npy_reread_check_s=[])
    for _ in range(rounds):
        _fit(trainer, 1, 0, True)  # a new step (its own save is not timed)
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


def _print_checksum_cost(costs: dict[str, list[float]], state_mb: float) -> dict:
    median = {k: statistics.median(v) for k, v in costs.items()}
    print(f"  checksums (CRC32C, google-crc32c), {state_mb:.0f} MB state, median of "
          f"{len(costs['npy_save_s'])} rounds; the CRC32C of the arrays in memory alone "
          f"{median['crc_work_s']:.3f} s:")
    for writer in WRITERS:
        save, crc = median[f"{writer}_save_s"], median[f"{writer}_crc_s"]
        restore, verify = median[f"{writer}_restore_s"], median[f"{writer}_verify_s"]
        median[f"{writer}_crc_pct_of_save"] = 100 * crc / save
        median[f"{writer}_verify_pct_of_restore"] = 100 * verify / restore
        print(f"  {writer:11s} writer: sync save {save:.2f} s, checksums add {crc:.3f} s = "
              f"{100 * crc / save:.1f}% (goal <= 5%; per round "
              f"{[round(x, 3) for x in costs[f'{writer}_crc_s']]}); restore {restore:.2f} s, "
              f"the check adds {verify:.3f} s = {100 * verify / restore:.1f}% (per round "
              f"{[round(x, 3) for x in costs[f'{writer}_verify_s']]})")
    seq, reread = median["npy_sequential_crc_s"], median["npy_reread_check_s"]
    print(f"  npy         writer, the earlier way, same rounds: the CRC before each write "
          f"{seq:.3f} s = {100 * seq / median['npy_save_s']:.1f}% of the save; the check "
          f"reading every file again {reread:.3f} s = "
          f"{100 * reread / median['npy_restore_s']:.1f}% of the restore")
    return {**{f"checksum_{k}": v for k, v in costs.items()},
            **{f"checksum_{k}_median": v for k, v in median.items()}}


def _window_stall(trainer, interval: int, pairs: int, tensorstore: bool) -> list[float]:
    """Per pair of adjacent windows: loop seconds after an async save minus clean."""
    cfg = trainer.config
    period = 2 * interval
    first = trainer.step + interval  # the first save comes after one clean window
    first += -first % period
    _fit(trainer, first - trainer.step, period, True,  # aligned: the next saves at k * period
         tensorstore)
    start = trainer.step
    cfg.train.log_every_steps = interval
    try:
        _fit(trainer, (pairs + 1) * period, period, True, tensorstore)
    finally:
        cfg.train.log_every_steps = 10**9
    seconds = {}
    with open(os.path.join(trainer.workdir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record["kind"] == "train" and record["step"] > start + interval:
                seconds[record["step"]] = record["perf/step_time_mean_s"] * interval
    # The window ending at s + interval follows the save at s (a multiple of period);
    # the window ending at s + period is clean (the write took less than an interval).
    return [seconds[s + interval] - seconds[s + period]
            for s in range(start + period, trainer.step, period)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--interval", type=int, default=25, help="steps between saves")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=8,
                        help="window pairs (after a save / clean) for the one-run estimate")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--only", choices=("all", "checksums"), default="all",
                        help="checksums: the warm-up and part 4 only")
    args = parser.parse_args()
    if args.only == "checksums":
        return _checksums_only(args)

    workdir = tempfile.mkdtemp(prefix="ckpt_bench_")
    try:
        trainer = _trainer(args, workdir)
        _fit(trainer, 2 * args.interval, 0, True)  # warm-up: trace, build, first save
        params = trainer.model.count_params()
        state_bytes = sum(v.numpy().nbytes for v in trainer.model.variables
                          + trainer.optimizer.variables)
        times = _save_times(trainer, args.rounds)

        steps = INTERVALS_PER_RUN * args.interval
        arms = {"baseline": (0, True), "async": (args.interval, True),
                "async_tensorstore": (args.interval, True, True),
                "sync": (args.interval, False)}
        runs: dict[str, list[float]] = {name: [] for name in arms}
        cpu: dict[str, list[float]] = {name: [] for name in arms}
        for r in range(args.rounds):
            names = list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]
            for name in names:
                wall, cpu_s = _fit(trainer, steps, *arms[name])
                runs[name].append(wall)
                cpu[name].append(cpu_s)
        window = {writer: _window_stall(trainer, args.interval, args.pairs, writer == "tensorstore")
                  for writer in WRITERS}
        costs = _checksum_cost(trainer, args.rounds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    median = {k: statistics.median(v) for k, v in {**times, **runs}.items()}
    interval_s = median["baseline"] / INTERVALS_PER_RUN
    saves = INTERVALS_PER_RUN - 1
    result = {
        "params": params, "state_mb": state_bytes / 2**20, "interval_steps": args.interval,
        "step_ms": 1000 * interval_s / args.interval, **{k: median[k] for k in times},
        "rounds": args.rounds, "runs_s": runs, "runs_cpu_s": cpu,
    }
    for name in ARMS:
        stalls = [(t - b) / saves for t, b in zip(runs[name], runs["baseline"])]
        result[f"{name}_stall_s_per_round"] = stalls
        result[f"{name}_stall_s"] = statistics.median(stalls)
        result[f"{name}_stall_pct_of_interval"] = 100 * result[f"{name}_stall_s"] / interval_s
        result[f"{name}_extra_cpu_s_per_save"] = statistics.median(
            (t - b) / saves for t, b in zip(cpu[name], cpu["baseline"]))
    for writer in WRITERS:
        result[f"{writer}_window_contention_s_per_pair"] = window[writer]
        stall = median["async_hold_s"] + statistics.median(window[writer])
        result[f"{writer}_async_window_stall_s"] = stall
        result[f"{writer}_async_window_stall_pct_of_interval"] = 100 * stall / interval_s

    print(f"model: {params / 1e6:.1f}M parameters, saved state {result['state_mb']:.0f} MB "
          f"(weights + Adam slots), step {result['step_ms']:.0f} ms, save every "
          f"{args.interval} steps ({interval_s:.1f} s)")
    print("  one save (not a run's first)   loop held   committed after   process CPU")
    for name, _, _ in SAVES:
        print(f"  {name:30s} {median[f'{name}_hold_s']:7.2f} s {median[f'{name}_total_s']:13.2f} s "
              f"{median[f'{name}_cpu_s']:12.2f} s")
    print(f"  restore (read + assign)  {median['restore_s']:7.2f} s")
    for name in ("async", "async_tensorstore"):
        cpu_s = median[f"{name}_cpu_s"]
        result[f"{name}_cpu_pct_of_interval"] = 100 * cpu_s / interval_s
        print(f"  {name} save's CPU (what it can take from a training that keeps every core "
              f"busy): {cpu_s:.2f} s = {100 * cpu_s / interval_s:.1f}% of the interval")
    print(f"  process CPU of one async save: .npy O_DIRECT writer / orbax tensorstore writer = "
          f"{median['async_cpu_s'] / median['async_tensorstore_cpu_s']:.2f}")
    for name in ARMS:
        print(f"  {name:17s} stall per save {result[f'{name}_stall_s']:5.2f} s = "
              f"{result[f'{name}_stall_pct_of_interval']:5.1f}% of a {args.interval}-step "
              f"interval (goal for async: < 2%); extra CPU per save "
              f"{result[f'{name}_extra_cpu_s_per_save']:.2f} s; per round "
              f"{[round(x, 2) for x in result[f'{name}_stall_s_per_round']]}")
    for writer in WRITERS:
        print(f"  async stall per save, one run, {writer:11s} writer: "
              f"{result[f'{writer}_async_window_stall_s']:.2f} s = "
              f"{result[f'{writer}_async_window_stall_pct_of_interval']:.1f}% of the interval "
              f"(hold {median['async_hold_s']:.2f} s + background-write contention, "
              f"median of {len(window[writer])} window pairs: "
              f"{[round(x, 2) for x in window[writer]]})")
    for method, key in (("side by side", "{}_stall_s"), ("one run", "{}_async_window_stall_s")):
        new, old = (result[key.format(n)] for n in (("async", "async_tensorstore")
                    if method == "side by side" else WRITERS))
        print(f"  async stall, {method}: .npy O_DIRECT writer / orbax tensorstore writer = "
              f"{new:.2f} / {old:.2f} s = {new / old if old > 0 else float('nan'):.2f}")
    print(f"  median of {args.rounds} rounds; fit() times per round: " + ", ".join(
        f"{k} {[round(t, 1) for t in v]}" for k, v in runs.items()))
    result.update(_print_checksum_cost(costs, result["state_mb"]))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def _checksums_only(args) -> None:
    workdir = tempfile.mkdtemp(prefix="ckpt_bench_")
    try:
        trainer = _trainer(args, workdir)
        _fit(trainer, 2 * args.interval, 0, True)  # warm-up: trace, build, first save
        state_mb = sum(v.numpy().nbytes for v in trainer.model.variables
                       + trainer.optimizer.variables) / 2**20
        result = _print_checksum_cost(_checksum_cost(trainer, args.rounds), state_mb)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
