"""Simulated hosts for tests: network namespaces on a private bridge of this machine.

:class:`SimulatedCluster` drives ``tests/cluster/netns_hosts.sh`` (which owns the
layout: names, addresses, disks; see its header) and runs commands on its hosts. Every
host is a :class:`Host`: its own address on a private /24, its own node-local HOME /
TFDS_DATA_DIR / TMPDIR, and the one shared directory :attr:`SimulatedCluster.shared`.

Contracts:

* Commands run on a host through :meth:`SimulatedCluster.popen` / :meth:`run` (or any
  ``subprocess`` call on :meth:`SimulatedCluster.wrap`'s argv) see that host's network
  only, its hostname (``socket.gethostname() == host.name``), its node-local HOME,
  TFDS_DATA_DIR and TMPDIR (set by the script; an ``env`` given here cannot change them),
  ``CLUSTER_HOST=<name>``, the repository on PYTHONPATH and this interpreter's directory
  first on PATH (``python`` is this virtualenv's). TF_CONFIG and SLURM_* of the calling
  process are not passed on.
* Processes started by :meth:`popen` get a session of their own; :meth:`cleanup` kills
  those sessions (SIGKILL) and heals every host: the per-test fixture calls it.
* Everything here needs root; :func:`cluster_problem` says why a machine cannot run it.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, NamedTuple, Sequence

from tests.support.helpers import REPO

SCRIPT = Path(__file__).resolve().with_name("netns_hosts.sh")
DEFAULT_NAME = "tfsim"
DEFAULT_SUBNET = "10.213.7"
DEFAULT_DIR = Path("/tmp/tfsim-cluster")


class ClusterError(RuntimeError):
    """The simulated cluster could not be set up, changed or torn down (message says why)."""


@dataclass(frozen=True)
class Host:
    """One simulated machine. ``name`` is its namespace, hostname and /etc/hosts name."""

    name: str
    address: str
    home: Path
    tfds_data_dir: Path
    scratch: Path

    def __str__(self) -> str:
        return self.name


class HostProcess(NamedTuple):
    """A process found in a host's network namespace."""

    host: str
    pid: int
    program: str  # /proc/PID/comm: the executable's name, at most 15 characters
    command: str


