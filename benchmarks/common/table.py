"""The one table format every benchmark prints (and benchmarks/README.md holds).

A Markdown table, so a run's output pastes into the README as it is:

    ### TITLE
    machine: 2 cores, <CPU model>, TensorFlow 2.21.0, Python 3.11.7; 2026-12-06 05:30 UTC; load 1.20
    | what | value | unit | vs BASELINE [min..max] | spread (min..max) | note |
    |---|---|---|---|---|---|
    | a | 48,466 | ex/s | 1.04 [0.97..1.10] | 45,000..50,120 | |

``value`` is the median over rounds (or the single measurement), in ``unit`` (``ex/s``
or ``s``, or ``ms`` / ``us`` for small times); ``vs BASELINE`` the median of the
per-round ratios to the baseline row's value in the same round (paired, so a drift of
the machine between rounds cancels) with their range; ``spread`` the range of the value
over rounds. ``-`` where a column does not apply; a ``|`` in a cell is escaped. Needs no
TensorFlow (the version is read from the installed package unless TensorFlow is already
imported).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import statistics
import sys
from dataclasses import dataclass
from typing import Sequence

COLUMNS = ("what", "value", "unit", "vs {baseline} [min..max]", "spread (min..max)", "note")
TF_PACKAGES = ("tensorflow", "tensorflow-cpu", "tf-nightly")


@dataclass(frozen=True)
class Row:
    """One line of a table. ``value`` None: not measured (``note`` says why)."""

    what: str
    value: float | None
    unit: str
    ratio: float | None = None
    ratio_spread: tuple[float, float] | None = None
    spread: tuple[float, float] | None = None
    note: str = ""


def from_rounds(what: str, values: Sequence[float], unit: str,
                baseline: Sequence[float] | None = None, note: str = "") -> Row:
    """A row from per-round values: their median and range, and with ``baseline`` (the
    baseline's values in the same rounds, same length) the median of the per-round
    ratios values[i] / baseline[i] and their range."""
    ratio = ratio_spread = None
    if baseline is not None:
        ratios = [v / b for v, b in zip(values, baseline, strict=True)]
        ratio, ratio_spread = statistics.median(ratios), (min(ratios), max(ratios))
    return Row(what, statistics.median(values), unit, ratio, ratio_spread,
               (min(values), max(values)), note)


def number(x: float) -> str:
    """Thousands separated above 100, three significant digits below."""
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:#.3g}"


def tensorflow_version() -> str:
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"].__version__
    for package in TF_PACKAGES:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return " ".join(line.partition(":")[2].split())
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """Cores, CPU model, TensorFlow and Python versions, UTC date and time, load average."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"machine: {os.cpu_count()} cores, {cpu_model()}, TensorFlow "
            f"{tensorflow_version()}, Python {platform.python_version()}; {now}; "
            f"load {os.getloadavg()[0]:.2f}")


def _range(pair: tuple[float, float] | None) -> str:
    return f"{number(pair[0])}..{number(pair[1])}" if pair else "-"


def _cells(row: Row) -> list[str]:
    ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
    if row.ratio_spread:
        ratio += f" [{row.ratio_spread[0]:.2f}..{row.ratio_spread[1]:.2f}]"
    value = "-" if row.value is None else number(row.value)
    return [row.what, value, row.unit, ratio, _range(row.spread), row.note]


def format_table(title: str, rows: Sequence[Row], baseline: str | None = None) -> str:
    """The table: a ``###`` title, the machine line, then one line per row; ratios are
    to ``baseline`` (named in the column's header; None: a table without ratios)."""
    header = [c.format(baseline=baseline) if baseline else c.replace("vs {baseline}", "ratio")
              for c in COLUMNS]
    lines = [f"### {title}", machine(), "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in _cells(row)) + " |"
              for row in rows]
    return "\n".join(lines)
