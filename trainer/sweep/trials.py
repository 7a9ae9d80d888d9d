"""One trial's run: an ordinary ``python -m trainer.main`` process in its own workdir.

The command is the one a user would type: the sweep's config file and its own
``--config.`` overrides, ``--workdir=DIR/trials/NNNN`` and one ``--config.KEY=VALUE`` per
sampled value (:func:`command`). It is printed when the trial starts and kept with the
trial (``python -m trainer.sweep --status`` shows where), so it reproduces the trial
alone; with a pruner, the sweep runs it with :func:`report_flags` added. The process's
stdout and stderr go to ``DIR/trials/NNNN.log`` (each attempt appended), beside the
workdir: ``trainer.main`` owns the workdir, and resuming a trial
is running the same command again in it (it resumes from its latest checkpoint).

An attempt's outcome (:class:`Attempt`) is read from what the run writes: its exit
status (:mod:`tf_cluster.exit_codes`: 0 done, 143 preempted after its checkpoint), the
``result:`` line ``trainer.main`` prints at the end (``trainer.commands.fit``:
``step=N`` and every value ``fit()`` returned), the last step of ``metrics.jsonl`` (the
step a preempted or crashed run reached), and the last line of its output (the error).
No TensorFlow here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Callable

from tf_cluster.exit_codes import RETRYABLE

#: Exit statuses after which a trial is resumed, not retried: preempted (SIGTERM, and
#: SIGINT outside training: 130), a lost peer (170). A checkpoint may hold its progress.
RESUMABLE = (*RETRYABLE, 128 + signal.SIGINT)
TAIL_BYTES = 65536


@dataclasses.dataclass
class Attempt:
    """What one run of a trial's command ended with."""

    status: int
    seconds: float
    results: dict[str, float]  # the result line's values ({} when the run did not finish)
    step: int | None  # the step the run reached (result line, else metrics.jsonl)
    last_line: str  # the output's last non-empty line (an error's one line)

    @property
    def preempted(self) -> bool:
        return self.status in RESUMABLE


def workdir_of(root: str, number: int) -> str:
    """``ROOT/trials/NNNN``: trial ``number``'s workdir."""
    return os.path.join(os.path.abspath(root), "trials", f"{number:04d}")


def log_of(workdir: str) -> str:
    """The trial's output, appended by each attempt: ``WORKDIR.log``."""
    return workdir + ".log"


def passed_overrides(argv: list[str], swept: set[str]) -> list[str]:
    """The ``--config.KEY=VALUE`` flags of the sweep's command line (``--config.K V``
    joined into one), but for the swept keys, which each trial sets itself."""
    flags, i = [], 1
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config.") and "=" not in arg and i + 1 < len(argv):
            arg, i = f"{arg}={argv[i + 1]}", i + 1
        if arg.startswith("--config.") and arg[9:].split("=", 1)[0] not in swept:
            flags.append(arg)
        i += 1
    return flags


def command(config_path: str, workdir: str, passed: list[str], trial_flags: list[str],
            workers: int = 1) -> list[str]:
    """The trial's ``python -m trainer.main`` command line (see the module docstring);
    with ``workers > 1``, that command run as a local worker group: ``python -m
    launch.multiworker --workers=W -- FLAGS`` (its tasks on free loopback ports of their
    own, picked by the launcher at each start)."""
    flags = [f"--config={os.path.abspath(config_path)}", f"--workdir={workdir}", *passed,
             *trial_flags]
    if workers > 1:
        return [sys.executable, "-m", "launch.multiworker", f"--workers={workers}", "--",
                *flags]
    return [sys.executable, "-m", "trainer.main", *flags]


def report_flags(storage: str, study: str, number: int) -> list[str]:
    """The flags a sweep with a pruner adds to trial ``number``'s command when it runs it
    (never to the printed command, which reproduces the trial alone): its run reports
    its evaluations to the study (:mod:`trainer.services.pruning`)."""
    return [f"--config.sweep.trial={number}", f"--config.sweep.storage={storage}",
            f"--config.sweep.study={study}"]


def shell(argv: list[str]) -> str:
    """``argv`` as one line a shell runs unchanged."""
    return shlex.join(argv)


def shell_split(line: str) -> list[str]:
    """The argv of a line :func:`shell` wrote."""
    return shlex.split(line)


def parse_result(text: str) -> tuple[int | None, dict[str, float]]:
    """``(step, {name: value})`` of the last ``result:`` line in ``text`` (None, {}); the
    values at full precision from the ``final: {json}`` log line when there is one (the
    result line rounds them to 6 digits)."""
    step, values = _result_line(text)
    for line in reversed(text.splitlines()):
        if "final: {" in line:
            try:
                exact = json.loads(line.split("final: ", 1)[1])
            except ValueError:
                break
            values.update({k: float(v) for k, v in exact.items() if k in values})
            break
    return step, values


def _result_line(text: str) -> tuple[int | None, dict[str, float]]:
    for line in reversed(text.splitlines()):
        if line.startswith("[") and "] result: " in line:  # a worker group's task
            line = line.split("] ", 1)[1]
        if not line.startswith("result: "):
            continue
        step, values = None, {}
        for pair in line[len("result: "):].split():
            name, _, value = pair.partition("=")
            if name == "step":
                step = int(value)
            elif "/" in name:
                try:
                    values[name] = float(value)
                except ValueError:
                    continue
        return step, values
    return None, {}


def last_step(workdir: str) -> int | None:
    """The step of the last record of ``WORKDIR/metrics.jsonl`` (None: no record yet)."""
    path = os.path.join(workdir, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - TAIL_BYTES))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int):
            return step
    return None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def run(argv: list[str], workdir: str, started: Callable[[subprocess.Popen], None],
        env: dict[str, str] | None = None) -> Attempt:
    """Runs the trial's command once, its output appended to :func:`log_of` ``workdir``;
    ``started(process)`` is called once it runs (the sweep keeps it, to stop it). ``env``:
    variables set for the process on top of the sweep's environment."""
    log = log_of(workdir)
    os.makedirs(os.path.dirname(log), exist_ok=True)
    begin = time.time()
    with open(log, "ab") as out:
        offset = out.tell()
        out.write(f"$ {shell(argv)}\n".encode())
        out.flush()
        # Its own session: a signal to the sweep reaches a trial once, from the sweep
        # (a second SIGTERM would end it before its checkpoint).
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                   env={**os.environ, **env} if env else None)
        started(process)
        status = process.wait()
    with open(log, "rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", "replace")
    step, results = parse_result(text)
    return Attempt(status=status, seconds=time.time() - begin, results=results,
                   step=step if step is not None else last_step(workdir),
                   last_line=_last_line(text))


def stop(process: subprocess.Popen) -> None:
    """Asks a running trial to stop as a preemption does: one SIGTERM (it checkpoints
    and exits 143)."""
    if process.poll() is None:
        try:
            process.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

