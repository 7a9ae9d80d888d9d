"""The input-wait estimate behind telemetry's window records: when to probe, the probes
of the current ``fit()``, and what the latest probe says about a window.

:class:`InputWait` is used by :class:`trainer.telemetry.service.Telemetry` after each
logging window (host, cross-replica context, between train loops). The probes
themselves and the overlap model are in :mod:`trainer.telemetry.probes`; when they run,
in :class:`~trainer.telemetry.probes.ProbeSchedule`.
"""

from __future__ import annotations

import time
from typing import Any

import ml_collections
from absl import logging

from trainer.distribution import strategies
from trainer.run_context import RunContext
from trainer.telemetry import probes

#: The latest probe found the pipeline at least this many times slower than compute:
#: the run steps at the pipeline's pace, so a window whose steps ran faster than half
#: of it was fed from prefetched stock. Below that (a fast pipeline, or a probe that a
#: busy host made misjudge it 2-3x) no window is taken for stock.
INPUT_BOUND_RATIO = 10.0

_NO_PROBE = {"perf/input_wait_fraction": None, "perf/pipeline_examples_per_s": None,
             "perf/compute_examples_per_s": None, "perf/probe_step": None}


class InputWait:
    """Probes the input pipeline and the compute on the schedule of ``config.telemetry``
    and turns the latest probe into a window's ``perf/`` numbers.

    The schedule (and its probe budget) spans every ``fit()`` of one Trainer; the traced
    probes live for one ``fit()`` (:meth:`end_fit` releases them).
    """

    def __init__(self, config: ml_collections.ConfigDict):
        self.config = config
        self._schedule: probes.ProbeSchedule | None = None  # set at the first fit
        self._probes: dict[str, Any] = {}  # traced probes of this fit()
        self._latest: dict[str, Any] = {}  # the latest probe's numbers (any fit)
        self._probed = False  # a probe ran after the previous window

    def start_fit(self, run: RunContext) -> None:
        """Creates the schedule at the first fit. Probes run collectives; their
        timing-driven chunk counts would differ between workers and mismatch the
        collectives, so multi-worker runs do not probe."""
        self._probed = False
        if self._schedule is not None:
            return
        every = self.config.telemetry.probe_every_windows
        if every and strategies.num_workers(run.strategy) > 1:
            every = 0
            logging.info("input-wait probes are off in multi-worker runs "
                         "(perf/input_wait_fraction is null).")
        self._schedule = probes.ProbeSchedule(every, self.config.telemetry.probe_budget)

    def end_fit(self) -> None:
        """Releases the probes' pipeline copy now (off this thread), not at a later
        garbage collection."""
        if self._probes.get("input") is not None:
            self._probes["input"].close()
        self._probes.clear()

    def after_probe(self) -> bool:
        """Whether a probe ran after the previous window (asked once per window)."""
        probed, self._probed = self._probed, False
        return probed

    def outran_the_pipeline(self, step_s: float) -> bool:
        """Whether steps of ``step_s`` seconds were fed from prefetched stock: the latest
        probe found the run input-bound (:data:`INPUT_BOUND_RATIO`) and they ran faster
        than half its seconds per batch of the pipeline alone (the steady state cannot
        outrun the pipeline), so they say nothing about the run's throughput."""
        p = self._latest
        return (bool(p) and p["compute_s"] is not None
                and p["input_s"] >= INPUT_BOUND_RATIO * p["compute_s"]
                and step_s < 0.5 * p["input_s"])

    def maybe_probe(self, run: RunContext, window: int, step_s: float, *, slow: bool,
                    alert: bool) -> None:
        """Probes after logging window ``window`` if the schedule says so (``slow``: the
        window starts a slow streak; ``alert``: an alert fires at it)."""
        if self._schedule.due(window, slow=slow, alert=alert):
            start = time.perf_counter()
            self._probe(run, step_s)
            self._schedule.spent(time.perf_counter() - start)
            self._probed = True

    def _probe(self, run: RunContext, step_s: float) -> None:
        """Times the pipeline alone and compute alone. ``step_s``: the window's observed
        seconds per step. A pipeline that slows the step takes about that long per
        batch, so the input probe first drains what comes out faster than half of it
        (prefetched stock)."""
        n = self.config.telemetry.probe_batches
        cache = self._probes
        if "input" not in cache:
            cache["input"] = probes.InputProbe(run)
        input_s = cache["input"].seconds_per_batch(n, floor_s=0.5 * step_s)
        if "compute" not in cache:
            try:
                cache["compute"] = probes.ComputeProbe(run, cache["input"].next_batch())
            except probes.ComputeUnavailable as error:
                logging.info("input-wait estimate unavailable: %s", error)
                cache["compute"] = None
        compute_s = cache["compute"].seconds_per_step(n) if cache["compute"] else None
        self._latest = {"input_s": input_s, "compute_s": compute_s, "step": run.step}

    def numbers(self, step_s: float, global_batch: int) -> dict[str, float | None]:
        """The window's ``perf/input_wait_fraction``, ``perf/pipeline_examples_per_s``,
        ``perf/compute_examples_per_s`` and ``perf/probe_step`` (all None before the
        first probe)."""
        p = self._latest
        if not p:
            return dict(_NO_PROBE)
        compute_s = p["compute_s"]
        return {
            "perf/input_wait_fraction": (probes.input_wait_fraction(p["input_s"], compute_s, step_s)
                                         if compute_s is not None else None),
            "perf/pipeline_examples_per_s": global_batch / max(p["input_s"], 1e-9),
            "perf/compute_examples_per_s": (global_batch / max(compute_s, 1e-9)
                                            if compute_s else None),
            "perf/probe_step": p["step"],
        }
