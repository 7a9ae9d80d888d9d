"""Regression alerts: when a window is slower than the run's own history, and why.

Host-side and TensorFlow-free: :class:`RegressionDetector` judges each window's
examples/s against the running median, :func:`likely_cause` names the telemetry signal
that explains a slowdown (see docs/telemetry.md).
"""

from __future__ import annotations

import statistics

import psutil


class RegressionDetector:
    """Flags examples/s more than ``drop`` below the running median of earlier windows.

    ``update`` returns ``(slow, fire)``: ``slow`` for this window, ``fire`` once per
    episode, when ``windows`` consecutive windows have been slow. Needs 3 earlier
    windows before it judges.
    """

    def __init__(self, drop: float, windows: int):
        self.drop, self.windows = drop, windows
        self.history: list[float] = []
        self.streak = 0

    def median(self) -> float | None:
        return statistics.median(self.history[-100:]) if len(self.history) >= 3 else None

    def update(self, examples_per_s: float) -> tuple[bool, bool]:
        median = self.median()
        slow = median is not None and examples_per_s < (1 - self.drop) * median
        self.streak = self.streak + 1 if slow else 0
        self.history.append(examples_per_s)
        return slow, self.streak == self.windows


def likely_cause(current: dict, baseline: dict) -> str:
    """Names the likely cause of a slowdown from two telemetry records (see docs/telemetry.md).

    The input is named when at least 30% of the current step waits for it and, against
    the baseline, the extra wait per step accounts for at least half of the extra step
    time (a run that was already input-bound stays so at a higher fraction).
    """
    causes = []
    wait, base_wait = current.get("perf/input_wait_fraction"), baseline.get("perf/input_wait_fraction")
    step, base_step = current.get("perf/step_time_mean_s"), baseline.get("perf/step_time_mean_s")
    if wait is not None and wait >= 0.3:
        added_wait_s = wait * step - (base_wait or 0.0) * (base_step or 0.0)
        if base_wait is None or (step > base_step and added_wait_s >= 0.5 * (step - base_step)):
            causes.append(f"input wait up: {wait:.0%} of a {step * 1e3:.3g} ms step" + (
                f" (was {base_wait:.0%} of a {base_step * 1e3:.3g} ms step)"
                if base_wait is not None else ""))
    near = [current.get(k) for k in ("mem/gpu_memory_fraction", "mem/host_memory_fraction")]
    if any(v is not None and v >= 0.9 for v in near):
        causes.append(f"memory near limit ({max(v for v in near if v is not None):.0%} used)")
    skipped = (current.get("precision/skipped_steps") or 0) - (
        baseline.get("precision/skipped_steps") or 0)
    if skipped > 0:
        causes.append(f"{skipped:.0f} skipped (non-finite) steps")
    host, own = current.get("sys/host_cpu_percent"), current.get("sys/process_cpu_percent")
    if host is not None and own is not None and host >= 90 and own / psutil.cpu_count() < 0.7 * host:
        causes.append(f"host CPU contention: the machine is {host:.0f}% busy, this process "
                      f"uses {own / psutil.cpu_count():.0f}%")
    if not causes:
        return ("no telemetry signal explains it; capture a trace with "
                "--config.telemetry.profile_steps=START:STOP")
    return "; ".join(causes)
