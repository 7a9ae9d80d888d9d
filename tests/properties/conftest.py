"""Fixtures of the property tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spec_workers(tmp_path_factory):
    """A model-spec worker on 1 and on 2 replicas (tests/properties/run_spec_worker.py),
    started once for the session: test_model_properties.py and the cases it found in
    test_found_by_properties.py send their specs to the same two processes."""
    from tests.properties.run_spec_worker import start_workers

    workers = start_workers(str(tmp_path_factory.mktemp("model_specs")))
    yield workers
    for worker in workers.values():
        worker.stop()
