"""Supervising a group of child processes that live and die together.

:class:`ProcessGroup` starts one child per :class:`TaskSpec`, prefixes every line the
children write with ``[task] `` (stdout to stdout, stderr to stderr), and owns their
lives until the group ends:

* every child exits 0 → success (a sidecar task, e.g. a tf.data service process, need
  not finish);
* one exits non-zero or is killed by a signal → the others are stopped;
* one writes nothing within ``start_timeout_s`` of its start, or sits stopped (SIGSTOP /
  SIGTSTP) for ``frozen_timeout_s`` → it is declared hung and the group is stopped;
* no child writes anything for ``hang_timeout_s`` → the group is declared hung. This
  bound is over the whole group because in a multi-worker run often only the chief
  logs progress, and the workers advance in lockstep with it;
* the launcher is asked to stop (SIGINT / SIGTERM) → the group is stopped.

Lines of a child that match the group's ``watch`` pattern are kept (the last few per
child) and returned with the result of a child that fails, so that the launcher can
say more than "exited with code N" (e.g. which peer a task reported lost).

Stopping sends SIGTERM (and SIGCONT, so a stopped child can act on it) to each child's
process group, waits ``grace_s``, then sends SIGKILL. Children run in their own session
(so a terminal's Ctrl-C reaches only the launcher, which forwards it) and, on Linux,
with ``PR_SET_PDEATHSIG=SIGKILL``: if the launcher itself is SIGKILLed they die too.

Single-threaded: one ``selectors`` loop reads all pipes and checks liveness every
``_TICK_S``; it must run on the main thread (PDEATHSIG fires when the thread that
spawned a child exits, and signal handlers run there).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from typing import BinaryIO, Callable, Sequence

_TICK_S = 0.2
_PR_SET_PDEATHSIG = 1
_MAX_PARTIAL_LINE = 1 << 16
_WATCHED_LINES_KEPT = 5
# What a TensorFlow/gRPC server prints when its port was taken between our pick and its bind.
_PORT_CLASH = re.compile(rb"Address already in use|Failed to add port|Could not start gRPC server")

EXIT_HUNG = 124  # a task was declared hung (start, hang or frozen bound), like timeout(1)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One child: its display name (``"worker:1"``), argv and full environment.

    A ``sidecar`` (e.g. a tf.data service process) does not have to finish: once every
    other task exited 0 the group succeeds and a sidecar still running is stopped. A
    sidecar that fails while the others run fails the group like any task.
    """

    name: str
    argv: Sequence[str]
    env: dict[str, str]
    sidecar: bool = False


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Liveness bounds in seconds; 0 turns a bound off (``grace_s`` must be > 0)."""

    start_timeout_s: float = 300.0
    hang_timeout_s: float = 0.0
    frozen_timeout_s: float = 30.0
    grace_s: float = 10.0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 0:
                raise ValueError(f"{field.name}={getattr(self, field.name)} must be >= 0.")
        if self.grace_s <= 0:
            raise ValueError(f"grace_s={self.grace_s} must be > 0.")


@dataclasses.dataclass(frozen=True)
class GroupResult:
    """How a group ended.

    ``exit_code``: 0 on success; the first failing task's exit status (``128 + N`` if
    it was killed by signal N); :data:`EXIT_HUNG` when a task or the group was declared
    hung; ``128 + N`` when the launcher was stopped by signal N. ``failed_task`` names the
    task that ended the group (None on success, a silent group or a launcher stop);
    ``port_clash`` is True when the failing task's output says its port was taken (the
    group may retry on new ports); ``watched`` holds the failing task's last lines that
    matched the group's ``watch`` pattern (without the ``[task] `` prefix).
    """

    exit_code: int
    reason: str
    failed_task: str | None = None
    port_clash: bool = False
    watched: tuple[str, ...] = ()


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True)


_LIBC = _libc()


def _die_with_parent_preexec(parent_pid: int) -> Callable[[], None]:
    """Returns a preexec_fn that makes the child receive SIGKILL when its parent dies."""
    prctl = _LIBC.prctl

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from /proc (``"T"`` = stopped), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Format: "pid (comm) S ...": comm may contain spaces and parentheses.
    return stat[stat.rfind(b")") + 2:][:1].decode() or None


def describe_exit(returncode: int) -> str:
    """``"exited with code 3"`` or ``"was killed by SIGKILL"`` for a Popen returncode."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def exit_status(returncode: int) -> int:
    """A shell-style exit status for a Popen returncode (``128 + N`` for signal N)."""
    return 128 - returncode if returncode < 0 else returncode


