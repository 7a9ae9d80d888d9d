"""The search space: ``config.sweep.space``'s strings, parsed and checked against the config.

Each string is ``"KEY=DIST(ARGS)"``: KEY any field of the config (``optimizer.learning_rate``,
``model.hidden``), DIST one of

* ``float(lo, hi)``: uniform in [lo, hi];
* ``log(lo, hi)``: log-uniform in [lo, hi] (0 < lo);
* ``int(lo, hi)``: an integer in [lo, hi];
* ``choice(a, b, ...)``: one of the values (Python literals; a bare word is a string).

Every mistake is one :class:`trainer.config.ConfigError` naming the string: an unknown
key (with a suggestion), an unknown DIST, an empty range (``lo >= hi``), a range that does
not fit the key (``float`` bounds for an integer field, ``log`` from 0, a choice of a
value the field cannot hold), the same key twice.

A config file may define ``search_space(trial)`` instead (conditional spaces): it calls
``trial.suggest_float / suggest_int / suggest_categorical`` with KEYs as names and returns
``{KEY: value}``; the keys are checked the same way once it returned. No TensorFlow and no
Optuna here: a ``trial`` is anything with Optuna's ``suggest_*`` methods.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from typing import Any, Callable

import ml_collections

from trainer.config import ConfigError
from trainer.errors import suggest

DISTS = ("float", "log", "int", "choice")
_FORM = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*=\s*([A-Za-z_]\w*)\s*\((.*)\)\s*$", re.S)
FORM = "'KEY=DIST(ARGS)', e.g. 'optimizer.learning_rate=log(1e-4, 3e-2)'"


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One swept key: ``dist`` over ``args`` (``(lo, hi)`` or the choices)."""

    key: str
    dist: str
    args: tuple

    def sample(self, trial) -> Any:
        """The value ``trial`` (an Optuna trial) suggests for this key."""
        if self.dist == "choice":
            return trial.suggest_categorical(self.key, list(self.args))
        if self.dist == "int":
            return trial.suggest_int(self.key, *self.args)
        return trial.suggest_float(self.key, *self.args, log=self.dist == "log")


def field_value(config: ml_collections.ConfigDict, key: str, where: str) -> Any:
    """The current value of the dotted ``key`` in ``config``; raises ConfigError naming
    ``where`` (the string or function that names it) when no such field exists."""
    node, walked = config, []
    for part in key.split("."):
        if not isinstance(node, (ml_collections.ConfigDict, dict)) or part not in node:
            known = list(node.keys()) if hasattr(node, "keys") else []
            at = "config" + "".join(f".{p}" for p in walked)
            raise ConfigError(f"{where}: {at} has no field {part!r}, so {key!r} cannot be "
                              f"swept.{suggest(part, known)} A swept key must be a field the "
                              f"config defines.")
        node = node[part]
        walked.append(part)
    if isinstance(node, ml_collections.ConfigDict):
        raise ConfigError(f"{where}: config.{key} is a section; sweep one of its fields.")
    return node


def _literal(text: str) -> Any:
    """A Python literal, or ``text`` itself as a string (``choice(adam, sgd)``)."""
    text = text.strip()
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_range(where: str, dist: str, args: tuple, current: Any) -> tuple:
    """``(lo, hi)`` of a float/log/int DIST, checked; raises ConfigError otherwise."""
    if len(args) != 2 or not all(_number(a) for a in args):
        raise ConfigError(f"{where}: {dist}() takes two numbers, lo and hi, e.g. "
                          f"{dist}(1, 10); got {len(args)} argument(s) {args!r}.")
    lo, hi = args
    if not lo < hi:
        raise ConfigError(f"{where}: the range [{lo}, {hi}] is empty: {dist}(lo, hi) needs "
                          f"lo < hi.")
    if dist == "log" and lo <= 0:
        raise ConfigError(f"{where}: log({lo}, {hi}) needs 0 < lo (a log-uniform range "
                          f"cannot reach 0); use float(lo, hi) for a range from 0.")
    if dist == "int" and not all(isinstance(a, int) for a in args):
        raise ConfigError(f"{where}: int({lo}, {hi}) needs integer bounds.")
    if dist != "int" and isinstance(current, int) and not isinstance(current, bool):
        raise ConfigError(f"{where}: the field is an integer (it is {current!r}) but "
                          f"{dist}() draws fractions; use int(lo, hi) or choice(...).")
    return (lo, hi) if dist == "int" else (float(lo), float(hi))


