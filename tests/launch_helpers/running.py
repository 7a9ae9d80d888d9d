"""Run a launcher as a subprocess and watch its output and its children's PIDs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] != b"Z"


def wait_until_dead(pids, timeout: float) -> list[int]:
    """Waits up to ``timeout`` s for every pid to be gone; returns those still alive.

    Survivors are then SIGKILLed, so a failing test leaves no orphan behind.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return []
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def task_pids(lines: list[str]) -> dict[str, int]:
    """``{"worker:1": pid}`` from a launcher's latest ``[launcher] pids:`` line in its
    output ``lines``."""
    pids = {}
    for line in list(lines):
        if line.startswith("[launcher] pids: "):
            pids = dict(item.split("=") for item in line.split(": ", 1)[1].split())
    return {name: int(pid) for name, pid in pids.items()}


class Launch:
    """``python -m MODULE ARGS`` with stdout+stderr collected line by line."""

    def __init__(self, module: str, args, env_extra=None, cwd: str = REPO):
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        env.update(env_extra or {})
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], env=env, cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            with self._cond:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """Waits for a line matching ``pattern``; fails the test with the output if none."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    match = regex.search(line)
                    if match:
                        return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no line matching {pattern!r} within {timeout} s; "
                                         f"output:\n{self.output[-6000:]}")
                self._cond.wait(min(left, 0.5))

    def task_pids(self) -> dict[str, int]:
        """``{"worker:1": pid}`` from the launcher's latest ``[launcher] pids:`` line."""
        return task_pids(self.lines)

    def all_task_pids(self) -> list[int]:
        """Every PID the launcher reported, over all group (re)starts."""
        return [int(item.split("=")[1]) for line in list(self.lines)
                if line.startswith("[launcher] pids: ")
                for item in line.split(": ", 1)[1].split()]

    def finish(self, timeout: float) -> int:
        """Waits for the launcher to exit (kills it and fails if it takes longer)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"launcher still running after {timeout} s; output:\n"
                                 f"{self.output[-6000:]}") from None
        self._reader.join(10)
        self.elapsed = time.monotonic() - self.started
        return code