class _Child:
    def __init__(self, spec: TaskSpec, popen: subprocess.Popen, now: float):
        self.name = spec.name
        self.sidecar = spec.sidecar
        self.popen = popen
        self.started = now
        self.last_output: float | None = None
        self.stopped_since: float | None = None
        self.open_streams = 2
        self.partial: dict[int, bytes] = {}
        self.port_clash = False
        self.watched: list[str] = []

    @property
    def pid(self) -> int:
        return self.popen.pid


class ProcessGroup:
    """Runs :class:`TaskSpec` children as one unit; see the module docstring.

    ``stop_requested`` is polled every tick: it returns the number of a signal the
    launcher received (the group is then stopped and the result's exit code is
    ``128 + N``) or None. ``log`` receives the group's own messages. ``watch``: a pattern
    whose matching output lines are kept for :attr:`GroupResult.watched`.
    """

    def __init__(
        self,
        tasks: Sequence[TaskSpec],
        bounds: Bounds,
        stop_requested: Callable[[], int | None] = lambda: None,
        log: Callable[[str], None] = lambda message: print(message, file=sys.stderr, flush=True),
        stdout: BinaryIO | None = None,
        stderr: BinaryIO | None = None,
        watch: re.Pattern[bytes] | None = None,
    ):
        if not tasks:
            raise ValueError("a ProcessGroup needs at least one task.")
        names = [t.name for t in tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"task names must be unique, got {names}.")
        self._tasks = list(tasks)
        self._bounds = bounds
        self._stop_requested = stop_requested
        self._log = log
        self._out = {1: stdout or sys.stdout.buffer, 2: stderr or sys.stderr.buffer}
        self._children: list[_Child] = []
        self._last_output = time.monotonic()
        self._selector = selectors.DefaultSelector()
        self._watch = watch

    @property
    def pids(self) -> list[int]:
        """PIDs of the children started so far (for tests and diagnostics)."""
        return [c.pid for c in self._children]

    # --- output -------------------------------------------------------------------

    def _emit(self, child: _Child, stream: int, data: bytes, final: bool = False) -> None:
        buffer = child.partial.get(stream, b"") + data
        lines = buffer.split(b"\n")
        rest = lines.pop()
        if final or len(rest) > _MAX_PARTIAL_LINE:
            if rest:
                lines.append(rest)
            rest = b""
        child.partial[stream] = rest
        if not lines:
            return
        prefix = f"[{child.name}] ".encode()
        out = self._out[stream]
        for line in lines:
            if _PORT_CLASH.search(line):
                child.port_clash = True
            if self._watch is not None and self._watch.search(line):
                child.watched = [*child.watched, line.decode(errors="replace")][-_WATCHED_LINES_KEPT:]
        out.write(b"".join(prefix + line + b"\n" for line in lines))
        out.flush()

    def _pump(self, timeout: float) -> None:
        for key, _ in self._selector.select(timeout):
            child, stream = key.data
            try:
                data = os.read(key.fd, 1 << 16)
            except OSError:
                data = b""
            if data:
                child.last_output = self._last_output = time.monotonic()
                self._emit(child, stream, data)
            else:
                self._selector.unregister(key.fileobj)
                key.fileobj.close()
                child.open_streams -= 1
                self._emit(child, stream, b"", final=True)

    def _drain(self, seconds: float) -> None:
        """Reads what exited children still have in their pipes, for at most ``seconds``."""
        deadline = time.monotonic() + seconds
        while self._selector.get_map() and time.monotonic() < deadline:
            self._pump(min(_TICK_S, max(0.0, deadline - time.monotonic())))

    def _drain_child(self, child: _Child, seconds: float) -> None:
        """Reads an exited child's pipes to their end, for at most ``seconds``."""
        deadline = time.monotonic() + seconds
        while child.open_streams and time.monotonic() < deadline:
            self._pump(min(_TICK_S, max(0.0, deadline - time.monotonic())))

    # --- lifecycle ----------------------------------------------------------------

    def _start(self) -> None:
        preexec = _die_with_parent_preexec(os.getpid()) if _LIBC is not None else None
        for spec in self._tasks:
            popen = subprocess.Popen(
                list(spec.argv), env=spec.env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, preexec_fn=preexec,
            )
            child = _Child(spec, popen, time.monotonic())
            self._children.append(child)
            self._last_output = child.started
            self._selector.register(popen.stdout, selectors.EVENT_READ, (child, 1))
            self._selector.register(popen.stderr, selectors.EVENT_READ, (child, 2))
        self._log("[launcher] pids: " + " ".join(f"{c.name}={c.pid}" for c in self._children))

    def _signal_all(self, sig: int) -> None:
        for child in self._children:
            if child.popen.poll() is None or sig == signal.SIGKILL:
                try:
                    os.killpg(child.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def _alive(self) -> list[_Child]:
        return [c for c in self._children if c.popen.poll() is None]

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM (+SIGCONT) every child's process group, SIGKILL after the grace period.

        Returns once every child is reaped; their remaining output is drained.
        """
        grace_s = self._bounds.grace_s if grace_s is None else grace_s
        if self._alive():
            self._signal_all(signal.SIGTERM)
            self._signal_all(signal.SIGCONT)
            deadline = time.monotonic() + grace_s
            while self._alive() and time.monotonic() < deadline:
                self._pump(_TICK_S)
            if self._alive():
                self._log(f"[launcher] {', '.join(c.name for c in self._alive())} still running "
                          f"{grace_s:g} s after SIGTERM: sending SIGKILL.")
        # SIGKILL every process group, including grandchildren of children that exited.
        self._signal_all(signal.SIGKILL)
        for child in self._children:
            child.popen.wait()
        self._drain(1.0)
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fileobj)
            key.fileobj.close()

    def _check(self, now: float) -> GroupResult | None:
        """Returns the result that ends the group, or None while it runs on."""
        b = self._bounds
        for child in self._children:
            code = child.popen.poll()
            if code is not None and code != 0:
                self._drain_child(child, 1.0)  # its last lines may say why
                return GroupResult(exit_status(code), f"{child.name} {describe_exit(code)}",
                                   child.name, child.port_clash, tuple(child.watched))
        for child in self._children:
            if child.popen.poll() is not None:
                continue
            if b.start_timeout_s and child.last_output is None and now - child.started > b.start_timeout_s:
                return GroupResult(EXIT_HUNG, f"{child.name} wrote nothing within "
                                   f"{b.start_timeout_s:g} s of its start (--start_timeout)",
                                   child.name)
            if process_state(child.pid) == "T":
                child.stopped_since = child.stopped_since or now
                if b.frozen_timeout_s and now - child.stopped_since > b.frozen_timeout_s:
                    return GroupResult(EXIT_HUNG, f"{child.name} has been stopped (SIGSTOP/"
                                       f"SIGTSTP) for {b.frozen_timeout_s:g} s "
                                       f"(--frozen_timeout)", child.name)
            else:
                child.stopped_since = None
        if b.hang_timeout_s and now - self._last_output > b.hang_timeout_s:
            return GroupResult(EXIT_HUNG, f"no task wrote anything for {b.hang_timeout_s:g} s "
                               f"(--hang_timeout)")
        if all(c.popen.poll() == 0 for c in self._children if not c.sidecar):
            return GroupResult(0, "every task exited with code 0")
        return None

    def run(self) -> GroupResult:
        """Starts the children and supervises them until the group ends; see the class."""
        try:
            self._start()
            while True:
                self._pump(_TICK_S)
                signum = self._stop_requested()
                if signum is not None:
                    name = signal.Signals(signum).name
                    self._log(f"[launcher] received {name}: stopping every task "
                              f"(SIGTERM, SIGKILL after {self._bounds.grace_s:g} s).")
                    self.stop()
                    return GroupResult(128 + signum, f"the launcher received {name}")
                result = self._check(time.monotonic())
                if result is not None:
                    if result.exit_code:
                        others = "the other tasks" if result.failed_task else "every task"
                        self._log(f"[launcher] {result.reason}: stopping {others}.")
                    self.stop()
                    return result
        except BaseException:
            self.stop(grace_s=1.0)
            raise


class StopSignals:
    """Records the first SIGINT/SIGTERM/SIGHUP; a second one raises KeyboardInterrupt."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.received: int | None = None

    def __enter__(self) -> "StopSignals":
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    def __call__(self) -> int | None:
        return self.received
