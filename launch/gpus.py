"""Which GPUs this machine offers a launcher, found without TensorFlow.

A launcher must decide about devices before TensorFlow loads (it sets
``CUDA_VISIBLE_DEVICES`` for the process it starts), so it cannot ask TensorFlow. It
looks, in this order, at:

1. ``CUDA_VISIBLE_DEVICES`` when set: the GPUs this process may use (a scheduler such
   as SLURM sets it to the job's GPUs; ``""`` or ``-1`` means none);
2. the NVIDIA device files ``/dev/nvidiaN``;
3. ``nvidia-smi -L`` when it is on ``PATH`` (e.g. in a container without the files).

:func:`found_gpus` returns the ids and where they were found, for messages such as
"GPUs found: 0, 1 (/dev/nvidia*)".
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from typing import Mapping, Sequence

_SMI_TIMEOUT_S = 10.0
_SMI_LINE = re.compile(r"^GPU (\d+):", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class FoundGpus:
    """``ids``: the GPU ids, as ``CUDA_VISIBLE_DEVICES`` would name them (strings: the
    variable may hold UUIDs); ``source``: where they were found, for messages."""

    ids: tuple[str, ...]
    source: str

    def describe(self) -> str:
        """``"0, 1 (/dev/nvidia*)"``, or ``"none (...)"``."""
        return f"{', '.join(self.ids) if self.ids else 'none'} ({self.source})"


def gpu_device_files(dev: str = "/dev") -> list[str]:
    """The N of every ``/dev/nvidiaN`` device file under ``dev``, in numeric order."""
    try:
        names = os.listdir(dev)
    except OSError:
        return []
    return sorted((n[len("nvidia"):] for n in names if re.fullmatch(r"nvidia\d+", n)), key=int)


def nvidia_smi_gpus(program: str | None = None) -> list[str] | None:
    """The GPU indices ``nvidia-smi -L`` lists, or None when it is missing or fails."""
    program = program or shutil.which("nvidia-smi")
    if program is None:
        return None
    try:
        listing = subprocess.run([program, "-L"], capture_output=True, text=True,
                                 timeout=_SMI_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return _SMI_LINE.findall(listing)


def found_gpus(environ: Mapping[str, str], dev: str = "/dev",
               nvidia_smi: str | None = None) -> FoundGpus:
    """The GPUs a process started with ``environ`` may use (see the module docstring).

    ``dev`` and ``nvidia_smi`` (the program's path) name where to look; by default the
    machine's ``/dev`` and the ``nvidia-smi`` on ``PATH``.
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [part.strip() for part in visible.split(",") if part.strip()]
        # CUDA stops at the first invalid entry; "-1" is the usual way to hide every GPU.
        ids = ids[:next((i for i, g in enumerate(ids) if g.startswith("-")), len(ids))]
        return FoundGpus(tuple(ids), f"CUDA_VISIBLE_DEVICES={visible!r}")
    files = gpu_device_files(dev)
    if files:
        return FoundGpus(tuple(files), f"{dev}/nvidia*")
    listed = nvidia_smi_gpus(nvidia_smi)
    if listed:
        return FoundGpus(tuple(listed), "nvidia-smi -L")
    return FoundGpus((), f"no CUDA_VISIBLE_DEVICES, no {dev}/nvidiaN device, "
                         + ("nvidia-smi lists none" if listed is not None
                            else "no nvidia-smi"))


def missing_gpus(wanted: Sequence[int], found: FoundGpus) -> list[int]:
    """The ids of ``wanted`` that are not among ``found``'s (numeric ids only)."""
    have = {g for g in found.ids}
    return [g for g in wanted if str(g) not in have]
