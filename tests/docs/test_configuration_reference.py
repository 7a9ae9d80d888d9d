"""docs/configuration.md documents the schema exactly: every field of
``trainer.config.get_config()`` has a row with its default, and every row is a field.

A row is a markdown table line whose first cell is a backticked dotted field name and
whose second cell is the default as ``repr`` writes it, in backticks.
"""

from __future__ import annotations

import re

import ml_collections

from tests.support.helpers import REPO
from trainer import config as config_lib

REFERENCE = REPO / "docs" / "configuration.md"
ROW = re.compile(r"^\| `([\w.]+)` \| `(.*?)` \|", flags=re.M)


def schema_fields(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, str]:
    """``{dotted field: repr(default)}`` of every leaf of ``config``."""
    fields = {}
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            fields.update(schema_fields(value, f"{prefix}{key}."))
        else:
            fields[f"{prefix}{key}"] = repr(value)
    return fields


def documented_fields() -> dict[str, str]:
    rows = ROW.findall(REFERENCE.read_text())
    names = [name for name, _ in rows]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f"docs/configuration.md documents {duplicates} twice"
    return dict(rows)


def test_every_schema_field_is_documented_with_its_default():
    documented = documented_fields()
    missing = sorted(set(schema_fields(config_lib.get_config())) - set(documented))
    assert not missing, (f"docs/configuration.md lacks a row for {missing}: add "
                         f"'| `FIELD` | `DEFAULT` | meaning |' to its section")
    wrong = {name: (documented[name], default)
             for name, default in schema_fields(config_lib.get_config()).items()
             if documented[name] != default}
    assert not wrong, f"documented vs actual defaults differ: {wrong}"


def test_every_documented_field_exists_in_the_schema():
    extra = sorted(set(documented_fields()) - set(schema_fields(config_lib.get_config())))
    assert not extra, f"docs/configuration.md documents fields get_config() lacks: {extra}"

