"""The walk of a call: which of the project's modules it passes through, in order.

:func:`module_walk` runs an action under :func:`sys.setprofile` and records, for every
call of an entry function made inside it (on the calling thread), the sequence of
modules whose Python functions run, consecutive calls within one module counted as one
stay (the run context's getters, :data:`RUN_CONTEXT`, are not counted). :func:`returns` counts how often a walk comes back to a module it had left: a
call path that reads top-down has none, or few.
"""

from __future__ import annotations

import sys
from typing import Any, Callable


#: The run context: what a service reads of the run (``run.step``, ``run.workdir``) is
#: a property of these modules, not a room a reader walks into.
RUN_CONTEXT = ("trainer.loop.context", "trainer.run_context")


def module_walk(action: Callable[[], Any], entry: Callable, prefix: str = "trainer.",
                skip: tuple[str, ...] = RUN_CONTEXT) -> list[list[str]]:
    """Runs ``action()``; returns one walk per outermost call of ``entry`` (a function
    or method) made during it: the modules named ``prefix...`` (but ``skip``) whose
    functions ran inside that call, in order, a module repeated only after another ran
    between."""
    code = getattr(entry, "__func__", entry).__code__
    walks: list[list[str]] = []
    depth = 0

    def profile(frame, event, arg) -> None:
        nonlocal depth
        if event == "call":
            if frame.f_code is code:
                if depth == 0:
                    walks.append([])
                depth += 1
            if depth:
                name = frame.f_globals.get("__name__", "")
                if (name.startswith(prefix) and name not in skip
                        and (not walks[-1] or walks[-1][-1] != name)):
                    walks[-1].append(name)
        elif event == "return" and frame.f_code is code:
            depth -= 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(previous)
    return walks


def returns(walk: list[str]) -> int:
    """How many stays of ``walk`` are in a module the walk had already left."""
    seen: set[str] = set()
    count = 0
    for module in walk:
        count += module in seen
        seen.add(module)
    return count
