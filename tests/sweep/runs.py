"""What the sweep tests share: the command, tiny digits trials, the status table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.helpers import REPO, subprocess_env

CONFIG = REPO / "models" / "configs" / "digits_sweep.py"
#: Trials of a few seconds: 100 steps, one evaluation at the end.
TINY = ("--config.train.steps=100", "--config.train.log_every_steps=50",
        "--config.eval.every_steps=0")


def long_trials(steps: int) -> tuple[str, ...]:
    """Trials long enough to be stopped mid-run (about 1 ms a step), a checkpoint every
    500 steps."""
    return (f"--config.train.steps={steps}", "--config.train.log_every_steps=500",
            "--config.checkpoint.every_steps=500", "--config.eval.every_steps=0")


def command(*flags: str, config: Path | None = CONFIG) -> list[str]:
    """``python -m trainer.sweep [--config=digits_sweep.py] FLAGS``."""
    return [sys.executable, "-m", "trainer.sweep",
            *([f"--config={config}"] if config else []), *flags]


def sweep(*flags: str, config: Path | None = CONFIG, timeout: float = 300,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs the sweep to its end (text output); ``env``: variables set on top of this
    process's."""
    return subprocess.run(command(*flags, config=config), cwd=REPO,
                          env={**subprocess_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def start(*flags: str, log: Path) -> subprocess.Popen:
    """Starts the sweep, its stdout and stderr into ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(command(*flags), cwd=REPO, env=subprocess_env(),
                                stdout=out, stderr=subprocess.STDOUT, text=True)


def status(workdir: Path) -> dict[str, dict[str, str]]:
    """``--status``'s table: ``{trial: {column: cell}}``."""
    run = sweep("--status", f"--workdir={workdir}", config=None, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    header = lines[0].split()
    rows = {}
    for line in lines[1:]:
        cells = line.split()
        if len(cells) == len(header) and cells[0].isdigit():
            rows[cells[0]] = dict(zip(header, cells))
    return rows


def checkpoint_steps(trial_dir: Path) -> list[int]:
    """The committed checkpoint steps of a trial's workdir (orbax's temporary names aside)."""
    found = trial_dir / "checkpoints"
    return sorted(int(p.name) for p in found.iterdir() if p.name.isdigit()) if found.is_dir() else []


def trial_pid(trial_dir: Path) -> int | None:
    """The pid of the trainer.main process running in ``trial_dir`` (None: none)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"trainer.main" in cmdline and f"--workdir={trial_dir}".encode() in cmdline:
            return int(proc.name)
    return None
