"""The doctor's measuring phases: each says what it measures and how long it took, and
together they keep the time budget stated at the start (no TensorFlow here).

``python -m trainer.doctor --time_budget_s S`` (default :data:`DEFAULT_BUDGET_S`): the
sections the verdict needs (``baseline``, ``input``, ``compute``: :data:`ALWAYS`) always
run, each bounded by its own timing (a second or so after its warm-up); every other
section starts only while the budget lasts, and is otherwise reported as not measured,
with that reason. A section that runs several measurements (the batch search, the
execution plan, the thread pools, the one-replica comparison) gets the deadline and stops
at it. Progress goes to ``say`` (the command line: stderr), one line per phase start and
end with the seconds spent of the budget; it never estimates a training run's end.
"""

from __future__ import annotations

import time
from typing import Any, Callable

DEFAULT_BUDGET_S = 60.0
#: Sections measured whatever the budget: the verdict is made of them.
ALWAYS = ("baseline", "input", "compute")


class Phases:
    """Runs the doctor's sections against one time budget.

    Args:
      budget_s: the seconds the whole diagnosis may take (stated by :meth:`start`).
      say: where progress lines go.
      clock: seconds, monotonic (``time.monotonic``).
    """

    def __init__(self, budget_s: float, say: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.budget_s = budget_s
        self._say = say
        self._clock = clock
        self._start = clock()

    def start(self, sections: list[str]) -> None:
        """States the budget and what will be measured (restarts the clock)."""
        self._start = self._clock()
        self._say(f"doctor: measuring {', '.join(sections)} within a time budget of "
                  f"{self.budget_s:g} s (--time_budget_s); {', '.join(ALWAYS)} always run, "
                  f"the other sections only while the budget lasts.")

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._start

    @property
    def deadline(self) -> float:
        """The budget's end on ``clock``."""
        return self._start + self.budget_s

    def remaining_s(self) -> float:
        return max(0.0, self.budget_s - self.elapsed_s)

    def skipped(self) -> dict[str, Any]:
        """The report of a section the spent budget leaves out."""
        return {"applicable": False, "skipped": True,
                "note": f"not measured: the time budget of {self.budget_s:g} s "
                        f"(--time_budget_s) was spent after {self.elapsed_s:.1f} s"}

    def run(self, section: str, label: str, measure: Callable[[], dict[str, Any]]
            ) -> dict[str, Any]:
        """``measure()``'s report, or :meth:`skipped` when ``section`` is not one of
        :data:`ALWAYS` and the budget is spent; says when it starts and ends."""
        if section not in ALWAYS and self.remaining_s() <= 0:
            report = self.skipped()
            self._say(f"doctor: {label}: {report['note']}")
            return report
        begun = self._clock()
        self._say(f"doctor: {label} ... ({self.elapsed_s:.1f} s of {self.budget_s:g} s)")
        report = measure()
        self._say(f"doctor: {label} done in {self._clock() - begun:.1f} s")
        return report
