"""The benchmarks as one suite: which modules of ``benchmarks/`` are benchmarks, in
which group, and running a subset of them one after another, each in its own process.

A group is a sub-package of ``benchmarks/`` (``benchmarks/GROUP/__init__.py``); the
first paragraph of its docstring is the question its benchmarks answer. Groups are
shown in :data:`ORDER`, any other after them by name; one that holds no benchmark
(``benchmarks/common``, the shared helpers) is not shown.

A module of a group is a benchmark when it defines a top-level ``main`` function AND
runs it under ``if __name__ == "__main__":`` (what ``python -m benchmarks.GROUP.NAME``
needs), unless it sets ``PART_OF = "benchmarks.GROUP.OTHER"``: a process another
benchmark starts (a worker), not run on its own. Helpers (workloads, implementations,
datasets) have no ``main``. Read from the source (``ast``), never imported: listing
starts no TensorFlow. A benchmark is named by its module's short name (``NAME``),
unique across the groups and never a group's name.

A benchmark needs root when its docstring says "Needs root" (it makes network
namespaces or shapes links with ``tc``: the simulated hosts of ``tests/cluster``).
Its summary is its docstring's first sentence (up to the first blank line).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence, TextIO

HERE = Path(__file__).resolve().parent
ROOT_MARK = "Needs root"
ORDER = ("speed", "overhead", "parallel", "checkpoints", "device")


@dataclass(frozen=True)
class Benchmark:
    """One runnable benchmark module, ``python -m benchmarks.<group>.<name>``."""

    group: str
    name: str
    summary: str
    needs_root: bool

    @property
    def module(self) -> str:
        return f"benchmarks.{self.group}.{self.name}"


@dataclass(frozen=True)
class Group:
    """A sub-package of benchmarks: the question they answer, and them by name."""

    name: str
    question: str
    benchmarks: tuple[Benchmark, ...]


def _runs_main(tree: ast.Module) -> bool:
    """A top-level ``def main`` and an ``if __name__ == "__main__":`` block."""
    has_main = any(isinstance(node, ast.FunctionDef) and node.name == "main"
                   for node in tree.body)
    guarded = any(isinstance(node, ast.If) and "__name__" in ast.unparse(node.test)
                  and "__main__" in ast.unparse(node.test) for node in tree.body)
    return has_main and guarded


def _part_of(tree: ast.Module) -> str | None:
    """The value of a top-level ``PART_OF = "..."``, else None."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and any(isinstance(t, ast.Name) and t.id == "PART_OF" for t in node.targets)):
            return str(node.value.value)
    return None


def _summary(docstring: str) -> str:
    """The docstring's first paragraph on one line."""
    return " ".join(docstring.strip().split("\n\n")[0].replace("``", "").split())


def read(path: Path) -> Benchmark | None:
    """The benchmark in ``path`` (a module of the group ``path.parent``), or None when
    it is not one (module docstring above)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if not _runs_main(tree) or _part_of(tree) is not None:
        return None
    docstring = ast.get_docstring(tree) or ""
    return Benchmark(group=path.parent.name, name=path.stem, summary=_summary(docstring),
                     needs_root=ROOT_MARK in docstring)


def read_group(package: Path) -> Group:
    """The group of the sub-package ``package``: its question and its benchmarks, by name."""
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    found = (read(path) for path in sorted(package.glob("*.py"))
             if not path.name.startswith("_"))
    return Group(package.name, _summary(docstring),
                 tuple(benchmark for benchmark in found if benchmark is not None))


def _check_names(groups: Sequence[Group]) -> None:
    """Raises ValueError when two benchmarks share a short name, or one is named like
    a group: ``python -m benchmarks NAME`` must name one benchmark."""
    names = [b.name for b in every_benchmark(groups)]
    clashes = sorted({n for n in names if names.count(n) > 1}
                     | set(names) & {g.name for g in groups})
    if clashes:
        raise ValueError(f"benchmark names used twice or by a group: {', '.join(clashes)}")


def discover(directory: Path = HERE) -> list[Group]:
    """Every group of ``directory`` that holds a benchmark, in :data:`ORDER` then by name."""
    packages = [path for path in directory.iterdir()
                if (path / "__init__.py").is_file() and not path.name.startswith("_")]
    packages.sort(key=lambda path: (ORDER.index(path.name) if path.name in ORDER
                                    else len(ORDER), path.name))
    groups = [group for group in map(read_group, packages) if group.benchmarks]
    _check_names(groups)
    return groups


def every_benchmark(groups: Iterable[Group]) -> list[Benchmark]:
    """The benchmarks of ``groups``, group after group."""
    return [benchmark for group in groups for benchmark in group.benchmarks]


def format_list(groups: Sequence[Group]) -> str:
    """Per group a heading ``GROUP: question``, then one line per benchmark: two spaces,
    its name, ``root`` when it needs it, its summary."""
    benchmarks = every_benchmark(groups)
    width = max((len(b.name) for b in benchmarks), default=0)
    lines = []
    for group in groups:
        lines.append(f"{group.name}: {group.question}")
        lines += [f"  {b.name:<{width}}  {'root' if b.needs_root else '    '}  {b.summary}"
                  for b in group.benchmarks]
        lines.append("")
    lines.append(f"{len(benchmarks)} benchmarks in {len(groups)} groups. Run: python -m "
                 "benchmarks NAME [NAME ...] [-- ARGS]; one's flags: python -m benchmarks "
                 "NAME -- --help")
    return "\n".join(lines)


def select(names: Sequence[str], benchmarks: Sequence[Benchmark]) -> list[Benchmark]:
    """The named benchmarks, in the order given; an unknown name is a one-line error."""
    by_name = {b.name: b for b in benchmarks}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise SystemExit(f"no benchmark named {', '.join(unknown)}: "
                         "`python -m benchmarks --list` lists them")
    return [by_name[name] for name in names]


def run(benchmarks: Sequence[Benchmark], args: Sequence[str], *, is_root: bool,
        out: TextIO = sys.stdout) -> int:
    """Runs each benchmark as ``python -m benchmarks.GROUP.NAME ARGS`` from the
    repository, one after another, its output going to this process's; one that needs
    root is skipped (said) when ``is_root`` is False. Returns how many failed or were
    skipped."""
    failed = 0
    for benchmark in benchmarks:
        command = [sys.executable, "-m", benchmark.module, *args]
        print(f"\n=== {' '.join(['python', *command[1:]])}", file=out, flush=True)
        if benchmark.needs_root and not is_root:
            print(f"skipped: {benchmark.module} needs root (simulated hosts): "
                  "run it with sudo", file=out, flush=True)
            failed += 1
            continue
        code = subprocess.run(command, cwd=HERE.parent, check=False).returncode
        if code != 0:
            print(f"=== {benchmark.module} exited {code}", file=out, flush=True)
            failed += 1
    return failed


def running_as_root() -> bool:
    """Whether this process may make network namespaces and shape links."""
    return os.geteuid() == 0
