"""Reading the trainer flags a launcher passes through, the way the trainer reads them.

The trainer parses its command line with absl, where a flag given twice takes its LAST
value (``--workdir=/a --workdir=/b`` runs in ``/b``); a launcher that looks at a flag
it forwards (the workdir it reports, a flag it sets itself) must read the same value.
The paths it forwards are resolved where the launcher runs (:func:`with_absolute_paths`).
"""

from __future__ import annotations

from typing import Sequence

from tf_cluster.storage_schemes import absolute


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


#: The trainer flags that name a local path; a launcher resolves them where it runs
#: (a Slurm job's tasks, another host's launcher and a notebook's cwd may differ).
PATH_FLAGS = ("--workdir", "--config.data.data_dir")


def with_absolute_paths(flags: Sequence[str]) -> list[str]:
    """``flags`` with the value of each of :data:`PATH_FLAGS` made absolute against this
    process's working directory (``--name=V`` and ``--name V`` alike; URLs unchanged)."""
    out = list(flags)
    for i, flag in enumerate(out):
        for name in PATH_FLAGS:
            if flag.startswith(name + "="):
                out[i] = f"{name}={absolute(flag.split('=', 1)[1])}"
            elif flag == name and i + 1 < len(out) and not out[i + 1].startswith("--"):
                out[i + 1] = absolute(out[i + 1])
    return out
