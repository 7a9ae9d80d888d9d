"""One writer per workdir (trainer.checkpoint.guards.lease): a live holder refuses a second run
with one line naming it; a holder that is gone is taken over (at once when its pid is
known dead, after ``lease_s`` without renewal otherwise); a holder whose lease was
taken stops before it saves again. The leases here hold a real file in a real
directory, renewed by their real thread; a second process is a real process."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types

import pytest

from tests.support.helpers import REPO, subprocess_env
from trainer.checkpoint.guards import lease as lease_lib
from trainer.errors import WorkdirError

LEASE_S = 1.2  # renewed every 0.2 s


def run_in(workdir, step: int = 0):
    return types.SimpleNamespace(workdir=str(workdir), step=step)


def holder_file(workdir, holder: lease_lib.Holder) -> None:
    (workdir / lease_lib.FILE).write_text(json.dumps(vars(holder)))


def assert_held_by(workdir, lease: lease_lib.WorkdirLease) -> None:
    """The lease file in ``workdir`` names ``lease``'s holder: this process, now."""
    holder = json.loads((workdir / lease_lib.FILE).read_text())
    assert (holder["host"], holder["pid"], holder["started"]) == (
        socket.gethostname(), os.getpid(), lease.holder.started), holder


class SteppingClock:
    """A monotonic clock for a lease (its ``clock=``) that advances ``step`` seconds at
    each reading; ``readings``: what it returned, in order."""

    def __init__(self, step: float):
        self.step, self.readings = step, []

    def __call__(self) -> float:
        self.readings.append(len(self.readings) * self.step)
        return self.readings[-1]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def held(tmp_path):
    """A lease held on ``tmp_path`` by a first run (released at teardown)."""
    first = lease_lib.WorkdirLease(LEASE_S, chief=True)
    first.on_fit_start(run_in(tmp_path))
    yield first
    first.on_fit_end(run_in(tmp_path), {})


def test_a_second_run_is_refused_while_the_first_renews_naming_it(tmp_path, held, caplog):
    second = lease_lib.WorkdirLease(LEASE_S, chief=True)
    with caplog.at_level(logging.WARNING), pytest.raises(WorkdirError) as refused:
        second.on_fit_start(run_in(tmp_path))
    assert "waiting up to" not in caplog.text  # its pid lives on this host: no wait
    message = str(refused.value)
    assert message.startswith(f"another run is writing to this workdir (host "
                              f"{held.holder.host}, pid {os.getpid()}, started "), message
    assert "Stop that run first" in message and "checkpoint.lease_s=1.2" in message
    assert json.loads((tmp_path / lease_lib.FILE).read_text())["started"] == held.holder.started


def test_a_released_lease_is_taken_at_once_and_removed_at_the_end(tmp_path, held):
    held.on_fit_end(run_in(tmp_path), {})
    assert not (tmp_path / lease_lib.FILE).exists()
    second = lease_lib.WorkdirLease(LEASE_S, chief=True)
    second.on_fit_start(run_in(tmp_path))
    assert json.loads((tmp_path / lease_lib.FILE).read_text())["started"] == second.holder.started
    second.on_fit_end(run_in(tmp_path), {})


def test_the_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path, caplog):
    holder_file(tmp_path, lease_lib.Holder(socket.gethostname(), dead_pid(), time.time() - 60))
    lease = lease_lib.WorkdirLease(30.0, chief=True)
    with caplog.at_level(logging.WARNING):
        lease.on_fit_start(run_in(tmp_path))
    assert "waiting up to" not in caplog.text  # the pid is known dead: taken at once
    assert "Took over the workdir lease" in caplog.text and "that is gone" in caplog.text
    assert_held_by(tmp_path, lease)
    lease.on_fit_end(run_in(tmp_path), {})


