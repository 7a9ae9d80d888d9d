"""The one-node local Slurm the real-Slurm tests submit to (``tests/slurm/start_local_slurm.sh``).

:func:`require_slurm` skips a test with the reason when this machine has no usable
Slurm, except under ``CI=true``, where it fails: CI must run the real-Slurm tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

START_SCRIPT = "tests/slurm/start_local_slurm.sh"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def slurm_problem() -> str | None:
    """Why this machine has no usable Slurm, or None when sinfo shows a ready node."""
    missing = [tool for tool in ("sbatch", "sinfo", "scontrol", "scancel") if not shutil.which(tool)]
    if missing:
        return f"{', '.join(missing)} not on PATH"
    try:
        result = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                                timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s"
    if result.returncode != 0:
        return f"sinfo failed: {result.stderr.strip() or result.stdout.strip()}"
    states = result.stdout.split()
    if not any(s.rstrip("*~#").split("+")[0] in ("idle", "mixed", "allocated", "completing")
               for s in states):
        return f"no node is up (sinfo node states: {states or 'none'})"
    return None


def require_slurm() -> None:
    """Skips the calling test (fails it under ``CI=true``) without a usable local Slurm."""
    problem = slurm_problem()
    if problem:
        message = (f"no local Slurm cluster: {problem}. Start one with `sudo {START_SCRIPT}` "
                   f"(installs slurm-wlm and munge with apt-get if needed).")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message} CI=true: the real-Slurm tests must run, not skip.")
        pytest.skip(message)
