"""Every fenced code block of README.md and docs/*.md runs as written, so the docs
cannot drift from the code (what runs and how: :mod:`tests.docs.code_blocks`).

Each page runs in its own copy of the repository root (symlinks, plus the page's
``# FILE:`` blocks), so relative paths work as written. The python blocks of a page run
in one process, in order; commands sharing a workdir run in order; the rest run two at
a time.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import pytest

from tests.docs.code_blocks import (Block, Command, all_blocks, blocks, commands, matches,
                                    problems, rewrite, workdir_of)
from tests.support.helpers import REPO, subprocess_env
from tests.support.run_models import write_fake_tfds

RUNNABLE = [b for b in all_blocks() if b.language in ("python", "bash", "console")]
Failures = list[tuple[str, str]]  # (block id, what went wrong)


class Page:
    """One page's project directory, temporary directory and environment."""

    def __init__(self, page: Path, tmp: Path, data_dir: str):
        self.tmp = tmp / page.stem
        self.project = self.tmp / "project"  # stands in for the repository root
        self.project.mkdir(parents=True)
        self.data_dir = data_dir
        for entry in REPO.iterdir():
            if not entry.name.startswith("."):
                (self.project / entry.name).symlink_to(entry)
        for block in blocks(page):
            if block.file:
                (self.project / block.file).parent.mkdir(parents=True, exist_ok=True)
                (self.project / block.file).write_text(block.body)
        self.env = subprocess_env()
        self.env["PYTHONPATH"] = f"{self.project}:{self.env['PYTHONPATH']}"

    def local(self, text: str) -> str:
        return text.replace("/tmp/", f"{self.tmp}/")


def run_commands(page: Page, group: list[Command]) -> Failures:
    failures = []
    for command in group:
        env = {**page.env, **{k: page.local(v) for k, v in command.env.items()}}
        proc = subprocess.run(rewrite(command.text, page.tmp, page.data_dir), cwd=page.project,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=900)
        status = 0 if command.status is None and command.block.language == "bash" else command.status
        if (status is not None and proc.returncode != status) or not matches(command.expect, proc.stdout):
            failures.append((command.block.id, f"$ {command.text}\nexit status {proc.returncode}"
                             f" (expected {status}); expected output {command.expect}; got:\n"
                             f"{proc.stdout[-4000:]}"))
    return failures


def run_python(page: Page, group: list[Block]) -> Failures:
    spec = [{"id": b.id, "source": page.local(b.body),
             "module": b.file[:-len(".py")].replace("/", ".") if b.file else None}
            for b in group]
    spec_path = page.tmp / "python_blocks.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "tests.docs.run_python_blocks", str(spec_path)],
                          cwd=page.project, env=page.env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("BLOCK-RESULT "):
            result = json.loads(line[len("BLOCK-RESULT "):])
            results[result["id"]] = result["error"]
    return [(b.id, results[b.id] + proc.stdout[-3000:] if b.id in results
             else f"the block never ran (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
            for b in group if b.id not in results or results[b.id] is not None]


Task = tuple[int, Callable[[], Failures]]  # (processes it starts, the run)


def page_tasks(page_path: Path, tmp: Path, data_dir: str) -> list[Task]:
    runnable = [b for b in blocks(page_path) if b.runs]
    if not runnable:
        return []
    page = Page(page_path, tmp, data_dir)
    tasks: list[Task] = []
    python = [b for b in runnable if b.language == "python"]
    if python:
        tasks.append((1, lambda: run_python(page, python)))
    groups: dict[str, list[Command]] = {}
    for block in runnable:
        if block.language == "console":  # "$ echo $?" refers to the command before
            groups[block.id] = commands(block)
        elif block.language == "bash":
            for command in commands(block):
                groups.setdefault(workdir_of(command), []).append(command)
    tasks += [(sum(processes(c) for c in group), lambda group=group: run_commands(page, group))
              for group in groups.values()]
    return tasks


def processes(command: Command) -> int:
    """About how many TensorFlow processes the command starts (to start big ones first)."""
    if "--emit" in command.text:
        return 0
    counts = [int(n) for n in re.findall(r"--(?:workers|data_service_workers) (\d+)", command.text)]
    return 1 + sum(counts) + 2 * ("trainer.doctor" in command.text)


@pytest.fixture(scope="module")
def block_failures(tmp_path_factory) -> dict[str, list[str]]:
    tmp = tmp_path_factory.mktemp("docs")
    data_dir = write_fake_tfds(str(tmp / "tfds"))
    pages = sorted({b.page for b in RUNNABLE})
    tasks = sorted((task for page in pages for task in page_tasks(page, tmp, data_dir)),
                   key=lambda task: -task[0])
    failures: dict[str, list[str]] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for found in pool.map(lambda task: task[1](), tasks):
            for block_id, message in found:
                failures.setdefault(block_id, []).append(message)
    return failures


def test_every_block_has_a_language_and_runs_or_says_why_not():
    found = [problem for block in all_blocks() for problem in problems(block)]
    assert not found, "\n".join(found)


def test_the_guide_trains_every_model_and_the_trainer_its_config_names():
    guide = blocks(REPO / "docs" / "guide.md")
    run = [c for b in guide if b.runs and b.language == "bash" for c in commands(b)]
    assert len(run) >= 15
    models = {m for c in run for m in re.findall(r"models/configs/(\w+)\.py", c.text)}
    assert {"digits", "mnist", "cifar10", "lm", "gan"} <= models
    files = {b.file: b.body for b in guide if b.file}
    assert "my_project.trainer:SpiralTrainer" in files["my_project/config.py"]
    assert "class SpiralTrainer(trainer.Trainer)" in files["my_project/trainer.py"]


@pytest.mark.timeout(1800)  # the first one waits for every block (two at a time)
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.id)
def test_code_block_runs(block_failures, block):
    if block.not_run is not None:
        pytest.skip(f"not run: {block.not_run}")
    failures = block_failures.get(block.id, [])
    assert not failures, "\n\n".join(failures)
