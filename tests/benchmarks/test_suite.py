"""The benchmarks as one suite (``python -m benchmarks``) and their one table format.

No TensorFlow starts here: listing reads the modules' source, the table needs none.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest

from benchmarks import suite
from benchmarks.common import table
from tests.support.helpers import REPO, subprocess_env

BENCHMARKS = REPO / "benchmarks"
GROUPS = {"speed", "overhead", "parallel", "checkpoints", "device"}
MAIN = 'def main():\n    pass\n\n\nif __name__ == "__main__":\n    main()\n'


def runnable_modules() -> set[str]:
    """Computed here from the files, apart from the suite's own reading: a module of a
    sub-package with a top-level ``def main(`` and an ``if __name__ == "__main__":``
    line, less those that declare ``PART_OF`` (a worker another benchmark starts)."""
    names = set()
    for path in BENCHMARKS.glob("*/*.py"):
        source = path.read_text()
        if (re.search(r"^def main\(", source, re.M)
                and re.search(r"^if __name__ == [\"']__main__[\"']:", source, re.M)
                and not re.search(r"^PART_OF = ", source, re.M)
                and not path.name.startswith("_")):
            names.add(path.stem)
    return names


def list_output() -> str:
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "tensorflow" not in proc.stderr.lower()
    return proc.stdout


def listed() -> dict[str, str]:
    """The benchmarks' lines of ``--list`` (indented under their group's heading), by name."""
    rows = [line for line in list_output().splitlines() if line.startswith("  ")]
    return {line.split()[0]: line for line in rows}


def test_list_names_every_module_that_runs_a_main():
    rows = listed()
    assert set(rows) == runnable_modules()
    expected = {"throughput", "checkpoint", "controls", "multihost_throughput", "chaos_run",
                "bucket_checkpoint", "device_check"}  # the known ones
    assert expected <= set(rows)
    assert not {"workloads", "throughput_impls", "multihost_worker", "suite", "table"} & set(rows)


def test_list_groups_the_benchmarks_under_the_question_they_answer():
    heading, under = "", {}
    for line in list_output().splitlines():
        if line.startswith("  "):
            under[line.split()[0]] = heading
        elif line:
            heading = line
    questions = {group.name: group.question for group in suite.discover()}
    assert set(questions) == GROUPS and not GROUPS & set(under)
    for name, heading in under.items():
        group, _, question = heading.partition(": ")
        assert (BENCHMARKS / group / f"{name}.py").is_file(), heading
        assert question == questions[group] and question.endswith("?"), heading
    assert under["throughput"].startswith("speed: ")
    assert under["bucket_checkpoint"].startswith("checkpoints: ")


def test_every_listed_benchmark_has_its_command_in_the_readme():
    readme = (BENCHMARKS / "README.md").read_text()
    missing = [b.module for b in suite.every_benchmark(suite.discover())
               if not re.search(rf"python -m {re.escape(b.module)}\b", readme)]
    assert not missing, f"benchmarks/README.md has no section running {missing}"


def test_list_says_which_need_root_and_gives_each_summary():
    rows = listed()
    for name in ("multihost_throughput", "chaos_run"):
        assert rows[name].split()[1] == "root", rows[name]
    assert rows["throughput"].split()[1] != "root"
    assert "the framework vs the loops a user would write instead" in rows["throughput"]


def test_discovery_rules_on_a_directory_of_its_own(tmp_path):
    group = tmp_path / "group_a"
    group.mkdir()
    (group / "__init__.py").write_text('"""Is A fast?\n\nMore."""\n')
    (group / "bench_a.py").write_text('"""A bench.\n\nMore."""\n' + MAIN)
    (group / "bench_root.py").write_text('"""Shaped links.\n\nNeeds root: tc."""\n' + MAIN)
    helpers = tmp_path / "helpers"  # a package without benchmarks: no group shown
    helpers.mkdir()
    (helpers / "__init__.py").write_text('"""Shared."""\n')
    (helpers / "worker.py").write_text('"""W."""\nPART_OF = "benchmarks.group_a.bench_a"\n' + MAIN)
    (helpers / "helper.py").write_text('"""Helpers."""\ndef main():\n    pass\n')
    (tmp_path / "stray.py").write_text('"""Not in a group."""\n' + MAIN)
    assert suite.discover(tmp_path) == [suite.Group("group_a", "Is A fast?", (
        suite.Benchmark("group_a", "bench_a", "A bench.", needs_root=False),
        suite.Benchmark("group_a", "bench_root", "Shaped links.", needs_root=True)))]
    assert suite.Benchmark("group_a", "bench_a", "", False).module == "benchmarks.group_a.bench_a"


def test_groups_come_in_their_order_and_names_name_one_benchmark(tmp_path):
    for name in ("zeta", "alpha", "speed"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f'"""{name}?"""\n')
        (tmp_path / name / f"bench_{name}.py").write_text('"""B."""\n' + MAIN)
    assert [g.name for g in suite.discover(tmp_path)] == ["speed", "alpha", "zeta"]
    (tmp_path / "alpha" / "bench_zeta.py").write_text('"""B."""\n' + MAIN)
    with pytest.raises(ValueError, match="bench_zeta"):
        suite.discover(tmp_path)
    (tmp_path / "alpha" / "bench_zeta.py").rename(tmp_path / "alpha" / "zeta.py")
    with pytest.raises(ValueError, match="zeta"):
        suite.discover(tmp_path)


def test_a_benchmark_needing_root_is_skipped_and_counted_without_root():
    benchmark = suite.Benchmark("checkpoints", "bucket_checkpoint", "x", needs_root=True)
    out = io.StringIO()
    assert suite.run([benchmark], [], is_root=False, out=out) == 1
    assert "skipped: benchmarks.checkpoints.bucket_checkpoint needs root" in out.getvalue()


def test_unknown_name_is_one_line_naming_the_list():
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "no_such_bench"], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.strip() == ("no benchmark named no_such_bench: "
                                   "`python -m benchmarks --list` lists them")


def test_table_has_the_machine_line_and_paired_ratios():
    rows = [table.from_rounds("c", [100.0, 200.0, 150.0], "ex/s", [100.0, 200.0, 150.0]),
            table.from_rounds("a", [120.0, 180.0, 300.0], "ex/s", [100.0, 200.0, 150.0]),
            table.Row("restore", 3.27, "s", spread=(2.82, 3.36)),
            table.Row("e", None, "ex/s", note="failed: InvalidArgumentError")]
    text = table.format_table("throughput, mlp / default", rows, baseline="c")
    lines = text.splitlines()
    assert lines[0] == "### throughput, mlp / default"
    assert lines[1].startswith("machine: ") and "cores" in lines[1]
    assert f"TensorFlow {table.tensorflow_version()}" in lines[1]
    assert re.search(r"; \d{4}-\d\d-\d\d \d\d:\d\d UTC; load ", lines[1])
    assert lines[2] == ("| what | value | unit | vs c [min..max] | spread (min..max) "
                        "| note |")
    assert lines[4] == "| c | 150 | ex/s | 1.00 [1.00..1.00] | 100..200 |  |"
    # per-round ratios 1.2, 0.9, 2.0: median 1.2, the median of the values is 180
    assert lines[5] == "| a | 180 | ex/s | 1.20 [0.90..2.00] | 120..300 |  |"
    assert lines[6] == "| restore | 3.27 | s | - | 2.82..3.36 |  |"
    assert lines[7] == "| e | - | ex/s | - | - | failed: InvalidArgumentError |"


def test_a_table_without_baseline_has_no_ratio_column_name():
    text = table.format_table("evaluator_lag", [table.Row("lag", 25.0, "steps", spread=(0, 50)),
                                                table.Row("commit -> result", 1.0, "s"),
                                                table.Row("bf16", 0.05, "max|dw|")])
    lines = text.splitlines()
    assert lines[2] == "| what | value | unit | ratio [min..max] | spread (min..max) | note |"
    assert lines[4] == "| lag | 25.0 | steps | - | 0.00..50.0 |  |"
    assert lines[5] == "| commit -> result | 1.00 | s | - | - |  |"
    assert lines[6] == "| bf16 | 0.0500 | max\\|dw\\| | - | - |  |"  # a pipe cannot end a cell


def test_the_root_only_benchmarks_format_their_results_in_the_table():
    """multihost_throughput and chaos_run need simulated hosts: their formatting is
    checked here on sample results."""
    from benchmarks.checkpoints import chaos_run
    from benchmarks.parallel import multihost_throughput

    text = multihost_throughput.format_row({
        "workload": "deep_mlp", "link": "1gbit", "compute_s": 0.07, "plan": "3.89 MiB",
        "rounds": {"hand": [300.0, 290.0], "framework": [390.0, 290.0]},
        "hand": 295.0, "hand_vs_hand": 1.0, "hand_wait_s": 0.36,
        "framework": 340.0, "framework_vs_hand": 1.15, "framework_wait_s": 0.3})
    lines = text.splitlines()
    assert lines[0] == ("### multihost_throughput: deep_mlp, link 1gbit, compute 0.070 s/step; "
                        "plan 3.89 MiB")
    assert lines[2].startswith("| what | value | unit | vs hand [min..max] |")
    assert lines[5] == ("| framework | 340 | ex/s | 1.15 [1.00..1.30] | 290..390 "
                        "| wait 0.300 s/step |")

    lines = chaos_run.format_summary("chaos_run", 1.2e-7, 374.0, 181.0,
                                     {"overall": 0.48}).splitlines()
    assert lines[4] == ("| max\\|dw\\| vs the uninterrupted run | 1.20e-07 | max\\|dw\\| "
                        "| - | - |  |")
    assert lines[5] == "| wall time, all attempts | 374 | s | 2.07 | - |  |"
    assert lines[7].startswith("| goodput, overall | 0.480 | goodput |")
