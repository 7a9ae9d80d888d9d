"""A multi-worker group whose peer dies, or whose tasks do not share the workdir.

Real ``trainer.main`` processes (``tests.support.run_checkpoint``: the toy Trainer with fault
injection) joined by a hand-written TF_CONFIG on loopback ports, as on separate hosts.

* A task SIGKILLed mid-training: every survivor ends with ONE line naming the lost
  task and its TF_CONFIG address, the step and the last checkpoint, exit status 170
  (retryable), no traceback unless asked for.
* Tasks given different workdirs (a node-local path on each "host"): every task ends
  non-zero in bounded time with one message naming the task and the path.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time

import pytest

from tests.support.helpers import REPO, free_loopback_ports, last_lines, subprocess_env

EXIT_PEER_LOST = 170  # documented in README ("Exit codes"), checked literally
HANG_S = 300  # a group that has not ended by then hangs: the test fails
CONFIG = f"--config={REPO / 'tests' / 'support' / 'run_checkpoint.py'}"


def _start_group(tmp_path, workers: int, workdirs: list[str], flags=(), env=None) -> list:
    """One process per task of a ``worker`` cluster on loopback; outputs in tmp_path."""
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_loopback_ports(workers)]}
    procs = []
    for index in range(workers):
        task_env = subprocess_env()
        task_env.update({"TF_CONFIG": json.dumps({"cluster": cluster, "task": {
            "type": "worker", "index": index}}), "CKPT_TEST_OUT": str(tmp_path),
            **(env or {}).get(index, {})})
        log = open(tmp_path / f"task-{index}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.support.run_checkpoint", CONFIG,
             f"--workdir={tmp_path / workdirs[index]}",
             "--config.distribute.strategy=multi_worker", *flags],
            cwd=REPO, env=task_env, stdout=log, stderr=subprocess.STDOUT))
    return procs, cluster


def _wait_group(procs: list) -> list[float]:
    """Waits for every process; returns each one's exit time (time.monotonic)."""
    ended = [None] * len(procs)
    deadline = time.monotonic() + HANG_S
    while None in ended:
        for i, proc in enumerate(procs):
            if ended[i] is None and proc.poll() is not None:
                ended[i] = time.monotonic()
        if time.monotonic() > deadline:
            for proc in procs:
                proc.kill()
            raise AssertionError(f"the group did not end within {HANG_S} s (a hang)")
        time.sleep(0.05)
    return ended


def test_a_killed_worker_ends_every_survivor_with_one_line_naming_it_and_exit_170(tmp_path):
    # Worker 2 SIGKILLs itself during step 13 (loop of steps 11-15; checkpoint at 10).
    # Worker 1 asks for tracebacks: the line stays last, the traceback comes before it.
    procs, cluster = _start_group(
        tmp_path, 3, ["workdir"] * 3, ["--config.train.global_batch_size=30"],
        env={i: {"CKPT_TEST_ACTION": "worker:2:kill:12"} for i in range(3)}
        | {1: {"CKPT_TEST_ACTION": "worker:2:kill:12", "TF_TRAINER_TRACEBACK": "1"}})
    ended = _wait_group(procs)
    outputs = [(tmp_path / f"task-{i}.log").read_text() for i in range(3)]
    assert procs[2].returncode == -9, outputs[2][-3000:]
    assert "injected kill of worker-2" in outputs[2]
    for i in (0, 1):
        assert procs[i].returncode == EXIT_PEER_LOST, outputs[i][-3000:]
        last = last_lines(outputs[i], 1)
        assert last.startswith(f"Lost peer: worker:2 ({cluster['worker'][2]}) stopped "
                               f"responding during training at step 10; the run cannot "
                               f"continue without it. The last checkpoint is step 10: "
                               f"restart the group (exit status 170 is retryable)."), last
    assert "Traceback" not in outputs[0]
    assert "Traceback" in outputs[1]
    print(f"\nkill -> survivors' exit: {ended[0] - ended[2]:.2f} s, {ended[1] - ended[2]:.2f} s")


def test_workers_without_a_shared_workdir_all_end_with_one_message_naming_task_and_path(
        tmp_path):
    procs, cluster = _start_group(
        tmp_path, 2, ["node-0", "node-1"], ["--config.checkpoint.shared_workdir_timeout_s=3"])
    started = time.monotonic()
    ended = _wait_group(procs)
    outputs = [(tmp_path / f"task-{i}.log").read_text() for i in range(2)]
    chief, worker = cluster["worker"]
    for i in (0, 1):
        assert procs[i].returncode == 1, outputs[i][-3000:]
        assert "Traceback" not in outputs[i]
    assert last_lines(outputs[1], 1).startswith(
        f"Workdir error: --workdir={tmp_path / 'node-1'} is not shared with the chief: "
        f"worker:1 ({worker}) did not see the file .cluster-"), outputs[1][-3000:]
    assert f"that the chief (worker:0, {chief}) wrote there within 3 s" in outputs[1]
    assert last_lines(outputs[0], 1).startswith(
        f"Workdir error: --workdir={tmp_path / 'node-0'} is not shared by every task: "
        f"worker:1 ({worker}) did not see the file .cluster-"), outputs[0][-3000:]
    assert not list((tmp_path / "node-0").glob(".cluster-*"))  # the chief cleaned up
    assert not (tmp_path / "node-1").exists()  # the worker wrote nothing
    check = next(line for line in outputs[1].splitlines()
                 if "checking that every task sees the workdir" in line)
    checked_at = datetime.datetime.strptime(check.split()[1], "%H:%M:%S.%f").time()
    ended_at = datetime.datetime.now() - datetime.timedelta(seconds=time.monotonic() - max(ended))
    print(f"\ncheck start -> last task's exit: "
          f"{(ended_at - datetime.datetime.combine(ended_at.date(), checked_at)).total_seconds():.2f} s"
          f" (process start -> exit {max(ended) - started:.2f} s)")


def test_the_shared_workdir_timeout_must_be_a_number_of_seconds_at_least_0():
    from trainer import config as config_lib

    for bad in (-1.0, -0.5):  # ml_collections itself refuses a non-number
        config = config_lib.get_config()
        config.checkpoint.shared_workdir_timeout_s = bad
        with pytest.raises(config_lib.ConfigError, match=r"config\.checkpoint\."
                                                         r"shared_workdir_timeout_s=.* must be "
                                                         r"a number of seconds >= 0"):
            config_lib.validate(config)
    config = config_lib.get_config()
    config.checkpoint.shared_workdir_timeout_s = 0  # off
    config_lib.validate(config)
