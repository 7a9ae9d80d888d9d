"""Reading the trainer flags a launcher passes through, the way the trainer reads them.

The trainer parses its command line with absl, where a flag given twice takes its LAST
value (``--workdir=/a --workdir=/b`` runs in ``/b``); a launcher that looks at a flag
it forwards (the workdir it reports, a flag it sets itself) must read the same value.
"""

from __future__ import annotations

from typing import Sequence


def flag_value(flags: Sequence[str], name: str) -> str | None:
    """The value of ``--name=V`` or ``--name V`` in ``flags``, the last one winning as in
    absl; None when the flag is absent (or ``--name`` ends the list without a value)."""
    value = None
    for i, flag in enumerate(flags):
        if flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
        elif flag == name and i + 1 < len(flags):
            value = flags[i + 1]
    return value


def sets_flag(flags: Sequence[str], name: str) -> bool:
    """True when ``flags`` give ``name`` at all (``--name``, ``--name=V`` or ``--name V``)."""
    return any(flag == name or flag.startswith(name + "=") for flag in flags)
