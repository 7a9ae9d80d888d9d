"""The suite's split over two pytest-xdist workers (tests/support/worker_groups.py): what
shares a worker, and the refusal when xdist did not group."""

from __future__ import annotations

from tests.support.worker_groups import module_of, ungrouped_problem, worker_groups


def test_a_module_is_one_group_named_by_its_path():
    groups = worker_groups([("tests/loop/test_a.py::test_x", ["tmp_path"]),
                            ("tests/loop/test_a.py::test_y[1]", []),
                            ("tests/loop/test_b.py::test_z", [])])
    assert groups == {"tests/loop/test_a.py::test_x": "loop/test_a",
                      "tests/loop/test_a.py::test_y[1]": "loop/test_a",
                      "tests/loop/test_b.py::test_z": "loop/test_b"}
    assert module_of("tests/test_config.py::test_x") == "test_config"


def test_modules_sharing_a_session_fixture_are_one_group_named_after_it():
    groups = worker_groups([
        ("tests/a/test_1.py::t", ["cluster"]),
        ("tests/a/test_1.py::u", []),  # no fixture, but its module uses one
        ("tests/a/test_2.py::t", ["gcs", "cluster"]),
        ("tests/b/test_3.py::t", ["workers"]),
        ("tests/b/test_4.py::t", ["workers", "cluster"]),  # joins both fixtures' groups
        ("tests/c/test_5.py::t", ["tmp_path"]),
    ], shared=("cluster", "workers"))
    assert set(groups.values()) == {"cluster", "c/test_5"}
    assert groups["tests/a/test_1.py::u"] == groups["tests/b/test_3.py::t"] == "cluster"


def test_ids_without_their_group_are_refused_naming_the_cause_and_the_fix():
    assert ungrouped_problem(True, ["tests/a.py::t@a", "tests/a.py::u@a"]) is None
    assert ungrouped_problem(False, ["tests/a.py::t"]) is None  # not loadgroup
    problem = ungrouped_problem(True, ["tests/a.py::t@a", "tests/b.py::u"])
    assert "pytest-xdist issue #1386" in problem and "pytest<9.2" in problem
