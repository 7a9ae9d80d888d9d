"""Timing implementations side by side in one process: rounds interleaved, each round
starting one implementation later, so drifts of the machine fall on all of them."""

from __future__ import annotations

import time
from typing import Callable, Mapping

from benchmarks.common.table import format_table, from_rounds


def interleaved(functions: Mapping[str, Callable[[], object]], rounds: int,
                per_call: int) -> dict[str, list[float]]:
    """``{name: [microseconds per unit, one per round]}``: each of ``functions`` (already
    warmed up) called once per round, its wall time divided by ``per_call`` units (the
    updates or draws one call runs)."""
    times: dict[str, list[float]] = {name: [] for name in functions}
    names = list(functions)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            functions[name]()
            times[name].append((time.perf_counter() - start) / per_call * 1e6)
    return times


def table(functions: Mapping[str, Callable[[], object]], rounds: int, per_call: int,
          baseline: str, unit: str, title: str) -> str:
    """Warms up every one of ``functions`` (trace, compile), times them
    :func:`interleaved` and returns the table of microseconds per ``unit`` (e.g. "per
    draw"), each row a ratio to ``baseline``."""
    for function in functions.values():
        function()
    times = interleaved(functions, rounds, per_call)
    rows = [from_rounds(name, values, "us", times[baseline], note=unit)
            for name, values in times.items()]
    return format_table(title, rows, baseline)
