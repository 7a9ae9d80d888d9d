"""The property bodies, shared by the in-process tests (one replica) and
``tests.properties.run_replicas`` (two replicas, in its own process).

* :func:`check_run`: a drawn run either raises a ConfigError naming an invalid field
  before any step, or ends in a NonFiniteError exactly where the controls promise one,
  or ends at ``train.steps`` (or at the early stop the evaluation values call for) with
  finite weights; its ``metrics.jsonl`` records and checkpoints are exactly those of the
  documented cadences (:mod:`tests.properties.oracle`).
* :func:`check_resume`: a run stopped at a drawn step and resumed by a NEW Trainer on
  the same workdir ends with weights (and EMA) bit-identical to the uninterrupted run's,
  and the appended records are those of both parts.
"""

from __future__ import annotations

import math
import tempfile

import numpy as np
from hypothesis import assume, event, note

from tests.properties import oracle, scenario
from tests.properties.strategies import Case
from trainer.config import ConfigError
from trainer.precision import NonFiniteError


def _as_expected(records: list[dict]) -> list[tuple]:
    """Records as the oracle writes them: (kind, step, loss is NaN | None)."""
    return [(r["kind"], r["step"], math.isnan(r["train/loss"]) if r["kind"] == "train" else None)
            for r in records]


def _assert_config_error_first(outcome: scenario.Outcome, fields: set[str], workdir: str):
    assert isinstance(outcome.error, ConfigError), (
        f"invalid {sorted(fields)} must be a ConfigError, got {outcome.error!r}")
    assert any(field in str(outcome.error) for field in fields), (
        f"the ConfigError must name one of {sorted(fields)}: {outcome.error}")
    assert outcome.loop_ends == [] and outcome.step == 0, (
        f"the ConfigError came after training started (loops ended at {outcome.loop_ends})")
    assert [r for r in scenario.records(workdir) if r["kind"] in ("train", "eval")] == []
    assert scenario.checkpoint_steps(workdir) == []


def _assert_matches(outcome: scenario.Outcome, expected: oracle.Expected, workdir: str,
                    records: list[dict]) -> None:
    if expected.error == "nonfinite":
        assert isinstance(outcome.error, NonFiniteError), (
            f"expected a NonFiniteError at step {expected.final}, got {outcome.error!r}")
    else:
        assert outcome.error is None, f"the run raised {outcome.error!r}"
        assert all(np.isfinite(w).all() for w in outcome.weights), "non-finite weights"
    assert outcome.step == expected.final
    got = _as_expected([r for r in records if r["kind"] in ("train", "eval", "rollback")])
    assert got == expected.records, f"records {got}\n  expected {expected.records}"
    assert scenario.checkpoint_steps(workdir) == sorted(expected.saved)


def check_run(case: Case) -> None:
    """Property of any drawn run (see the module docstring)."""
    note(f"case: {case}")
    # The user-code-errors branch fixes this crash; do not find it twice.
    assume(not oracle.hits_rollback_telemetry_crash(case))
    with tempfile.TemporaryDirectory() as workdir:
        outcome = scenario.fit(case, workdir)
        note(f"outcome: error={outcome.error!r}, step={outcome.step}, "
             f"loops={outcome.loop_ends}")
        fields = oracle.config_error_fields(case)
        if fields:
            event("config error")
            _assert_config_error_first(outcome, fields, workdir)
            return
        records = scenario.records(workdir)
        expected = oracle.simulate(case, [r for r in records if r["kind"] == "eval"])
        event(_label(case, expected))
        _assert_matches(outcome, expected, workdir, records)


def _label(case: Case, expected: oracle.Expected) -> str:
    """What kind of run the example was (hypothesis statistics)."""
    if expected.error:
        return "ends in NonFiniteError"
    if expected.rollback_loop:
        return "rolls back"
    if expected.final < case.get("train.steps"):
        return "stops early"
    return "skips a poisoned step" if case.poison_step is not None else "runs to the end"


def check_resume(case: Case) -> None:
    """Property of a run stopped at ``case.stop_at`` and resumed (module docstring)."""
    note(f"case: {case}")
    with tempfile.TemporaryDirectory() as whole_dir, tempfile.TemporaryDirectory() as split:
        whole = scenario.fit(case, whole_dir)
        assert whole.error is None, f"the uninterrupted run raised {whole.error!r}"
        first = scenario.fit(case, split, stop_at=case.stop_at)
        assert first.error is None, f"the stopped run raised {first.error!r}"
        expected_first = oracle.simulate(case, (), stop_at=case.stop_at)
        assert first.step == expected_first.final
        resumed = scenario.fit(case, split)
        note(f"stopped at {first.step}, resumed loops {resumed.loop_ends}")
        assert resumed.error is None, f"the resumed run raised {resumed.error!r}"
        assert resumed.step == case.get("train.steps")
        assert len(resumed.weights) == len(whole.weights)
        for i, (got, want) in enumerate(zip(resumed.weights, whole.weights)):
            np.testing.assert_array_equal(got, want, err_msg=f"array {i} after resume")
        rest = oracle.simulate(case, (), start=first.step)
        records = scenario.records(split)
        got = _as_expected([r for r in records if r["kind"] in ("train", "eval")])
        want = expected_first.records + rest.records
        assert got == want, f"records {got}\n  expected {want}"
