"""docs/guide.md is runnable: every command in its ``bash`` blocks runs on CPU with tiny
step counts (or is listed in NOT_RUN with the reason), and its ``# FILE:`` code blocks
are the files the "your own trainer" command trains.

The commands run from a temporary copy of the repository root (symlinks, plus the
``# FILE:`` blocks), so relative paths work as written. Rewrites before running:
``/tmp/guide/...`` paths go to a temporary directory, ``--config.data.data_dir`` points
at a prepared data directory of random images (:func:`tests.run_models.write_fake_tfds`,
nothing is downloaded), and training commands get tiny settings (``train.steps=4``, a
small batch, a smaller network: :data:`TINY`) for every field they do not set themselves
(so the resume example keeps its 300 and 600 steps). A ``# -> text`` comment after a
command is output the command must print. Commands sharing a workdir run in order; the
others run two at a time.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env
from tests.run_models import write_fake_tfds

GUIDE = REPO / "docs" / "guide.md"
RUN = ("python -m trainer.main", "python -m launch.mirrored", "python -m launch.multiworker",
       "python -m trainer.doctor")
NOT_RUN = {  # a substring of the command -> why the test does not run it
    "pip install": "installation; .ci/run installs the package exactly so",
    "tfds build": "downloads the dataset (needs internet)",
    "--config.data.download=True": "downloads the dataset (needs internet)",
    "launch.mirrored --gpus": "needs two GPUs",
    "python -m launch.tpu": "needs a TPU (tests/test_launch_tpu.py covers the no-TPU path)",
}
TINY = {"train.steps": 4, "train.steps_per_loop": 2, "train.log_every_steps": 2,
        "eval.steps": 2, "train.global_batch_size": 16}
TINY_MODEL = {  # config file -> smaller network settings
    "cifar10": {"model.blocks_per_stage": 1, "model.widths": "(8, 16)"},
    "lm": {"model.d_model": 32, "model.mlp_dim": 64, "model.layers": 1, "data.seq_len": 32},
}
DOCTOR_TINY = ["--steps=5", "--max_batch_doublings=1"]


@dataclass
class Command:
    text: str  # as written in the guide (continuations joined)
    expect: list[str] = field(default_factory=list)  # "# -> ..." annotations

    @property
    def exempt(self) -> str | None:
        return next((why for key, why in NOT_RUN.items() if key in self.text), None)


def code_blocks(markdown: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", markdown, flags=re.S | re.M)


def guide_commands(markdown: str) -> list[Command]:
    commands = []
    for language, body in code_blocks(markdown):
        if language != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            text, _, expect = line.partition("# -> ")
            text = text.strip()
            if text and not text.startswith("#"):
                commands.append(Command(text, [expect.strip()] if expect else []))
    return commands


def guide_files(markdown: str) -> dict[str, str]:
    files = {}
    for language, body in code_blocks(markdown):
        first, _, rest = body.partition("\n")
        if language == "python" and first.startswith("# FILE: "):
            files[first[len("# FILE: "):].strip()] = rest
    return files


def overridden(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0][len("--config."):] for a in argv if a.startswith("--config.")}


def rewrite(command: Command, tmp: Path, data_dir: str) -> list[str]:
    argv = shlex.split(command.text.replace("/tmp/guide/", f"{tmp}/guide/"))
    assert argv[:2] == ["python", "-m"], command.text
    out = [sys.executable, "-m", argv[2]]
    out += [f"--config.data.data_dir={data_dir}" if a.startswith("--config.data.data_dir=")
            else a for a in argv[3:]]
    if argv[2] == "trainer.doctor":
        return out + DOCTOR_TINY
    if "--emit" in argv:
        return out
    config = re.search(r"--config=\S*?(\w+)\.py", command.text)
    tiny = {**TINY, **TINY_MODEL.get(config.group(1) if config else "", {})}
    return out + [f"--config.{k}={v}" for k, v in tiny.items() if k not in overridden(argv)]


def workdir_of(command: Command) -> str:
    match = re.search(r"--workdir=(\S+)", command.text)
    return match.group(1) if match else command.text


@pytest.fixture(scope="module")
def guide_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("guide")
    project = tmp / "project"  # stands in for the repository root
    project.mkdir()
    for entry in REPO.iterdir():
        if not entry.name.startswith("."):
            (project / entry.name).symlink_to(entry)
    markdown = GUIDE.read_text()
    for path, source in guide_files(markdown).items():
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text(source)
    data_dir = write_fake_tfds(str(tmp / "tfds"))
    env = subprocess_env()
    env["PYTHONPATH"] = f"{project}:{env['PYTHONPATH']}"
    groups: dict[str, list[Command]] = {}
    for command in guide_commands(markdown):
        if command.exempt is None:
            groups.setdefault(workdir_of(command), []).append(command)

    def run_group(commands):
        return [(c.text, subprocess.run(rewrite(c, tmp, data_dir), cwd=project, env=env,
                                        capture_output=True, text=True, timeout=900))
                for c in commands]

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = [r for group in pool.map(run_group, groups.values()) for r in group]
    return dict(results)


def runnable() -> list[Command]:
    return [c for c in guide_commands(GUIDE.read_text()) if c.exempt is None]


def test_every_guide_command_is_run_or_exempt_with_a_reason():
    commands = guide_commands(GUIDE.read_text())
    assert len(commands) >= 15
    for command in commands:
        assert command.exempt or command.text.startswith(RUN), (
            f"{command.text!r}: add a way to run it in tests/docs/test_guide_commands.py or a NOT_RUN reason")
    models = {m for c in runnable() for m in re.findall(r"models/configs/(\w+)\.py", c.text)}
    assert {"digits", "mnist", "cifar10", "lm", "gan"} <= models


def test_guide_files_define_the_trainer_its_command_trains():
    files = guide_files(GUIDE.read_text())
    assert set(files) == {"my_project/trainer.py", "my_project/config.py"}
    assert "my_project.trainer:SpiralTrainer" in files["my_project/config.py"]


@pytest.mark.timeout(1800)  # the first one waits for every command (two at a time)
@pytest.mark.parametrize("command", runnable(), ids=lambda c: c.text[10:70])
def test_guide_command_runs_on_cpu(guide_runs, command):
    proc = guide_runs[command.text]
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command.text}\n{output[-4000:]}"
    for text in command.expect:
        assert text in output, f"{command.text}: expected {text!r} in\n{output[-4000:]}"
