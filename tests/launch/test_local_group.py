"""Specification of ``python -m launch.multiworker``: a local group that lives and dies together.

These tests run the real launcher over ``tests.launch_helpers.fake_worker`` (a scripted
stand-in for trainer.main that starts in milliseconds); the tests that train digits
with trainer.main are in test_launch_multiworker_training.py.
"""

import json
import os
import re
import signal
import socket
import sys

import pytest

from launch import group, local_group, multiworker
from launch.supervision import StopSignals
from tests.launch_helpers.running import Launch, alive, wait_until_dead
from tf_cluster import exit_codes

FAKE = ["--module", "tests.launch_helpers.fake_worker"]
BOUND_S = 60  # the bound: a broken group ends the launcher within 60 s


def launch(args, plan=None):
    return Launch("launch.multiworker", [*FAKE, *args], {"FAKE_PLAN": json.dumps(plan or {})})


def task_argvs(run):
    """The flags each task got, read back from the fake workers' ``started`` lines."""
    return {m.group(1): json.loads(m.group(2))
            for m in re.finditer(r"started (\S+) \d+ (.*)", run.output)}


def test_every_task_runs_with_the_trainer_flags_and_the_multi_worker_strategy():
    run = launch(["--workers", "3", "--config=c.py", "--workdir", "/tmp/w", "--", "--x=1"])
    assert run.finish(BOUND_S) == 0, run.output
    argvs = task_argvs(run)
    assert sorted(argvs) == ["worker:0", "worker:1", "worker:2"]
    for argv in argvs.values():
        assert argv == ["--config=c.py", "--workdir", "/tmp/w", "--x=1",
                        "--config.distribute.strategy=multi_worker"]


def test_each_line_is_prefixed_with_its_task_name():
    run = launch(["--workers", "2", "--chief"])
    assert run.finish(BOUND_S) == 0, run.output
    assert re.search(r"^\[chief:0\] started chief:0 ", run.output, re.M)
    assert re.search(r"^\[worker:0\] worker:0 tick$", run.output, re.M)
    assert re.search(r"^\[worker:0\] worker:0 done$", run.output, re.M)
    assert not re.search(r"^(started|worker:\d tick)", run.output, re.M)


def test_tasks_get_distinct_loopback_addresses_and_their_own_task(monkeypatch):
    monkeypatch.setenv("FAKE_PLAN", "{}")
    specs = group.task_specs(
        local_group.local_cluster(3, True, True, local_group.pick_free_ports(4)),
        "m", ["--config=c.py"], collective_timeout_s=30)
    configs = [json.loads(s.env["TF_CONFIG"]) for s in specs]
    assert [s.name for s in specs] == ["chief:0", "worker:0", "worker:1", "evaluator:0"]
    assert [s.argv[-1] for s in specs] == ["--config.distribute.collective_timeout_s=30"] * 3 \
        + ["--mode=continuous_eval"]
    assert not any(a.startswith("--config.distribute.") for a in specs[3].argv)
    cluster = configs[0]["cluster"]
    addresses = [a for kind in ("chief", "worker", "evaluator") for a in cluster[kind]]
    assert len(set(addresses)) == 4 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert all(c["cluster"] == cluster for c in configs)
    assert [c["task"] for c in configs] == [{"type": "chief", "index": 0},
                                            {"type": "worker", "index": 0},
                                            {"type": "worker", "index": 1},
                                            {"type": "evaluator", "index": 0}]
    assert specs[0].argv[-1] == "--config.distribute.collective_timeout_s=30"


def test_one_task_failing_stops_the_others_and_returns_its_status():
    run = launch(["--workers", "3", "--grace_s", "5"],
                 {"worker:1": {"seconds": 1, "code": 7}, "*": {"seconds": -1}})
    assert run.finish(BOUND_S) == 7, run.output
    assert "worker:1 exited with code 7: stopping the other tasks" in run.output
    assert wait_until_dead(run.all_task_pids(), 5) == []


def test_a_task_killed_from_outside_ends_the_group_with_128_plus_signal():
    run = launch(["--workers", "3"], {"*": {"seconds": -1}})
    run.wait_for(r"\[worker:2\] started", 30)
    os.kill(run.task_pids()["worker:2"], signal.SIGKILL)
    assert run.finish(BOUND_S) == 128 + signal.SIGKILL, run.output
    assert "worker:2 was killed by SIGKILL" in run.output
    assert wait_until_dead(run.all_task_pids(), 5) == []