def test_another_hosts_lease_not_renewed_is_taken_over_after_lease_s(tmp_path, caplog):
    holder_file(tmp_path, lease_lib.Holder("a-preempted-vm", 4242, time.time() - 600))
    clock = SteppingClock(LEASE_S / 4)  # lease_s passes on its 5th reading
    lease = lease_lib.WorkdirLease(LEASE_S, chief=True, clock=clock)
    with caplog.at_level(logging.WARNING):
        lease.on_fit_start(run_in(tmp_path))
    # It watched the unchanged lease for lease_s by its clock, and took it over only then.
    assert clock.readings[-1] - clock.readings[0] >= LEASE_S, clock.readings
    assert clock.readings[-2] - clock.readings[0] < LEASE_S, clock.readings
    assert "held by host a-preempted-vm, pid 4242" in caplog.text  # said while it waits
    assert "waiting up to 1 s" in caplog.text or "waiting up to 2 s" in caplog.text
    assert "Took over the workdir lease" in caplog.text
    assert_held_by(tmp_path, lease)
    lease.on_fit_end(run_in(tmp_path), {})


def test_an_unreadable_lease_is_taken_over(tmp_path):
    (tmp_path / lease_lib.FILE).write_text("{half a lea")
    lease = lease_lib.WorkdirLease(30.0, chief=True)
    lease.on_fit_start(run_in(tmp_path))
    assert_held_by(tmp_path, lease)
    lease.on_fit_end(run_in(tmp_path), {})
    assert not (tmp_path / lease_lib.FILE).exists()  # released as its own


def test_a_holder_whose_lease_was_taken_stops_before_its_next_save(tmp_path, held):
    taker = lease_lib.Holder("the-other-vm", 7, time.time())
    holder_file(tmp_path, taker)
    deadline = time.monotonic() + 10
    while True:
        try:
            held.on_loop_end(run_in(tmp_path, step=40))
        except WorkdirError as error:
            message = str(error)
            break
        assert time.monotonic() < deadline, "the takeover was never noticed"
        time.sleep(0.05)
    assert message.startswith("another run took over this workdir's lease (host "
                              "the-other-vm, pid 7, started "), message
    assert "it stops at step 40 without saving" in message
    held.on_fit_end(run_in(tmp_path), {})
    assert json.loads((tmp_path / lease_lib.FILE).read_text())["host"] == "the-other-vm"


def test_no_lease_without_a_workdir_off_the_chief_or_when_off(tmp_path):
    for lease in (lease_lib.WorkdirLease(0, chief=True), lease_lib.WorkdirLease(LEASE_S, False)):
        lease.on_fit_start(run_in(tmp_path))
        assert not (tmp_path / lease_lib.FILE).exists()
        lease.on_fit_end(run_in(tmp_path), {})


WEIGHTS_CONFIG = f"--config={REPO}/tests/launch_helpers/weights_config.py"


def test_a_second_process_on_a_running_workdir_is_one_line_and_the_first_goes_on(tmp_path):
    """The launcher tests' digits run, slowed to 0.1 s a step, holds the workdir; the same
    command started again is refused; the first then saves at SIGTERM and releases it."""
    argv = [sys.executable, "-m", "trainer.main", WEIGHTS_CONFIG, f"--workdir={tmp_path}",
            "--config.train.steps=2000", "--config.checkpoint.every_steps=50"]
    first = subprocess.Popen(argv, cwd=REPO, env={**subprocess_env(),
                                                  "LAUNCH_TEST_SLOW_FROM": "0:0.1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / lease_lib.FILE).exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
        time.sleep(0.1)
    second = subprocess.run(argv, cwd=REPO, env=subprocess_env(), capture_output=True,
                            text=True, timeout=300)
    first.send_signal(signal.SIGTERM)
    output, _ = first.communicate(timeout=300)
    assert first.returncode == 143, output[-3000:]
    assert "a checkpoint of that step was saved" in output, output[-3000:]
    assert second.returncode == 1, second.stdout[-3000:] + second.stderr[-3000:]
    lines = second.stderr.strip().splitlines()
    assert re.match(rf"Workdir error: another run is writing to this workdir \(host \S+, "
                    rf"pid {first.pid}, started ", lines[-1]), lines[-1]
    assert "Traceback" not in second.stderr
    assert not (tmp_path / lease_lib.FILE).exists()  # released by the preempted run
