"""The fenced code blocks of README.md and docs/*.md, and how each is run.

Languages:

* ``python``: executed. A block whose first line is ``# FILE: path`` is a file the
  page asks you to write: it is written to ``path`` in the project directory (a copy of
  the repository root) and imported as a module; any other block is executed as a
  script, with the project directory on ``PYTHONPATH``.
* ``bash``: every command runs (``python -m MODULE ...``; ``export NAME=VALUE`` sets the
  environment of the block's later commands). A ``# -> text`` comment after a command
  is output it must print; it must exit 0.
* ``console``: a transcript. ``$ python -m ...`` lines run; the lines after one are
  output it must print, in order, where ``...`` stands for anything; ``$ echo $?``
  followed by a number is the exit status of the command before.
* ``text``: output or a synopsis, not run; a command line in it must hold a
  placeholder (``...``, ``[``, or an ALL-CAPS word).

A block that needs what a test machine has not (the network, a GPU, a TPU, a cluster)
is marked by an HTML comment on the line right before its fence,
``<!-- not-run: the reason -->``, and skipped with that reason.

Rewrites before running: ``/tmp/`` paths go to a temporary directory,
``--config.data.data_dir=`` points at a prepared data directory of random images
(nothing is downloaded), and training commands get :data:`TINY` settings (a few steps,
a small batch, a smaller network) for every field they do not set themselves; a
command that sets ``train.steps`` itself keeps its config's loop and logging sizes.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LANGUAGES = ("python", "bash", "console", "text")
BLOCK = re.compile(r"^(?:<!-- not-run: (?P<why>[^\n]*?) -->\n)?```(?P<language>[^\n]*)\n"
                   r"(?P<body>.*?)^```[ \t]*$", flags=re.M | re.S)
PLACEHOLDER = re.compile(r"\.\.\.|\[|\b[A-Z][A-Z_]+\b")
TINY = {"train.steps": 4, "train.steps_per_loop": 2, "train.log_every_steps": 2,
        "eval.steps": 2, "train.global_batch_size": 16}
TINY_MODEL = {  # config file -> smaller network settings
    "cifar10": {"model.blocks_per_stage": 1, "model.widths": "(8, 16)"},
    "lm": {"model.d_model": 32, "model.mlp_dim": 64, "model.layers": 1, "data.seq_len": 32},
}
LOOP_SIZES = ("train.steps_per_loop", "train.log_every_steps")
DOCTOR_TINY = ["--steps=5", "--max_batch_doublings=1"]


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence
    language: str
    body: str
    not_run: str | None  # the reason, when marked

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def file(self) -> str | None:
        """The path of a ``# FILE: path`` python block, else None."""
        first = self.body.partition("\n")[0]
        if self.language == "python" and first.startswith("# FILE: "):
            return first[len("# FILE: "):].strip()
        return None

    @property
    def runs(self) -> bool:
        return self.language in ("python", "bash", "console") and self.not_run is None


@dataclass
class Command:
    block: Block
    text: str  # as written (continuations joined), without the "# ->" comment
    env: dict[str, str] = field(default_factory=dict)  # exports before it in its block
    expect: list[str] = field(default_factory=list)  # output lines; "..." = anything
    status: int | None = None  # the exit status it must end with (None: 0 for bash)


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start("language")) + 1
        found.append(Block(page, line, match["language"].strip(), match["body"],
                           match["why"]))
    return found


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks(page)]


def bash_commands(block: Block) -> list[Command]:
    commands, env = [], {}
    for line in block.body.replace("\\\n", " ").splitlines():
        text, _, expect = line.partition("# -> ")
        text = text.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("export "):
            name, _, value = text[len("export "):].partition("=")
            env[name] = shlex.split(value, comments=True)[0] if value else ""
            continue
        commands.append(Command(block, text, dict(env), [expect.strip()] if expect else []))
    return commands


def console_commands(block: Block) -> list[Command]:
    commands: list[Command] = []
    lines = block.body.splitlines()
    for i, line in enumerate(lines):
        if line == "$ echo $?":
            commands[-1].status = int(lines[i + 1])
        elif line.startswith("$ "):
            output = []
            for later in lines[i + 1:]:
                if later.startswith("$ "):
                    break
                output.append(later)
            commands.append(Command(block, line[2:].strip(), expect=output))
    return commands


def commands(block: Block) -> list[Command]:
    return bash_commands(block) if block.language == "bash" else console_commands(block)


def problems(block: Block) -> list[str]:
    """What makes the block unfit for this test (empty: fine)."""
    if block.language not in LANGUAGES:
        return [f"{block.id}: give the block one of the languages {LANGUAGES} "
                f"(got {block.language!r})"]
    if block.not_run is not None and (block.language == "text" or not block.not_run.strip()):
        return [f"{block.id}: a not-run mark needs a reason and a python/bash/console block"]
    if block.language == "text":
        return [f"{block.id}: {line!r} is a command: make the block bash or console, "
                f"or write a placeholder (...)"
                for line in block.body.splitlines()
                if line.startswith(("python -m", "$ ")) and not PLACEHOLDER.search(line)]
    if block.language in ("bash", "console") and block.runs:
        return [f"{block.id}: cannot run {c.text!r} (only 'python -m ...' and 'export'): "
                f"mark the block <!-- not-run: why --> if it needs the network or hardware"
                for c in commands(block) if not c.text.startswith("python -m ")]
    return []


def overridden(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0][len("--config."):] for a in argv if a.startswith("--config.")}


def rewrite(text: str, tmp: Path, data_dir: str) -> list[str]:
    """The argv that runs ``python -m ...`` ``text`` here (see the module docstring)."""
    argv = shlex.split(text.replace("/tmp/", f"{tmp}/"))
    out = [sys.executable, "-m", argv[2]]
    out += [f"--config.data.data_dir={data_dir}" if a.startswith("--config.data.data_dir=")
            else a for a in argv[3:]]
    if argv[2] == "trainer.doctor":
        return out + DOCTOR_TINY
    if "--emit" in argv or argv[2] not in ("trainer.main", "launch.mirrored",
                                           "launch.multiworker"):
        return out
    config = re.search(r"--config=\S*?(\w+)\.py", text)
    tiny = {**TINY, **TINY_MODEL.get(config.group(1) if config else "", {})}
    if "train.steps" in overridden(argv):  # its own length: keep the config's loop sizes
        tiny = {k: v for k, v in tiny.items() if k not in LOOP_SIZES}
    return out + [f"--config.{k}={v}" for k, v in tiny.items() if k not in overridden(argv)]


def matches(expected: list[str], output: str) -> bool:
    """Every expected line appears in ``output``, in order; ``...`` matches anything."""
    pattern = ".*?".join(re.escape(part) for line in expected if line.strip()
                         for part in [line.strip()])
    pattern = pattern.replace(re.escape("..."), ".*?")
    return re.search(pattern, output, flags=re.S) is not None


def workdir_of(command: Command) -> str:
    match = re.search(r"--workdir=(\S+)", command.text)
    return match.group(1) if match else command.text
