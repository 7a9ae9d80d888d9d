"""The run's execution plan (``perf.plan``): which of the equivalent ways to run the
train loop is fastest here, measured on the run itself.

A plan (:class:`trainer.loop.plan_space.Plan`) is ``(xla, steps_per_loop, pack_bytes)``:
what XLA compiles — ``"off"``: nothing; ``"grads"``: the default train step's forward
and backward pass (``perf.jit_compile``); ``"step"``: the whole replica train step
(forward, backward, gradient path, optimizer update, metrics: what a hand-tuned loop
compiles) — how many steps one ``tf.function`` call runs, and the size of the
gradients' all-reduce packs (``distribute.grad_pack_bytes``; 0: one batched all-reduce;
every size gives the same sums).
Every plan trains the same steps on the same batches with the same cadence (logging,
evaluation, checkpoints and profiler windows still end loop calls exactly), so the
numbers of a run do not depend on the plan, up to the reassociation of float sums XLA
may do (docs/training.md).

``perf.plan="fixed"``: the configured plan (``perf.jit_compile``,
``train.steps_per_loop``), nothing measured. ``"auto"`` (default), by the
:class:`Planner`, at the start of the first ``fit()``, on a copy of the run (a
rehearsal: :mod:`trainer.loop.rehearsal`): its steps train on the run's next batches,
then the training state is put back and the run starts from where the rehearsal did,
with the kept plan. So measuring never changes the numbers: a run ends on the same
weights as the kept plan pinned from the config, bit for bit.

1. warm-up: the configured plan's first call (it traces the step; its time bounds the
   step time from above: a run that takes less than ``perf.plan_min_run_s`` even at
   that rate is decided at once), then one timed call that estimates the step time. The
   chief decides, for every worker: measure, or not (the run's steps at that rate take
   less than ``perf.plan_min_run_s``; a checkpoint's plan recorded on the same hardware
   and strategy, or the plan cache's, is adopted before the rehearsal);
2. candidates (:mod:`trainer.loop.plan_space`): the configured XLA setting, the whole
   step compiled where the strategy allows XLA (one replica in sync, not TPU, not manual
   data parallelism over several devices) and no XLA, each with ``steps_per_loop`` as
   configured and doubled (at most ``train.log_every_steps``, past which calls end at
   the logging boundary anyway), and, with several workers (the gradients cross hosts),
   each with the configured pack size and one other (when configured 0: packs of half
   the largest gradient, at least an eighth of all; else 0). A setting whose XLA
   lowering fails (an op XLA cannot compile) is dropped with one log line, before it
   runs a step;
3. rounds: every candidate runs a trial of training steps (about ``perf.plan_trial_s``
   seconds, at most 3 % of the estimated run over all trials), in an order rotated each
   round, ``perf.plan_rounds`` rounds; a plan's first call (trace, XLA compilation) is
   not timed. A trial's rate is steps over the host seconds of its loop calls; a plan's
   score is the median over rounds of its rate divided by the configured plan's rate in
   the same round, so the machine's drift cancels;
4. the chief keeps the best score (the configured plan unless another scores above
   1.01) and every worker gets its choice (a plan that differs across workers would
   deadlock their collectives).

Every plan the planner can keep can be pinned with ``perf.plan="fixed"``:
``perf.jit_compile`` (False: ``"off"``, True: ``"grads"``, ``"step"``),
``train.steps_per_loop`` and ``distribute.grad_pack_bytes``.

The decision is a run event (``{"kind": "plan", ...}``: :meth:`Planner.record`) and is
saved in checkpoints; a resumed run on the same hardware and strategy adopts it without
measuring. A measured plan is also kept in the user's plan cache
(:mod:`trainer.loop.plan_cache`): a later run of the same key, short or long, adopts it
before its first step. Host only; the plan's loops are the driver's.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import numpy as np
from absl import logging

from trainer.data import dynamic_shapes_problem
from trainer.distribution import host_collectives
from trainer.loop import plan_cache
from trainer.loop.plan_cache import PlanCache
from trainer.loop.plan_space import Plan, Trial, candidates, pack_alternatives, signature

_TIE = 1.01  # another plan must beat the configured one by more than this to be chosen
_BUDGET = 0.03  # the trials take at most this share of the estimated run


class Planner:
    """Decides the plan of every train loop call of one Trainer (host, every worker).

    The driver asks :meth:`next_plan` before each loop call and reports the call with
    :meth:`after_call`; both run on every worker at the same points, and the chief's
    decisions reach the others through ``from_chief``. XLA is a candidate only with one
    replica in sync, hence one worker: its lowering check needs no agreement.

    Args:
      config: the run's config (``perf.plan``, ``perf.plan_*``).
      baseline: the configured plan.
      xla_problem: why the strategy does not let XLA compile the step (None: it does).
      xla_error: ``setting -> str | None``: the XLA lowering's error for the real step
        with XLA setting ``"grads"`` or ``"step"``, or None; asked once per setting
        before its plans run a step.
      from_chief: ``int32 words -> the chief's words`` (identity on one worker).
      signature: this run's :func:`trainer.loop.plan_space.signature`.
      cache: the plan cache entry of this run's key (the chief's; None on other workers
        or with ``perf.plan_cache="off"``): read by :meth:`adopt`, written when measured.
      pack_sizes: the all-reduce pack sizes to time besides the baseline's
        (:func:`trainer.loop.plan_space.pack_alternatives`; alike on every worker).
    """

    def __init__(self, config: Any, baseline: Plan, xla_problem: str | None,
                 xla_error: Callable[[str], str | None],
                 from_chief: Callable[[np.ndarray], np.ndarray], signature: dict[str, Any],
                 cache: PlanCache | None = None, pack_sizes: tuple[int, ...] = ()):
        self._config = config
        self.baseline = baseline
        self.xla_problem = xla_problem
        self._xla_error = xla_error
        self._from_chief = from_chief
        self._signature = signature
        self._cache = cache
        self.plans = candidates(baseline, config.train.log_every_steps, xla_problem is None,
                                pack_sizes)
        self.chosen: Plan | None = None
        self.record: dict[str, Any] | None = None  # the decision (the run event's fields)
        if config.perf.plan == "fixed":
            self._decide(baseline, "fixed", {})
        self._calls = 0  # loop calls seen while undecided
        self._trial_steps = 0
        self._call_cap = 0  # > 0: trial calls run at most this many steps
        self._trials: list[Trial] = []  # to run, the current one first
        self._done: list[Trial] = []
        self._warm = {baseline.trace_key}  # trace keys whose loops have run
        self._dropped: dict[int, str] = {}
        self._started = 0.0

    @property
    def decided(self) -> bool:
        return self.chosen is not None

    # ------------------------------------------------------------ checkpoint
    def saved(self) -> dict[str, Any] | None:
        """What a checkpoint records: the plan chosen by measuring (or adopted) and the
        signature it holds on; None when the plan is fixed or not decided."""
        if self.record is None or self.record["source"] in ("fixed", "skipped"):
            return None
        return {"chosen": self.chosen.to_dict(), "signature": self._signature}

    def adopt(self, saved: dict[str, Any] | None) -> dict[str, Any] | None:
        """At the start of ``fit()`` (every worker; ``saved`` is read on the chief, None
        elsewhere): adopts a checkpoint's plan recorded on this hardware and strategy,
        else the plan cache's entry of this run's key. Returns the event's fields when it
        decides, else None."""
        if self.decided:
            return None
        index, source, day = self._plan_index(saved, require_signature=True), 1, 0
        if index < 0 and self._cache is not None:
            cached = self._cache.read()
            index, source = self._plan_index(cached, require_signature=False), 2
            day = int(cached["measured_at"][:10].replace("-", "")) if index >= 0 else 0
        words = self._from_chief(np.array([index + 1, source, day], np.int32))
        index, source, day = int(words[0]) - 1, int(words[1]), int(words[2])
        if index < 0:
            return None
        if source == 1:
            return self._decide(self.plans[index], "checkpoint", {})
        return self._decide(self.plans[index], "cached", {
            "measured_at": f"{day // 10000:04d}-{day // 100 % 100:02d}-{day % 100:02d}"})

    def _plan_index(self, saved: dict[str, Any] | None, require_signature: bool) -> int:
        """The index among the candidates of ``saved["chosen"]``; -1 when absent, not a
        candidate or (``require_signature``) recorded under another signature."""
        try:
            plan = Plan.from_dict(saved["chosen"]) if saved else None
        except (KeyError, TypeError, ValueError):  # not a plan this version wrote
            return -1
        if plan not in self.plans or (
                require_signature and saved.get("signature") != self._signature):
            return -1
        return self.plans.index(plan)

    # ------------------------------------------------------------ the loop
    def next_plan(self) -> Plan:
        """The plan of the next loop call."""
        if self.chosen is not None:
            return self.chosen
        if not self._trials:
            return self.baseline
        plan = self.plans[self._trials[0].plan]
        if self._call_cap:  # steps long next to a trial: trial-sized calls
            return dataclasses.replace(
                plan, steps_per_loop=min(plan.steps_per_loop, self._call_cap))
        return plan

    def after_call(self, plan: Plan, steps: int, seconds: float,
                   remaining_steps: int) -> dict[str, Any] | None:
        """After a rehearsal's loop call of ``plan`` (``steps`` steps in ``seconds`` host
        seconds; the run has ``remaining_steps`` to train after the rehearsal). Returns
        the event's fields when it decides."""
        if self.chosen is not None:
            return None
        self._calls += 1
        if self._calls == 1:  # the first call traced the step: an upper bound of its time
            self._started = time.perf_counter()
            return self._skip_if_short(steps, seconds, remaining_steps)
        if self._calls == 2:
            return self._plan_trials(steps, seconds, remaining_steps)
        if plan.trace_key not in self._warm:  # its loops' first call: traced, compiled
            self._warm.add(plan.trace_key)
            return None
        trial = self._trials[0]
        trial.add(steps, seconds, full=steps == plan.steps_per_loop)
        if trial.finished(self._trial_steps, plan.steps_per_loop):
            self._done.append(self._trials.pop(0))
        return None if self._trials else self._choose()

    # ------------------------------------------------------------ decisions
    def single(self) -> dict[str, Any] | None:
        """Before any step: one candidate plan is kept without a rehearsal (alike on
        every worker). None when there is more than one, or already decided."""
        if self.decided or len(self.plans) > 1:
            return None
        return self._decide(self.baseline, "skipped", {"reason": self._too_short(1, 0.0, 0)})

    def ended(self, steps: int) -> dict[str, Any]:
        """The rehearsal ran all the run's ``steps`` before a decision: the configured
        plan, not measured."""
        return self._decide(self.baseline, "skipped", {
            "reason": f"the run's {steps} steps end before the measurement does"})

    def _too_short(self, steps: int, seconds: float, remaining_steps: int) -> str | None:
        """Why the run is not measured when its steps take ``seconds / steps`` each, or
        None (the chief's view; :meth:`_plan_trials` broadcasts it)."""
        estimate = remaining_steps * seconds / max(steps, 1)
        if len(self.plans) == 1:
            return (f"one candidate plan (XLA {self.xla_problem})" if self.xla_problem
                    else "one candidate plan")
        if estimate < self._config.perf.plan_min_run_s:
            return (f"the remaining {remaining_steps} steps take ~{estimate:.1f} s < "
                    f"perf.plan_min_run_s={self._config.perf.plan_min_run_s:g}")
        return None

    def _skip_if_short(self, steps: int, seconds: float,
                       remaining_steps: int) -> dict[str, Any] | None:
        """After the first call: its time (with the trace) bounds the step time from
        above; a run too short even at that rate is not measured (no timed call)."""
        why = self._too_short(steps, seconds, remaining_steps)
        if not self._from_chief(np.array([int(why is not None)], np.int32))[0]:
            return None
        return self._decide(self.baseline, "skipped",
                            {"reason": why or "too short (the chief's estimate)"})

    def _plan_trials(self, steps: int, seconds: float,
                     remaining_steps: int) -> dict[str, Any] | None:
        """After the timed warm-up call: measure or not (the chief's call)."""
        perf = self._config.perf
        step_s = max(seconds / max(steps, 1), 1e-9)
        estimate = remaining_steps * step_s
        trial_s = min(perf.plan_trial_s,
                      _BUDGET * estimate / (len(self.plans) * perf.plan_rounds))
        why = self._too_short(steps, seconds, remaining_steps)
        words = self._from_chief(np.array([int(why is None), max(1, int(trial_s / step_s))],
                                          np.int32))
        if not words[0]:
            return self._decide(self.baseline, "skipped",
                                {"reason": why or "too short (the chief's estimate)"})
        self._trial_steps = int(words[1])
        if self.baseline.steps_per_loop > self._trial_steps:
            # One call is longer than a trial: its per-call host overhead is amortized
            # (well below the noise), so only XLA settings are timed, in trial-sized calls.
            self._call_cap = self._trial_steps
            for i, plan in enumerate(self.plans):
                if plan.steps_per_loop != self.baseline.steps_per_loop:
                    self._dropped[i] = (
                        f"not timed: one call of {self.baseline.steps_per_loop} steps "
                        f"outlasts a trial, so its per-call overhead is amortized")
        warm = {xla for xla, _ in self._warm}
        for setting in dict.fromkeys(p.xla for p in self.plans if p.xla not in warm):
            error = self._xla_error(setting) if setting != "off" else None
            if error is not None:
                self._drop(setting, error)
        live = [i for i in range(len(self.plans)) if i not in self._dropped]
        for r in range(perf.plan_rounds):
            shift = r % len(live)
            self._trials += [Trial(i, r) for i in live[shift:] + live[:shift]]
        if len(live) > 1:
            return None
        return self._decide(self.baseline, "skipped",
                            {"reason": "no other plan to time", **self._table({})})

    def _drop(self, setting: str, error: str) -> None:
        """Drops the plans of XLA ``setting`` (its lowering failed), with one log line."""
        first = (error.strip().splitlines() or ["unknown error"])[0][:300]
        logging.warning("plan: XLA setting %r dropped from the candidates: %s", setting, first)
        for i, plan in enumerate(self.plans):
            if plan.xla == setting:
                self._dropped[i] = f"XLA cannot lower the step: {first}"

    def _scores(self) -> dict[int, float]:
        """Each timed plan's median over rounds of its rate / the baseline's rate in
        the same round."""
        rates = {(t.plan, t.round): t.steps / t.seconds for t in self._done if t.seconds > 0}
        scores = {}
        for i in range(len(self.plans)):
            ratios = [rate / rates[(0, r)] for (p, r), rate in rates.items()
                      if p == i and (0, r) in rates]
            if ratios:
                scores[i] = statistics.median(ratios)
        return scores

    def _table(self, scores: dict[int, float]) -> dict[str, Any]:
        """The event's ``plans`` table: each candidate's median rate and score."""
        rates: dict[int, list[float]] = {}
        for t in self._done:
            if t.seconds > 0:
                rates.setdefault(t.plan, []).append(t.steps / t.seconds)
        return {"plans": [
            {**plan.to_dict(),
             "steps_per_s": statistics.median(rates[i]) if i in rates else None,
             "vs_baseline": scores.get(i),
             **({"dropped": self._dropped[i]} if i in self._dropped else {})}
            for i, plan in enumerate(self.plans)]}

    def _choose(self) -> dict[str, Any]:
        scores = self._scores()
        best = max(scores, key=scores.get)
        index = best if scores[best] > _TIE else 0
        index = int(self._from_chief(np.array([index], np.int32))[0])
        measure_s = time.perf_counter() - self._started
        record = self._decide(self.plans[index], "measured", {
            "ratio": scores.get(index, 1.0), "rounds": self._config.perf.plan_rounds,
            # What measuring added to the run: all of it (the rehearsal's steps are
            # trained again), but the first call, whose trace the run needs anyway.
            "measure_s": measure_s, "cost_s": measure_s,
            **self._table(scores)})
        if self._cache is not None:
            self._cache.write(record)
        return record

    def _decide(self, plan: Plan, source: str, fields: dict[str, Any]) -> dict[str, Any]:
        self.chosen = plan
        self.record = {"source": source, "chosen": plan.to_dict(),
                       "baseline": self.baseline.to_dict(), "ratio": 1.0, "measure_s": 0.0,
                       "plans": [], **fields}
        return self.record


