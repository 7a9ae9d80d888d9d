"""Elastic by restart: a run preempted on N local workers resumes on M (4 -> 2, 2 -> 4).

Real ``launch.multiworker`` groups (MultiWorkerMirroredStrategy over loopback, one CPU
device per worker) run ``tests.launch_helpers.ids_trainer.IdsTrainer``: 192 example
ids in 4 TFRecord files, a global batch of 16 (12 steps an epoch), 24 steps. Every
task SIGTERMs itself during step 6 (a preemption: checkpoint at step 6, mid-epoch,
exit 143); a group of the other size then resumes in the same workdir (with file
sharding from the local tier's copy of that step: a worker of the larger group holds
none and gets it from worker 0). The record of
the ids each step consumed, and the whole training state, are part of the run's state
(see the helper's docstring). Scenarios run as two waves of parallel launches per
sharding mode (one module fixture each).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.support.helpers import subprocess_env
from tests.launch_helpers.ids_trainer import NUM_IDS, PER_FILE, write_id_files
from tests.launch_helpers.running import REPO, Launch

CONFIG = "--config=tests/launch_helpers/ids_trainer.py"
RUN_S = 400  # generous: up to 7 TensorFlow processes share 2 cores per wave
EXIT_PREEMPTED = 143
STOP = 6  # the preemption lands at the end of the loop of steps 5-6
EPOCH = NUM_IDS // 16
LOCAL_TIER = ["--config.checkpoint.local_every_steps=2", "--config.checkpoint.async_save=False"]
FP16 = ["--config.precision.policy=mixed_float16", "--config.precision.initial_loss_scale=8",
        "--config.precision.growth_interval=4"]


def launch(workers: int, workdir, files, flags, env=None) -> Launch:
    return Launch("launch.multiworker", ["--workers", str(workers), "--grace_s", "2", CONFIG,
                                         f"--workdir={workdir}", f"--config.data.files={files}",
                                         *flags], env)


def single_process(workdir, files, flags) -> subprocess.Popen:
    env = subprocess_env()
    env.pop("TF_CONFIG", None)
    return subprocess.Popen([sys.executable, "-m", "trainer.main", CONFIG, f"--workdir={workdir}",
                             f"--config.data.files={files}", *flags], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def state(workdir, task: str = "worker-0") -> dict:
    with np.load(workdir / f"state-{task}.npz") as f:
        return dict(f)


def elastic_runs(root, files, sharding: str, flags=()) -> dict:
    """Preempted on 4 and on 2 workers, then resumed on 2 and on 4; plus one
    uninterrupted single process. ``{"4to2": (first, second, workdir), ...,
    "reference": workdir}``."""
    flags = [f"--config.data.sharding={sharding}", *flags]
    pairs = {"4to2": (4, 2), "2to4": (2, 4)}
    reference = root / "reference"
    ref_proc = single_process(reference, files, flags)
    first = {name: launch(n, root / name, files, flags, {"ELASTIC_TEST_TERM_AT": str(STOP - 1)})
             for name, (n, _) in pairs.items()}
    codes = {name: run.finish(RUN_S) for name, run in first.items()}
    second = {name: launch(m, root / name, files, flags) for name, (_, m) in pairs.items()}
    for name, run in second.items():
        run.finish(RUN_S)
    out, _ = ref_proc.communicate(timeout=RUN_S)
    assert ref_proc.returncode == 0, out[-4000:]
    for name in pairs:
        assert codes[name] == EXIT_PREEMPTED, first[name].output[-6000:]
        assert second[name].proc.returncode == 0, second[name].output[-6000:]
    return {"reference": reference,
            **{name: (first[name], second[name], root / name) for name in pairs}}


@pytest.fixture(scope="module")
def id_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("id_files")
    write_id_files(str(directory))
    return directory


@pytest.fixture(scope="module")
def batch_sharded(tmp_path_factory, id_files):
    return elastic_runs(tmp_path_factory.mktemp("batch"), id_files, "data")


@pytest.fixture(scope="module")
def file_sharded(tmp_path_factory, id_files):
    # With the local tier: every worker's copy of step 6 (the last of its every-2 local
    # saves) ties the workdir's, so the other worker count resumes from worker 0's.
    return elastic_runs(tmp_path_factory.mktemp("file"), id_files, "file",
                        [*FP16, *LOCAL_TIER])


def consumed(record: np.ndarray) -> np.ndarray:
    """``[steps, global batch]`` example ids from a record (``id + 1``, 0: none)."""
    assert np.all(record >= 1), "a step or position was never consumed"
    return record.astype(np.int64) - 1


def assert_resumed_mid_epoch_on_the_other_count(first, second, workdir, before, after):
    assert f"preempted at step {STOP}" in first.output, first.output[-4000:]
    assert f"written by {before} worker(s), continued on {after}" in second.output
    assert f"resume at step {STOP}: from_workers={before}, to_workers={after}" \
        in second.output, second.output[-4000:]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    resumes = [r for r in records if r["kind"] == "resume"]
    assert [{k: r[k] for k in ("step", "from_workers", "to_workers")} for r in resumes] == [
        {"step": STOP, "from_workers": before, "to_workers": after}]
    assert 0 < STOP % EPOCH  # the change happens inside an epoch


@pytest.mark.parametrize("name, before, after", [("4to2", 4, 2), ("2to4", 2, 4)])
def test_batch_sharded_resume_on_another_worker_count_ends_with_the_uninterrupted_state(
        batch_sharded, name, before, after):
    first, second, workdir = batch_sharded[name]
    assert_resumed_mid_epoch_on_the_other_count(first, second, workdir, before, after)
    want = state(batch_sharded["reference"], "local-0")
    for task in range(after):
        got = state(workdir, f"worker-{task}")
        # The step counter and the optimizer's iterations (so the schedule) continue:
        # exact. Weights, Adam slots, EMA and the rate: up to the all-reduce order.
        assert int(got["step"]) == int(got["step_counter"]) == 24
        assert int(got["opt/0"]) == int(want["opt/0"]) == 24  # adam/iteration
        floats = [k for k in want if k.startswith(("model/", "opt/", "ema/")) or k == "lr"]
        assert len([k for k in floats if k.startswith("ema/")]) == 4
        dw = max(float(np.max(np.abs(got[k] - want[k]))) for k in floats)
        print(f"batch sharding {name} worker-{task}: max|dw| = {dw:.3g}")
        assert dw <= 1e-5, f"{name}: max|dw| {dw}"
        # The same global batches as one uninterrupted process, in the same order.
        np.testing.assert_array_equal(consumed(got["record"]), consumed(want["record"]))


@pytest.mark.parametrize("name, before, after", [("4to2", 4, 2), ("2to4", 2, 4)])
def test_file_sharded_resume_on_another_worker_count_reads_each_example_once_per_epoch(
        file_sharded, name, before, after):
    first, second, workdir = file_sharded[name]
    assert_resumed_mid_epoch_on_the_other_count(first, second, workdir, before, after)
    assert f"resumed from step {STOP} (worker 0's local checkpoint)" in second.output, (
        second.output[-4000:])
    ids = consumed(state(workdir)["record"])
    for epoch in range(ids.shape[0] // EPOCH):
        seen = np.sort(ids[epoch * EPOCH:(epoch + 1) * EPOCH].ravel())
        counts = np.bincount(seen, minlength=NUM_IDS)
        print(f"file sharding {name} epoch {epoch}: {np.sum(counts == 1)} ids once, "
              f"{np.sum(counts == 0)} never, {np.sum(counts > 1)} more than once")
        np.testing.assert_array_equal(seen, np.arange(NUM_IDS))
    # Before and after the change, the global batch is laid out as the interrupted run's
    # file-sharded pipelines produced it: positions [k*b, (k+1)*b) hold ids of the files
    # old pipeline k reads (files k, k+N, ...).
    b = 16 // before
    for k in range(before):
        assert np.all((ids[:, k * b:(k + 1) * b] // PER_FILE) % before == k), (name, k)
    for task in range(1, after):  # every worker holds the same record
        np.testing.assert_array_equal(consumed(state(workdir, f"worker-{task}")["record"]), ids)


@pytest.mark.parametrize("name", ["4to2", "2to4"])
def test_loss_scale_step_and_schedule_continue_across_the_change(file_sharded, name):
    _, _, workdir = file_sharded[name]
    want, got = state(file_sharded["reference"], "local-0"), state(workdir)
    # Dynamic loss scaling doubled the scale every 4 finite steps on both sides of the
    # change (the checkpoint at step 6 holds 2 good steps): with the scale or the good
    # steps restarted it would end 2 or 4 times lower. No step was skipped.
    assert float(got["scale"]) == float(want["scale"]) == 8 * 2 ** (24 // 4)
    assert int(got["good_steps"]) == int(want["good_steps"])
    assert int(got["skipped_steps"]) == int(want["skipped_steps"]) == 0
    assert int(got["opt/0"]) == int(want["opt/0"]) == 24
    assert abs(float(got["lr"]) - float(want["lr"])) < 1e-7 and float(want["lr"]) > 0


def test_a_worker_count_that_does_not_divide_the_global_batch_stops_before_any_step(
        batch_sharded, id_files, tmp_path):
    workdir = tmp_path / "preempted"  # the 4-worker run as it was at its preemption
    shutil.copytree(batch_sharded["4to2"][2] / "checkpoints", workdir / "checkpoints")
    shutil.rmtree(workdir / "checkpoints" / "24")
    run = launch(3, workdir, id_files, ["--config.data.sharding=data"])
    assert run.finish(RUN_S) != 0
    assert ("config.train.global_batch_size=16 is not divisible by 3 replicas; use a "
            "multiple of 3 (e.g. 15 or 18), or run on a number of replicas (workers x "
            "devices per worker) that divides 16.") in run.output, run.output[-4000:]
    assert "resumed from step" not in run.output and "step 2/24" not in run.output
