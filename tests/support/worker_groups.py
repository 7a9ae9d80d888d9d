"""Which tests share a pytest-xdist worker (the suite runs ``pytest -n 2 --dist loadgroup``).

A module's tests always share one: its module fixtures (a ``trainer.main`` run started
with the module, a 2-replica process) are made once. Modules that use one of
:data:`SHARED_SESSION_FIXTURES` share one too: the simulated cluster belongs to one pytest
process at a time (a lock in its directory), and the others are minutes of training or
long-lived workers made once per process.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

SHARED_SESSION_FIXTURES = ("simulated_cluster", "s3_bucket", "spec_workers", "replica_runs",
                           "control_runs", "numerics_runs")


def module_of(nodeid: str) -> str:
    """``tests/checks/test_hooks.py::test_x[a]`` -> ``checks/test_hooks``."""
    path = nodeid.split("::", 1)[0]
    return path.removeprefix("tests/").removesuffix(".py")


def worker_groups(tests: Iterable[tuple[str, Sequence[str]]],
                  shared: Sequence[str] = SHARED_SESSION_FIXTURES) -> Mapping[str, str]:
    """{nodeid: group} for ``(nodeid, fixture names)`` pairs: one group per module, the
    modules using a fixture of ``shared`` merged into one group named after the
    fixture (the first of ``shared`` when a group uses several)."""
    tests = list(tests)
    parent: dict[str, str] = {}  # union-find over module and fixture names

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    def rank(name: str) -> int:  # a fixture's name outranks a module's: it names the group
        return shared.index(name) if name in shared else len(shared)

    for nodeid, fixtures in tests:
        for fixture in (f for f in shared if f in fixtures):
            first, second = sorted((root(fixture), root(module_of(nodeid))), key=rank)
            parent[second] = first
    return {nodeid: root(module_of(nodeid)) for nodeid, _ in tests}


def ungrouped_problem(loadgroup: bool, nodeids: Sequence[str]) -> str | None:
    """What is wrong when xdist's loadgroup mode did not mark the collected ids with their
    group (``id@group``): pytest 9.2 made xdist's marking a no-op, and the tests of the
    simulated cluster would then wait on each other's lock."""
    if not loadgroup or not nodeids or all("@" in nodeid for nodeid in nodeids):
        return None
    return (f"pytest-xdist did not group the tests ({nodeids[0]} has no @group): pytest 9.2 "
            f"breaks --dist loadgroup (pytest-xdist issue #1386). Install the [test] "
            f"extra's pytest (pip install -e \".[test]\": pytest<9.2), or run without -n.")