def build(trainer: Any, batch_spec: Any, packs: int,
          xla_error: Callable[[str], str | None]) -> Planner:
    """The planner of ``trainer``'s run on batches of ``batch_spec`` (one replica's), the
    configured plan's all-reduce packs of ``packs`` bytes. The configured XLA setting:
    ``"step"`` with ``perf.jit_compile_step`` where the strategy allows XLA and the
    batches have static shapes (else one warning, and the next setting); ``"grads"``
    with ``perf.jit_compile`` on the default train step (not on batches of dynamic
    shapes: one warning says so); else ``"off"``."""
    t, cfg = trainer, trainer.config
    problem = t.steps.xla_problem or (dynamic_shapes_problem(batch_spec)
                                      if batch_spec is not None else None)
    if cfg.perf.jit_compile_step and problem is not None:
        logging.warning("perf.jit_compile_step=True is not applied: %s.", problem)
    grads = t.steps.keeps_xla_for(batch_spec) and not t.overrides("train_step")
    xla = ("step" if cfg.perf.jit_compile_step and problem is None
           else "grads" if grads else "off")
    workers = host_collectives.num_workers(t.strategy)
    sig = signature(t.strategy, workers)
    return Planner(cfg, Plan(xla, cfg.train.steps_per_loop, packs), t.steps.xla_problem,
                   xla_error, lambda words: host_collectives.words_from_chief(t.strategy, words),
                   sig, plan_cache.for_run(t, batch_spec, sig),
                   pack_alternatives(packs, t.model.trainable_variables, workers))


def announce(record: dict[str, Any] | None, events: Any, step: int) -> None:
    """A decision of the planner (its fields, or None): a run event (``events.plan``)
    when plans were measured or adopted; one log line when nothing was measured."""
    if record is None:
        return
    if record["source"] == "skipped" and not record["plans"]:
        logging.info("plan: %s as configured, not measured: %s",
                     Plan.from_dict(record["chosen"]).describe(), record["reason"])
        return
    events.plan(step, record)
