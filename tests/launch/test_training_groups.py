"""The launchers with the real trainer: digits on local worker groups and on Mirrored.

Each test starts real TensorFlow processes (MultiWorkerMirroredStrategy over loopback,
one CPU device per worker). Final weights come from
``tests.launch_helpers.weights_trainer.WeightsTrainer``; a single process with the same
global batch (64) is the reference (the session fixture ``launcher_reference_weights``).

A broken group must end the launcher by itself: each such test waits for the launcher's
exit with a generous guard (``RUN_S``, a failure to finish, not a speed bound) and checks
the line that says why. How fast it ends is measured by benchmarks, not asserted here.
"""

import glob
import json
import os
import re
import signal

import pytest

from tests.launch_helpers.running import Launch, wait_until_dead
from tests.support.helpers import assert_same_weights, load_weights

CONFIG = "--config=tests/launch_helpers/weights_config.py"
RUN_S = 240  # generous guard for a group to finish (or to fail) on 2 shared cores
LONG = "--config.train.steps=100000"  # a run that is still training when the test acts
# TensorFlow's coordination service catches SIGTERM in multi-worker processes (as a
# preemption notice), so stopped tasks need the SIGKILL after --grace_s. The SIGKILL test
# keeps the default grace (10 s): the defaults end the group; the others save time.
SHORT_GRACE = ["--grace_s", "2"]
PROGRESS = r"^\[worker:0\] .*step \d+/100000"  # the chief (worker:0) logs progress


def multiworker(args, workdir, flags=(), env_extra=None):
    """The launcher with ``args``, then the trainer flags (overrides after --config)."""
    return Launch("launch.multiworker", [*args, CONFIG, f"--workdir={workdir}", *flags],
                  env_extra)


@pytest.mark.parametrize("args, tasks", [
    (["--workers", "2"], ["worker-0", "worker-1"]),
    (["--workers", "4", "--chief"], ["chief-0", "worker-0", "worker-1", "worker-2"]),
])
def test_workers_train_to_the_same_weights_as_one_process(args, tasks, tmp_path,
                                                          launcher_reference_weights):
    run = multiworker(args, tmp_path)
    assert run.finish(RUN_S) == 0, run.output[-6000:]
    assert sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "weights-*.npz"))) \
        == [f"weights-{t}.npz" for t in tasks]
    for task in tasks:
        assert_same_weights(launcher_reference_weights, tmp_path / f"weights-{task}.npz")


def test_mirrored_over_virtual_devices_trains_to_the_same_weights(tmp_path,
                                                                  launcher_reference_weights):
    run = Launch("launch.mirrored", ["--virtual_devices", "2", CONFIG, f"--workdir={tmp_path}"])
    assert run.finish(RUN_S) == 0, run.output[-6000:]
    assert "replicas in sync: 2" in run.output
    assert_same_weights(launcher_reference_weights, tmp_path / "weights-local-0.npz")


def test_sigkill_of_one_of_four_workers_ends_the_group(tmp_path):
    run = multiworker(["--workers", "4"], tmp_path, [LONG])
    run.wait_for(PROGRESS, RUN_S)
    pids = run.task_pids()
    os.kill(pids["worker:2"], signal.SIGKILL)
    code = run.finish(RUN_S)  # by itself: the run had 100,000 steps to go
    assert code != 0
    assert "worker:2 was killed by SIGKILL" in run.output
    assert wait_until_dead(pids.values(), 5) == []


def test_a_stopped_worker_ends_the_group(tmp_path):
    # With the defaults a stopped task is noticed after --frozen_timeout 30 (+ --grace_s
    # 10); shorter values keep the test short.
    run = multiworker(["--workers", "2", "--frozen_timeout", "5", *SHORT_GRACE], tmp_path, [LONG])
    run.wait_for(PROGRESS, RUN_S)
    pids = run.task_pids()
    os.kill(pids["worker:1"], signal.SIGSTOP)
    code = run.finish(RUN_S)  # by itself: the run had 100,000 steps to go
    assert code != 0
    # Whichever notices first ends the group: TensorFlow's coordination service (the
    # peer's collectives fail: "stopped sending heartbeats") or --frozen_timeout.
    assert re.search(r"worker:1 has been stopped \(SIGSTOP/SIGTSTP\)|"
                     r"worker:0 exited with code [1-9]", run.output), run.output[-4000:]
    assert wait_until_dead(pids.values(), 5) == []


