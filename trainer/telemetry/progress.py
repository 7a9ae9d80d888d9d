"""Console progress of a run: an updating bar, plain lines, or nothing.

``telemetry.progress`` = ``bar`` (one updating line with ETA, for a terminal), ``lines``
(one plain line per window: no control characters), ``off``, or ``auto``: in a Jupyter
kernel (Jupyter, Colab) the lines plus ONE updating display of the bar (an IPython
display updated in place: ``display_data`` then ``update_display_data`` messages;
mode ``notebook``); else ``bar`` when stderr is a TTY and no launcher set
``TF_CONFIG``, else ``lines`` (a log file, a pipe). The environment variable
``TF_TRAINER_PROGRESS`` overrides the config (launchers set it to ``lines``).

:func:`event_line` is the console line of a run event (:mod:`trainer.run_context`).

The bar and log lines never share a line: while a bar is shown, every handler of the
root logger (absl's among them) erases it before writing a record (:meth:`Progress.close`
removes that filter).
"""

from __future__ import annotations

import html
import logging
import math
import os
import sys
from typing import TextIO

from trainer.config import ConfigError
from trainer.telemetry import goodput_record

PROGRESS_ENV = "TF_TRAINER_PROGRESS"
_CONTROL = "\r\x1b[K"  # carriage return + erase to end of line


def progress_mode(configured: str, stream: TextIO) -> str:
    """Resolves ``telemetry.progress`` (and ``$TF_TRAINER_PROGRESS``) to bar/lines/off."""
    mode = os.environ.get(PROGRESS_ENV, "").strip().lower() or configured
    if mode not in ("auto", "bar", "lines", "off"):
        raise ConfigError(
            f"{PROGRESS_ENV}={mode!r} is not one of 'auto', 'bar', 'lines', 'off'.")
    if mode != "auto":
        return mode
    if os.environ.get("TF_CONFIG"):
        return "lines"
    if in_notebook():
        return "notebook"
    return "bar" if getattr(stream, "isatty", lambda: False)() else "lines"


def in_notebook() -> bool:
    """True inside a Jupyter kernel: IPython is loaded and its shell has a kernel
    (a terminal IPython has none). Imports nothing."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


def duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def event_line(record: dict) -> str:
    """The console line of a run event record (see :mod:`trainer.run_context`)."""
    kind, step = record["kind"], record["step"]
    if kind == "restore":
        return f"restored from checkpoint step {step} ({record.get('workdir')})"
    if kind == "stop":
        return f"training stopped at step {step}: {record['reason']}"
    if kind == "rollback":
        return (f"rollback at step {record['from_step']}: {record['reason']}; restored the "
                f"checkpoint of step {step} (rollback {record['rollbacks']} of at most "
                f"{record['max_rollbacks']}); the input goes on from where it was")
    if kind == "plan":
        return plan_line(record)
    if kind == "goodput":
        return goodput_record.table(record)
    if kind == "preemption":
        saved = (f"the checkpoint of step {step} is saved" if record.get("saved") == step
                 else f"NO checkpoint of step {step} could be saved, the last good one is "
                      f"{record.get('last_good', 'unknown')}")
        return (f"preempted at step {step}: stop signal (SIGTERM/SIGINT); {saved}, run the "
                f"same command again to resume")
    return f"{kind} at step {step}: " + ", ".join(
        f"{k}={v}" for k, v in record.items() if k not in ("kind", "step", "time"))


def plan_line(record: dict) -> str:
    """The one line of an execution-plan decision (:mod:`trainer.loop.plan`)."""

    def describe(plan: dict) -> str:
        return f"xla {plan['xla']}, steps_per_loop {plan['steps_per_loop']}"

    chosen, source = describe(record["chosen"]), record["source"]
    if source == "measured":
        timed = sum(1 for row in record["plans"] if row.get("vs_baseline") is not None)
        versus = ("the configured plan" if record["chosen"] == record["baseline"]
                  else f"{record['ratio']:.2f}x the configured plan ({describe(record['baseline'])})")
        return (f"plan: {chosen} at step {record['step']}, {versus}; measured {timed} plans "
                f"in {record['measure_s']:.1f} s (set perf.plan='fixed' to skip)")
    if source == "checkpoint":
        return f"plan: {chosen}, as measured before this resume (same hardware and strategy)"
    if source == "cached":
        return (f"plan: {chosen} (measured {record['measured_at']}, cached; "
                f"perf.plan_cache='off' measures again)")
    return f"plan: {chosen} as configured, not measured: {record.get('reason', source)}"


class _EraseBar(logging.Filter):
    """A handler filter that erases the progress bar before a log record is written."""

    def __init__(self, progress: "Progress"):
        super().__init__()
        self.progress = progress

    def filter(self, record: logging.LogRecord) -> bool:
        self.progress.clear()
        return True


class Progress:
    """Console progress in one of four modes: bar, notebook, lines, off (see the module
    docstring)."""

    def __init__(self, mode: str, total_steps: int, stream: TextIO):
        self.mode, self.total_steps, self.stream = mode, total_steps, stream
        self._bar_shown = False
        self._display = None  # notebook mode: the IPython display handle, once shown
        self._filter = _EraseBar(self) if mode == "bar" else None
        self._handlers = list(logging.getLogger().handlers) if self._filter else []
        for handler in self._handlers:
            handler.addFilter(self._filter)

    def close(self) -> None:
        """Erases the bar and stops watching the log handlers."""
        self.clear()
        for handler in self._handlers:
            handler.removeFilter(self._filter)
        self._handlers = []

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    @property
    def updating(self) -> bool:
        """True when :meth:`update` draws something (bar and notebook modes)."""
        return self.mode in ("bar", "notebook")

    def update(self, step: int, loss: float | None, examples_per_s: float | None,
               eta_s: float | None) -> None:
        """Redraws the single progress line (bar) or display (notebook) after every
        train loop; nothing in the other modes."""
        if not self.updating:
            return
        width = 24
        done = int(width * step / max(self.total_steps, 1))
        parts = [f"[{'#' * done}{'.' * (width - done)}] {step}/{self.total_steps}"]
        if loss is not None:
            parts.append(f"loss {loss:.4g}")
        if examples_per_s:
            parts.append(f"{examples_per_s:,.0f} ex/s")
        parts.append(f"ETA {duration(eta_s)}")
        if self.mode == "notebook":
            self._show(step, "  ".join(parts))
            return
        self._write(_CONTROL + "  ".join(parts))
        self._bar_shown = True

    def _show(self, step: int, text: str) -> None:
        """Notebook mode: the one display of this progress, shown then updated."""
        from IPython import display  # loaded: the mode is chosen inside a kernel

        bundle = {"text/plain": text,
                  "text/html": f'<progress value="{step}" max="{self.total_steps}"></progress>'
                               f" <code>{html.escape(text)}</code>"}
        if self._display is None:
            self._display = display.display(bundle, raw=True, display_id=True)
        else:
            self._display.update(bundle, raw=True)

    def line(self, text: str) -> None:
        """A permanent line (window summary, eval result)."""
        if self.mode == "off":
            return
        self.clear()
        self._write(text + "\n")

    def clear(self) -> None:
        """Bar mode: erases the progress line so another message can be printed."""
        if self._bar_shown:
            self._write(_CONTROL)
            self._bar_shown = False
