"""A sweep whose study lives in a REAL PostgreSQL server (``--storage=postgresql://``).

Needs the server ``tests/postgres/start_local_postgres.sh`` starts (``.ci/run`` does)
and the driver ``psycopg2`` (the [test] extra); the URL is ``TEST_POSTGRES_URL``.
Without them the test skips with the reason, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import os
import uuid

import optuna
import pytest
import sqlalchemy

from tests.sweep.runs import TINY, status, sweep

URL = os.environ.get("TEST_POSTGRES_URL", "postgresql+psycopg2://sweep:sweep@127.0.0.1:5432/sweep")
START_SCRIPT = "tests/postgres/start_local_postgres.sh"


def postgres_problem() -> str | None:
    """Why the test's PostgreSQL cannot be used, or None."""
    try:
        engine = sqlalchemy.create_engine(URL, connect_args={"connect_timeout": 10})
        engine.connect().close()
    except ImportError as error:
        return f"no driver for {URL}: {error} (pip install -e '.[test]')"
    except sqlalchemy.exc.SQLAlchemyError as error:
        return f"{URL} does not answer: {str(error).strip().splitlines()[0]}"
    return None


def test_two_trials_at_once_in_a_postgresql_study(tmp_path):
    problem = postgres_problem()
    if problem:
        message = f"no PostgreSQL server: {problem}. Start one with `sudo {START_SCRIPT}`."
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message} CI=true: the PostgreSQL test must run, not skip.")
        pytest.skip(message)
    root, name = tmp_path / "pg", f"test-{uuid.uuid4().hex[:12]}"
    try:
        run = sweep(f"--workdir={root}", "--trials=2", "--parallel=2", f"--storage={URL}",
                    f"--study={name}", *TINY)
        assert run.returncode == 0, run.stderr[-3000:]
        table = status(root, f"--storage={URL}", f"--study={name}")
        assert {n: (r["state"], r["step"]) for n, r in table.items()} == {
            "0000": ("COMPLETE", "100"), "0001": ("COMPLETE", "100")}
        assert not (root / "study.db").exists()
    finally:
        if name in optuna.study.get_all_study_names(URL):
            optuna.delete_study(study_name=name, storage=URL)