class Watched:
    """A :meth:`SimulatedCluster.popen` process (text output) read line by line as it
    runs, by a thread, so that a test can act on a line mid-run.

    ``lines`` grows as the process writes (``timed_lines``: the same with the
    ``time.monotonic()`` each was read at); ``exited_at`` is the ``time.monotonic()`` at
    which the process was seen to exit (None while it runs), at most ~0.1 s late.
    """

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: list[str] = []
        self.timed_lines: list[tuple[float, str]] = []
        self.exited_at: float | None = None
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self.timed_lines.append((time.monotonic(), self.lines[-1]))
                self._cond.notify_all()
        self.proc.wait()
        with self._cond:
            self.exited_at = time.monotonic()
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    @property
    def where(self) -> str:
        """``ARGV on HOST`` (for messages)."""
        return f"{' '.join(map(str, self.proc.args[3:]))} on {self.proc.args[2]}"

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """Waits for a line matching ``pattern`` (re.search); fails with the output if the
        process ends or ``timeout`` s pass first."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if match := regex.search(line):
                        return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or self.exited_at is not None:
                    raise AssertionError(f"no line matching {pattern!r} within {timeout} s from "
                                         f"{self.where}; output:\n{self.output[-6000:]}")
                self._cond.wait(min(left, 0.5))

    def finish(self, timeout: float) -> int:
        """Waits for the process to exit and its output to be read; returns its status.
        After ``timeout`` s its session is SIGKILLed and :class:`ClusterError` raised."""
        self._reader.join(timeout)
        if self._reader.is_alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self._reader.join()
            raise ClusterError(f"{self.where} did not finish in {timeout} s; output:\n"
                               f"{self.output[-6000:]}")
        return self.proc.returncode


def cluster_problem() -> str | None:
    """Why this machine cannot run simulated hosts (not root, no iproute2), or None.

    A None does not promise that ``up`` works (a container may forbid namespaces):
    :meth:`SimulatedCluster.up` then raises :class:`ClusterError` with the reason.
    """
    if os.geteuid() != 0:
        return (f"not root (uid {os.geteuid()}): simulated hosts are network namespaces, "
                f"which need root; run the tests as root (CI does) or `sudo {SCRIPT} up 2`")
    missing = [tool for tool in ("ip", "nsenter", "unshare", "hostname")
               if not any(os.access(os.path.join(d, tool), os.X_OK)
                          for d in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/sbin", "/sbin"])]
    if missing:
        return f"{', '.join(missing)} not found: apt-get install iproute2 util-linux hostname (tests/cluster/netns_hosts.sh installs iproute2)"
    return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] != b"Z"


def _read_proc(pid: int, name: str) -> str:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


class SimulatedCluster:
    """``hosts`` simulated hosts plus a head node (``name``-head) on ``subnet``.0/24.

    ``name``, ``subnet`` and ``root`` must differ from any other cluster running at the
    same time (namespaces and the bridge are machine-wide). Call :meth:`up` first.
    """

    def __init__(self, hosts: int = 2, name: str = DEFAULT_NAME, subnet: str = DEFAULT_SUBNET,
                 root: Path = DEFAULT_DIR):
        self.size = hosts
        self.name = name
        self.root = Path(root)
        self.shared = self.root / "shared"
        self.hosts: list[Host] = []
        self.head: Host | None = None
        self._script_env = dict(os.environ, CLUSTER_NAME=name, CLUSTER_SUBNET=subnet,
                                CLUSTER_DIR=str(self.root))
        self._started: list[subprocess.Popen] = []
        # Programs (HostProcess.program) that cleanup() leaves running.
        self.daemons: set[str] = set()
        self._ports = itertools.count(20000)
        self._dirs = itertools.count()

    # Set-up and teardown.

    def _script(self, *args: str, timeout: float = 60) -> str:
        try:
            result = subprocess.run([str(SCRIPT), *args], env=self._script_env, text=True,
                                    capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            raise ClusterError(f"{SCRIPT.name} {' '.join(args)} did not finish in {timeout} s") from error
        if result.returncode != 0:
            raise ClusterError(f"{SCRIPT.name} {' '.join(args)} failed (exit {result.returncode}): "
                               f"{(result.stderr or result.stdout).strip()}")
        return result.stdout

    def up(self) -> None:
        """Creates (or repairs) the namespaces, bridge and disks; reads the manifest."""
        self._script("up", str(self.size))
        rows = [line.split("\t") for line in (self.root / "hosts.tsv").read_text().splitlines()]
        hosts = [Host(name, address, Path(home), Path(tfds), Path(scratch))
                 for name, address, home, tfds, scratch in rows]
        self.head, self.hosts = hosts[0], hosts[1:]

    def down(self) -> None:
        """Kills every process of every host and deletes namespaces, veths and bridge.

        Idempotent. The disks under ``root`` are kept (logs for post-mortem reading).
        """
        self._kill_started()
        self._script("down")

    def cleanup(self) -> None:
        """After a test: heals every partitioned host and SIGKILLs every process on the
        hosts except those whose program is in :attr:`daemons` (what a fixture keeps
        running for the whole session, e.g. Slurm's daemons)."""
        self._kill_started()
        for host in self.all_hosts:
            self.heal(host)
        self._kill(self.all_hosts, spare=self.daemons, timeout=10.0)

    def _kill_started(self) -> None:
        for proc in self._started:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        self._started.clear()

    # Names.

    @property
    def all_hosts(self) -> list[Host]:
        """The head node first, then the hosts."""
        return [self.head, *self.hosts]

    def host(self, key: int | str | Host) -> Host:
        """A host by index (0 = first host, not the head), name or itself."""
        if isinstance(key, Host):
            return key
        if isinstance(key, int):
            return self.hosts[key]
        for host in self.all_hosts:
            if host.name == key:
                return host
        raise KeyError(f"no host {key!r}; hosts: {[h.name for h in self.all_hosts]}")

    def ports(self, count: int = 1) -> list[int]:
        """``count`` port numbers never handed out before in this session (>= 20000).

        Every host has its own port space, so these are free on every host unless a
        process of an earlier test still holds them.
        """
        return [next(self._ports) for _ in range(count)]

    def shared_dir(self, label: str) -> Path:
        """A new empty directory in the shared directory, seen by every host."""
        path = self.shared / f"{label}-{os.getpid()}-{next(self._dirs)}"
        path.mkdir(parents=True)
        return path

    # Running commands.

    def wrap(self, host: int | str | Host, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` on ``host`` (same pid: the wrapper execs it)."""
        return [str(SCRIPT), "exec", self.host(host).name, *map(str, argv)]

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment :meth:`popen` passes (the host's own variables come on top)."""
        env = {k: v for k, v in os.environ.items()
               if k != "TF_CONFIG" and not k.startswith("SLURM_")}
        env.update(self._script_env)
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
        env["PYTHONPATH"] = str(REPO)
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env.update(extra or {})
        return env

    def popen(self, host: int | str | Host, argv: Sequence[str], *,
              env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text: bool = True,
              ) -> subprocess.Popen:
        """Starts ``argv`` on ``host`` in a session of its own (killed by :meth:`cleanup`).

        ``cwd`` defaults to the repository; stdout+stderr are one text pipe by default.
        """
        proc = subprocess.Popen(self.wrap(host, argv), env=self.env(env), cwd=cwd or REPO,
                                stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                text=text, start_new_session=True)
        self._started.append(proc)
        return proc

    def finish(self, proc: subprocess.Popen, timeout: float) -> str:
        """Waits for a :meth:`popen` process; returns its output (stdout, text). After
        ``timeout`` s its session is SIGKILLed and :class:`ClusterError` raised with the
        end of its output."""
        try:
            return proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output = proc.communicate()[0]
            raise ClusterError(f"{' '.join(map(str, proc.args[3:]))} on {proc.args[2]} did "
                               f"not finish in {timeout} s; output:\n{output[-4000:]}") from None

    def run(self, host: int | str | Host, argv: Sequence[str], *, timeout: float = 60,
            env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        """Runs ``argv`` on ``host`` to the end; output as text (stdout, stderr apart).

        With ``check`` a non-zero exit raises :class:`ClusterError` with the output.
        """
        proc = self.popen(host, argv, env=env, cwd=cwd, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise ClusterError(f"{' '.join(map(str, argv))} on {host} did not finish in "
                               f"{timeout} s; output:\n{out[-3000:]}\n{err[-3000:]}")
        if check and proc.returncode != 0:
            raise ClusterError(f"{' '.join(map(str, argv))} on {host} exited with "
                               f"{proc.returncode}:\n{out[-3000:]}\n{err[-3000:]}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # Faults.

    def partition(self, host: int | str | Host) -> None:
        """Cuts ``host`` off the network (its bridge port down: packets to and from it
        are lost; its own loopback and processes keep running)."""
        self._script("partition", self.host(host).name)

    def heal(self, host: int | str | Host) -> None:
        """Reconnects a partitioned host (no-op for a connected one)."""
        self._script("heal", self.host(host).name)

    def processes(self, hosts: Iterable[int | str | Host] | None = None) -> list[HostProcess]:
        """The live processes in the given hosts' namespaces (default: all, head too)."""
        found = []
        for host in (self.all_hosts if hosts is None else map(self.host, hosts)):
            result = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True,
                                    text=True, timeout=30)
            for pid in map(int, result.stdout.split()):
                if _alive(pid):
                    found.append(HostProcess(host.name, pid, _read_proc(pid, "comm"),
                                             _read_proc(pid, "cmdline")))
        return found

    def kill_all(self, host: int | str | Host, timeout: float = 5.0) -> None:
        """SIGKILLs every process on ``host`` (a crashed machine) and waits until none is
        left; raises :class:`ClusterError` naming survivors after ``timeout`` s."""
        self._kill([host], spare=(), timeout=timeout)

    def _kill(self, hosts: Iterable[int | str | Host], spare: Iterable[str], timeout: float) -> None:
        hosts, spare = list(hosts), set(spare)
        deadline = time.monotonic() + timeout
        while left := [p for p in self.processes(hosts) if p.program not in spare]:
            if time.monotonic() > deadline:
                raise ClusterError(f"processes survived SIGKILL for {timeout} s: {left}")
            for proc in left:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    def assert_no_processes(self, hosts: Iterable[int | str | Host] | None = None, *,
                            allow: Iterable[str] = (), timeout: float = 5.0) -> None:
        """Fails unless the given hosts (default: all) run no process within ``timeout``
        s, except those whose :attr:`HostProcess.program` is in ``allow``."""
        allowed = set(allow)
        deadline = time.monotonic() + timeout
        while True:
            left = [p for p in self.processes(hosts) if p.program not in allowed]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not left, "processes left on the simulated hosts:\n" + "\n".join(
            f"  {p.host} pid {p.pid}: {p.command}" for p in left)