def test_a_task_that_never_writes_is_declared_hung_after_start_timeout():
    run = launch(["--workers", "2", "--start_timeout", "2"],
                 {"worker:1": {"silent": True}, "*": {"seconds": -1}})
    assert run.finish(BOUND_S) == 124, run.output
    assert "worker:1 wrote nothing within 2 s of its start (--start_timeout)" in run.output
    assert wait_until_dead(run.all_task_pids(), 5) == []


def test_a_silent_group_is_declared_hung_after_hang_timeout():
    run = launch(["--workers", "2", "--hang_timeout", "2"], {"*": {"quiet": True}})
    assert run.finish(BOUND_S) == 124, run.output
    assert "no task wrote anything for 2 s (--hang_timeout): stopping every task" in run.output
    assert wait_until_dead(run.all_task_pids(), 5) == []


def test_one_silent_task_is_not_hung_while_another_writes():
    # In a multi-worker run often only the chief logs progress.
    run = launch(["--workers", "2", "--hang_timeout", "1"],
                 {"worker:1": {"quiet": True}, "worker:0": {"seconds": 3, "code": 5}})
    assert run.finish(BOUND_S) == 5, run.output
    assert "worker:0 exited with code 5" in run.output
    assert "--hang_timeout" not in run.output


def test_a_stopped_task_is_declared_hung_after_frozen_timeout_and_killed():
    run = launch(["--workers", "3", "--frozen_timeout", "2", "--hang_timeout", "0"],
                 {"*": {"seconds": -1}})
    run.wait_for(r"\[worker:1\] started", 30)
    os.kill(run.task_pids()["worker:1"], signal.SIGSTOP)
    assert run.finish(BOUND_S) == 124, run.output
    assert "worker:1 has been stopped (SIGSTOP/SIGTSTP) for 2 s (--frozen_timeout)" in run.output
    assert wait_until_dead(run.all_task_pids(), 5) == []


def test_a_task_ignoring_sigterm_is_killed_after_the_grace_period():
    run = launch(["--workers", "2", "--grace_s", "1"],
                 {"worker:0": {"seconds": 0.5, "code": 1},
                  "worker:1": {"seconds": -1, "ignore_term": True}})
    assert run.finish(BOUND_S) == 1, run.output
    assert "worker:1 still running 1 s after SIGTERM: sending SIGKILL" in run.output
    assert wait_until_dead(run.all_task_pids(), 5) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_every_task(sig):
    run = launch(["--workers", "2"], {"*": {"seconds": -1}})
    run.wait_for(r"\[worker:1\] started", 30)
    run.wait_for(r"\[worker:0\] started", 30)
    pids = run.all_task_pids()
    run.proc.send_signal(sig)
    assert run.finish(BOUND_S) == 128 + sig, run.output
    assert f"received {signal.Signals(sig).name}: stopping every task" in run.output
    assert wait_until_dead(pids, 5) == []


def test_tasks_die_with_a_sigkilled_launcher():
    # "quiet" tasks write nothing more, so they cannot die of a broken pipe instead.
    run = launch(["--workers", "2"], {"*": {"quiet": True}})
    run.wait_for(r"\[worker:1\] started", 30)
    pids = run.all_task_pids()
    run.proc.kill()
    run.finish(10)
    assert wait_until_dead(pids, 10) == []


def test_max_restarts_restarts_the_group_after_a_crash(tmp_path):
    marker = tmp_path / "crashed"
    run = launch(["--workers", "2", "--max_restarts", "1", "--workdir", str(tmp_path)],
                 {"worker:1": {"crash_once": str(marker)}})
    assert run.finish(BOUND_S) == 0, run.output
    assert marker.exists()
    assert ("worker:1 exited with code 3; restarting the whole group (restart 1 of 1); the "
            f"trainer resumes from the latest checkpoint in {tmp_path} if there is one"
            ) in run.output
    assert len(run.all_task_pids()) == 4
    assert run.output.count("[worker:1] worker:1 done") == 1


def test_a_preempted_task_restarts_the_group_without_using_a_restart(tmp_path):
    marker = tmp_path / "preempted"
    run = launch(["--workers", "2", "--max_restarts", "1"],
                 {"worker:1": {"crash_once": str(marker), "crash_code": exit_codes.EXIT_PREEMPTED},
                  "worker:0": {"code": 5}})
    # The preemption restart is free, so worker:0's failure still gets its one restart.
    assert run.finish(BOUND_S) == 5, run.output
    assert "preempted after saving a checkpoint; restarting" in run.output
    assert "restart 1 of 1" in run.output
    assert len(run.all_task_pids()) == 6


