"""The doctor's thread-pool measurement (section ``threads``).

TensorFlow sizes its inter-op and intra-op thread pools once, before its runtime
starts, so no execution plan can change them inside a run (:mod:`trainer.loop.plan` does not
try). This section times the real run (section ``baseline``: real input, real step, the
configured loop) in one fresh process per setting of ``distribute.inter_op_threads`` /
``distribute.intra_op_threads``, the settings alternating ``repeats`` times so that a
drift of the machine spreads over all of them; each setting's rate is the median of its
processes. The advice names a setting only when it beats TensorFlow's own sizing by
:data:`GAIN` or more (one process's measurement spreads by a few percent).

Measured on the benchmark workloads (``python -m benchmarks.speed.runtime_settings threads``):
one intra-op thread runs an overhead-bound step (a small MLP) ~1.3x faster and a
compute-bound one (a CNN, a transformer) 0.6-0.9x as fast: it depends on the model, so
it is measured, never defaulted.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

#: ``(inter_op_threads, intra_op_threads)`` tried; 0 is TensorFlow's own choice, and
#: the first setting is the reference.
SETTINGS = ((0, 0), (0, 1), (1, 1))
#: A setting is advised only when its rate is at least this many times the reference's.
GAIN = 1.05


def _child_command(config_path: str, overrides: Sequence[str], steps: int,
                   setting: tuple[int, int]) -> list[str]:
    inter, intra = setting
    return [sys.executable, "-m", "trainer.doctor", f"--config={config_path}", *overrides,
            f"--config.distribute.inter_op_threads={inter}",
            f"--config.distribute.intra_op_threads={intra}",
            f"--steps={steps}", "--sections=baseline", "--json"]


def measure_threads(steps: int, config_path: str | None, overrides: Sequence[str],
                    repeats: int = 2, deadline: float | None = None,
                    say: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Each of :data:`SETTINGS` timed ``repeats`` times, one process per run (host);
    ``say`` gets one line per run.

    ``deadline`` (``time.monotonic``): no run starts after it and a run still going
    then is stopped; the settings are then compared over the rounds every one of them
    finished, or not at all when a setting has none."""
    if not config_path:
        return {"applicable": False,
                "note": "needs the config file path to run each setting in its own process"}
    runs: dict[tuple[int, int], list[float]] = {s: [] for s in SETTINGS}
    for round_ in range(repeats):
        for setting in SETTINGS:
            left = 1800.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return _rounds_done(runs)
            try:
                proc = subprocess.run(_child_command(config_path, overrides, steps, setting),
                                      capture_output=True, text=True, timeout=left)
            except subprocess.TimeoutExpired:
                return _rounds_done(runs)
            if proc.returncode:
                last = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
                return {"applicable": False,
                        "note": f"the run with inter/intra-op threads {setting} failed: "
                                f"{last[0]}"}
            report = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[setting].append(report["baseline"]["examples_per_s"])
            say(f"doctor:     inter/intra-op threads {setting[0] or 'TF'}/{setting[1] or 'TF'}: "
                f"{runs[setting][-1]:,.0f} ex/s (round {round_ + 1} of {repeats})")
    return _compared(runs, repeats)


def _rounds_done(runs: dict[tuple[int, int], list[float]]) -> dict[str, Any]:
    """The comparison over the rounds every setting finished before the deadline."""
    rounds = min(len(rates) for rates in runs.values())
    if not rounds:
        done = sum(len(rates) for rates in runs.values())
        return {"applicable": False,
                "note": f"the time budget ran out after {done} of the {len(SETTINGS)} "
                        f"settings' first runs (raise --time_budget_s)"}
    return _compared({s: rates[:rounds] for s, rates in runs.items()}, rounds)


def _compared(runs: dict[tuple[int, int], list[float]], repeats: int) -> dict[str, Any]:
    reference = statistics.median(runs[SETTINGS[0]])
    rows = [{"inter_op_threads": inter, "intra_op_threads": intra,
             "examples_per_s": statistics.median(rates), "runs": rates,
             "vs_default": statistics.median(rates) / reference}
            for (inter, intra), rates in runs.items()]
    best = max(rows, key=lambda r: r["vs_default"])
    return {"applicable": True, "repeats": repeats, "settings": rows,
            "advised": best if best["vs_default"] >= GAIN else None}
