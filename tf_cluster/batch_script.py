"""Bash shared by the sbatch scripts that ``launch.slurm`` and ``trainer.sweep.slurm`` emit.

Both run their work in the background and wait for it, so that bash runs the script's
signal trap (the warning signal before the time limit) while it waits: bash runs traps
only between foreground commands, and a trap interrupts ``wait``.
"""

from __future__ import annotations


def warning_trap(message: str, action: str) -> str:
    """Bash that traps the warning signal (USR1) once: it logs ``message`` (the script's
    ``log`` function) and runs ``action`` (lines of bash) the first time, and sets
    ``interrupted=1`` every time (for :func:`wait_for_child`)."""
    return f"""warned=0
interrupted=0
on_warning() {{
  interrupted=1
  [ "$warned" = 1 ] && return
  warned=1
  log "{message}"
  {action}
}}
trap on_warning USR1"""


def wait_for_child(pid_var: str) -> str:
    """Bash that waits for the background process whose pid is in ``$pid_var`` and sets
    ``status`` to its exit status, waiting again when a trap interrupted ``wait`` (the
    trap sets ``interrupted=1``)."""
    return f"""last=
while :; do
  interrupted=0
  wait "${pid_var}"; code=$?
  if [ "$code" = 127 ] && [ -n "$last" ]; then status=$last; break; fi  # already reaped
  if [ "$interrupted" = 0 ]; then status=$code; break; fi
  last=$code  # the trap interrupted wait; the process may still run
done"""
