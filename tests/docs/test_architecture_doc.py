"""docs/architecture.md follows ``.importlinter`` and the source tree, so it cannot go stale.

* Every ``layers`` contract: the section headed ``### `CONTAINER` `` holds a table whose
  rows, top to bottom, name (in backticks, second column) exactly the modules of the
  contract's layers, in the contract's order.
* Every module of ``trainer/`` (``trainer/X.py``, ``trainer/P/X.py``, a subpackage
  ``trainer/P/``) is named in its package's section.
* Every contract of ``.importlinter`` is named (its id, in backticks) and every root
  package has a row in the "Top-level packages" table. The page may describe a package
  that ``.importlinter`` does not list yet (one being added in parallel).
"""

from __future__ import annotations

import configparser
import re

import pytest

from tests.support.helpers import REPO

DOC = REPO / "docs" / "architecture.md"
CONTRACT = "importlinter:contract:"


def importlinter() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(REPO / ".importlinter")
    return parser


def lines_of(value: str) -> list[str]:
    return [line.strip() for line in value.strip().splitlines() if line.strip()]


def layers_contracts() -> dict[str, list[set[str]]]:
    """``{container: [set of modules of each layer, top to bottom]}``."""
    parser = importlinter()
    contracts = {}
    for section in parser.sections():
        if section.startswith(CONTRACT) and parser[section]["type"] == "layers":
            layers = [{m.strip() for m in row.split("|")} for row in lines_of(parser[section]["layers"])]
            for container in lines_of(parser[section]["containers"]):
                contracts[container] = layers
    return contracts


def package_section(text: str, package: str) -> str:
    """The text under ``### `package` `` up to the next heading of level <= 3."""
    match = re.search(rf"^### `{re.escape(package)}`\s*$(.*?)(?=^#{{1,3}} |\Z)", text,
                      flags=re.M | re.S)
    assert match, f"docs/architecture.md has no section '### `{package}`'"
    return match.group(1)


def first_table_modules(section: str) -> list[set[str]]:
    """The backticked names of the second column of the section's first table, per row."""
    rows = []
    for line in section.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) > 1 and not set(cells[0]) <= set("-: ") and cells[0] != "layer":
                rows.append(set(re.findall(r"`(\w+)`", cells[1])))
        elif rows:
            break
    return rows


def trainer_modules() -> dict[str, set[str]]:
    """``{package: names of its modules and subpackages}`` under trainer/."""
    packages: dict[str, set[str]] = {}
    root = REPO / "trainer"
    for path in root.rglob("*.py"):
        if path.name.startswith("__"):
            continue
        package = ".".join(("trainer", *path.parent.relative_to(root).parts))
        packages.setdefault(package, set()).add(path.stem)
    for path in root.iterdir():
        if (path / "__init__.py").exists():
            packages.setdefault("trainer", set()).add(path.name)
    return packages


@pytest.mark.parametrize("container", sorted(layers_contracts()))
def test_layer_tables_follow_the_import_contracts(container):
    documented = first_table_modules(package_section(DOC.read_text(), container))
    contract = layers_contracts()[container]
    assert documented == contract, (
        f"docs/architecture.md's table for `{container}` lists the layers\n{documented}\n"
        f"but .importlinter has\n{contract}\n(top to bottom): update the table")


@pytest.mark.parametrize("package", sorted(trainer_modules()))
def test_every_trainer_module_is_named_under_its_package(package):
    section = package_section(DOC.read_text(), package)
    missing = sorted(m for m in trainer_modules()[package] if f"`{m}`" not in section)
    assert not missing, (f"docs/architecture.md's section '### `{package}`' does not name "
                         f"{missing}: say in a few words what each does")


def test_every_contract_and_root_package_is_named():
    parser = importlinter()
    text = DOC.read_text()
    contracts = [s[len(CONTRACT):] for s in parser.sections() if s.startswith(CONTRACT)]
    missing = [c for c in contracts if f"| `{c}` |" not in text]
    assert not missing, f"docs/architecture.md's contract table lacks {missing}"
    packages = lines_of(parser["importlinter"]["root_packages"])
    missing = [p for p in packages if f"| `{p}/` |" not in text]
    assert not missing, f"docs/architecture.md's package table lacks {missing}"