def test_a_lost_peer_restarts_the_group_and_counts_as_a_restart(tmp_path):
    marker = tmp_path / "lost-once"
    run = launch(["--workers", "2", "--max_restarts", "1"],
                 {"worker:1": {"crash_once": str(marker), "crash_code": exit_codes.EXIT_PEER_LOST},
                  "*": {"seconds": 1}})
    assert run.finish(BOUND_S) == 0, run.output
    assert "worker:1 exited with code 170; restarting the whole group (restart 1 of 1; a " \
           "lost peer counts)" in run.output
    assert len(run.all_task_pids()) == 4


def test_preemption_exit_code_matches_the_trainer():
    from trainer.checkpoint.guards import preemption

    assert exit_codes.EXIT_PREEMPTED == preemption.EXIT_PREEMPTED == 143


def test_restarts_are_bounded_by_max_restarts():
    run = launch(["--workers", "2", "--max_restarts", "2"], {"worker:0": {"code": 4}})
    assert run.finish(BOUND_S) == 4, run.output
    assert "restart 2 of 2" in run.output
    assert "giving up after 2 restart(s): worker:0 exited with code 4" in run.output
    assert len(run.all_task_pids()) == 6


def test_the_evaluator_runs_continuous_eval_alone_and_the_group_waits_for_it():
    run = launch(["--workers", "2", "--evaluator", "--config=c.py"],
                 {"evaluator:0": {"seconds": 3}, "*": {"seconds": 0.2}})
    assert run.finish(BOUND_S) == 0, run.output
    argvs = task_argvs(run)
    assert argvs["evaluator:0"] == ["--config=c.py", "--mode=continuous_eval"]
    assert argvs["worker:1"] == ["--config=c.py", "--config.distribute.strategy=multi_worker"]
    # The training tasks finished long before; the group still let the evaluator finish.
    assert run.output.rindex("[evaluator:0] evaluator:0 done") \
        > run.output.rindex("[worker:0] worker:0 done"), run.output
    assert wait_until_dead(run.all_task_pids(), 5) == []


def test_a_failing_evaluator_fails_the_group():
    run = launch(["--workers", "2", "--evaluator"], {"evaluator:0": {"code": 1},
                                                     "*": {"seconds": -1}})
    assert run.finish(BOUND_S) == 1, run.output
    assert "evaluator:0 exited with code 1" in run.output
    assert wait_until_dead(run.all_task_pids(), 5) == []


def test_mode_is_refused_in_the_flags():
    run = launch(["--workers", "2", "--evaluator", "--mode=eval"])
    assert run.finish(BOUND_S) == 2, run.output
    assert "--mode is set per task" in run.output


def test_a_taken_port_restarts_the_group_on_new_ports(monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("FAKE_PLAN", json.dumps({"*": {"bind": True}}))
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        picks = []

        def pick(count):
            ports = local_group.pick_free_ports(count)
            if not picks:
                ports[1] = taken.getsockname()[1]
            picks.append(ports)
            return ports

        args = multiworker.parse([*FAKE, "--workers", "2"])
        with StopSignals() as stop:
            code = local_group.run_local_group(args, stop, lambda m: print(m, file=sys.stderr),
                                               pick_ports=pick)
    err = capfd.readouterr().err
    assert code == 0, err
    assert len(picks) == 2
    assert "worker:1's port was taken before it could bind; restarting the group on new ports" \
        in err


@pytest.mark.parametrize("args, message", [
    ([], "--workers N"),
    (["--workers", "0"], "--workers N"),
    (["--workers", "2", "--config.distribute.strategy=mirrored"], "set by this launcher"),
    (["--workers", "2", "--hosts", "10.0.0.1:1"], "add --emit tf_config"),
    (["--workers", "2", "--grace_s", "0"], "grace_s=0.0 must be > 0"),
    (["--workers", "2", "--max_restarts", "-1"], "--max_restarts=-1 must be >= 0"),
])
def test_usage_errors_exit_2_with_the_reason(args, message, capsys):
    assert multiworker.main(args) == 2
    assert message in capsys.readouterr().err


def test_a_dead_child_is_reaped_not_left_as_a_zombie():
    run = launch(["--workers", "2"], {"worker:0": {"code": 2}, "*": {"seconds": -1}})
    assert run.finish(BOUND_S) == 2
    assert not any(alive(pid) for pid in run.all_task_pids())