def check_value(where: str, key: str, value: Any, current: Any) -> None:
    """Raises ConfigError unless ``value`` can be set on a field now holding ``current``."""
    fits = (type(value) is type(current)
            or (isinstance(current, float) and _number(value))
            or (isinstance(current, (tuple, list)) and isinstance(value, (tuple, list))))
    if not fits:
        raise ConfigError(f"{where}: config.{key} is {current!r} ({type(current).__name__}); "
                          f"{value!r} ({type(value).__name__}) cannot be set on it.")


def parse(text: Any, config: ml_collections.ConfigDict) -> Dimension:
    """One ``"KEY=DIST(ARGS)"`` string as a :class:`Dimension`, checked against ``config``."""
    where = f"config.sweep.space: {text!r}"
    match = _FORM.match(text) if isinstance(text, str) else None
    if match is None:
        raise ConfigError(f"{where} is not of the form {FORM}.")
    key, dist, body = match.groups()
    if dist not in DISTS:
        raise ConfigError(f"{where}: unknown distribution {dist!r}; use one of "
                          f"{', '.join(d + '(...)' for d in DISTS)}.{suggest(dist, DISTS)}")
    current = field_value(config, key, where)
    args = _literal(f"({body},)") if body.strip() else ()
    if isinstance(args, str):  # not one literal tuple: split bare words
        args = tuple(_literal(part) for part in body.split(","))
    if dist == "choice":
        if len(args) < 2:
            raise ConfigError(f"{where}: choice() needs at least two values to choose from.")
        for value in args:
            check_value(where, key, value, current)
        return Dimension(key, dist, tuple(args))
    return Dimension(key, dist, _check_range(where, dist, tuple(args), current))


def parse_space(space: Any, config: ml_collections.ConfigDict) -> list[Dimension]:
    """``config.sweep.space`` as dimensions; raises ConfigError on the first bad string."""
    if isinstance(space, str) or not isinstance(space, (list, tuple)):
        raise ConfigError(f"config.sweep.space={space!r} must be a tuple of strings {FORM}.")
    dims = [parse(text, config) for text in space]
    keys = [d.key for d in dims]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ConfigError(f"config.sweep.space names {', '.join(twice)} more than once.")
    return dims


def check_sampled(values: Any, config: ml_collections.ConfigDict, where: str) -> dict:
    """Checks what ``search_space(trial)`` returned: ``{KEY: value}`` over config fields."""
    if not isinstance(values, dict) or not values:
        raise ConfigError(f"{where} must return a non-empty dict {{KEY: value}}, e.g. "
                          f"{{'optimizer.learning_rate': 1e-3}}; it returned {values!r}.")
    for key, value in values.items():
        check_value(where, key, value, field_value(config, str(key), where))
    return values


def sampler(dims: list[Dimension], search_space: Callable | None,
            config: ml_collections.ConfigDict, config_path: str) -> Callable[[Any], dict]:
    """``trial -> {KEY: value}``: the config file's ``search_space`` or the dimensions."""
    if search_space is not None:
        where = f"search_space(trial) of {config_path}"
        return lambda trial: check_sampled(search_space(trial), config, where)
    return lambda trial: {d.key: d.sample(trial) for d in dims}


def override(key: str, value: Any) -> str:
    """The ``--config.KEY=VALUE`` flag that sets ``value`` (as ml_collections parses it)."""
    text = value if isinstance(value, str) else repr(value)
    return f"--config.{key}={text}"