def test_a_bad_flag_is_reported_once_before_any_task_starts(tmp_path):
    """The launcher runs trainer.main's checks once (--check_only, no TensorFlow)."""
    run = multiworker(["--workers", "2", *SHORT_GRACE], tmp_path, ["--config.train.stepz=5"])
    code = run.finish(RUN_S)
    assert code == 2, run.output[-4000:]
    assert "[launcher] no task was started" in run.output
    lines = [line for line in run.lines if "stepz" in line]
    assert len(lines) == 1, run.output[-4000:]  # once, by the launcher, not once per task
    assert lines[0].startswith(
        "Usage error: --config.train.stepz=5: config.train has no field 'stepz'. Did you "
        "mean config.train.steps? Fields of config.train: deterministic, "), lines[0]
    assert not any(line.startswith("[worker:") for line in run.lines), run.output[-4000:]
    assert run.task_pids() == {}


def test_a_worker_exiting_at_start_does_not_leave_its_peers_waiting(tmp_path):
    run = multiworker(["--workers", "3", *SHORT_GRACE], tmp_path,
                      ["--config.train.global_batch_size=48"],  # divides over 3 (checked)
                      env_extra={"LAUNCH_TEST_EXIT_AT_START": "worker:1"})
    code = run.finish(RUN_S)  # its peers were stopped, not left to time out
    assert code == 2, run.output[-4000:]
    assert "[worker:1] injected exit at start" in run.output
    assert "worker:1 exited with code 2: stopping the other tasks" in run.output
    assert wait_until_dead(run.task_pids().values(), 5) == []


# A wider digits model: 4.9 MB of gradients cross between the workers, enough for the
# plan to time all-reduce packs (of 2 MiB: half the largest gradient) against one batch.
WIDE = ["--config.model.hidden=16384", "--config.train.steps_per_loop=2",
        "--config.train.log_every_steps=10"]
PACKS = 2 << 20


def test_every_worker_runs_the_plan_the_chief_measured(tmp_path):
    """perf.plan='auto' on 2 workers: both time the candidates on the same steps, the
    chief decides, both run its choice (a plan differing across workers would deadlock
    their collectives), and the run ends normally with the decision recorded."""
    run = multiworker(["--workers", "2"], tmp_path, [
        *WIDE, "--config.train.steps=600", "--config.perf.plan_min_run_s=0",
        "--config.perf.plan_rounds=2"])
    assert run.finish(RUN_S) == 0, run.output[-6000:]
    lines = [line for line in run.output.splitlines() if "plan: " in line]
    assert {line.split("]")[0] for line in lines} == {"[worker:0", "[worker:1"}, lines
    chosen = {re.sub(r"^\[worker:\d\] .*?plan: ", "", line).split(" at step")[0]
              for line in lines}
    assert len(chosen) == 1, lines
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (plan,) = [r for r in records if r.get("kind") == "plan"]
    # No XLA with 2 replicas: steps_per_loop 2 and 4, with and without packs, each trial
    # 2 steps or more (3% of the run over 4 plans x 2 rounds), timed in full calls.
    assert plan["source"] == "measured", plan
    assert [(r["xla"], r["steps_per_loop"], r["pack_bytes"]) for r in plan["plans"]] == [
        ("off", 2, 0), ("off", 2, PACKS), ("off", 4, 0), ("off", 4, PACKS)]
    assert all(r["steps_per_s"] > 0 for r in plan["plans"]), plan
    assert_same_weights(load_weights(tmp_path / "weights-worker-0.npz"),
                        tmp_path / "weights-worker-1.npz")
    # The chief cached it (this test's XDG_CACHE_HOME): a short run in a new workdir
    # adopts it on both workers before its first step (the chief reads, both run it).
    short = multiworker(["--workers", "2"], tmp_path / "short", WIDE)
    assert short.finish(RUN_S) == 0, short.output[-6000:]
    adopted = [line for line in short.output.splitlines() if "plan: " in line]
    assert {line.split("]")[0] for line in adopted} == {"[worker:0", "[worker:1"}, adopted
    (described,) = chosen
    assert all(line.split("plan: ", 1)[1].startswith(f"{described} (measured ")
               and ", cached;" in line for line in adopted), adopted
