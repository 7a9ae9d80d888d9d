"""The rules a config field is checked by: each raises one :class:`ConfigError` naming
the field, its value and what it must be (``trainer.config.validate`` applies them)."""

from __future__ import annotations

import difflib
from typing import Any

from trainer.errors import ConfigError


def suggest(name: str, choices) -> str:
    """" Did you mean 'X'?" for the closest of ``choices``, or ""."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


def check_choice(field: str, value: Any, choices) -> None:
    """Raises ``config.FIELD=VALUE is not one of ...`` (with a suggestion) unless in ``choices``."""
    if value not in choices:
        raise ConfigError(
            f"config.{field}={value!r} is not one of {', '.join(map(repr, choices))}."
            f"{suggest(str(value), choices)}"
        )


def check_positive(field: str, value: Any, allow_zero: bool = False) -> None:
    """Raises unless ``value`` is an int > 0 (``>= 0`` with ``allow_zero``)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and (
        value >= 0 if allow_zero else value > 0
    )
    if not ok:
        bound = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"config.{field}={value!r} must be {bound} integer.")


def require(field: str, value: Any, ok: bool, rule: str) -> None:
    """Raises ``config.FIELD=VALUE must be RULE.`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"config.{field}={value!r} must be {rule}.")
