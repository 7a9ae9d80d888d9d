"""``python -m trainer.checkpoint.show --workdir=DIR``: a workdir's checkpoints and their state.

Prints one line per step directory of ``DIR/checkpoints`` and ``DIR/checkpoints_best``,
newest first: the step, its state (``complete``, ``incomplete`` or ``corrupt``, see
:mod:`trainer.checkpoint.inventory`), the directory and what was found (checksums
match, no checksums, the file that does not match...), then the step a resume would
restore. Reads only; exit status 0, or 1 (one ``Workdir error`` line) when ``DIR`` is
not a directory. Checking reads every file of every checkpoint (in a bucket: each step
downloaded in parallel, then checked); a wait past 5 s is said every 10 s, with what the
bucket answered while its client retries.
"""

from __future__ import annotations

import argparse
import sys

from trainer import errors
from trainer.checkpoint import inventory
from trainer.runtime import gcs
from trainer.runtime.waiting import said_while_waiting
from tf_cluster.storage_schemes import absolute, is_bucket


def table(entries: list[inventory.Entry]) -> list[str]:
    """The printed lines of ``entries`` (a header first)."""
    rows = [("step", "state", "path", "detail")]
    rows += [(str(e.step), e.state, e.path, e.detail) for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return [" ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + " " + r[3] for r in rows]


def show(workdir: str) -> int:
    """Prints ``workdir``'s checkpoints (see the module docstring); returns 0."""
    import tensorflow as tf

    if not is_bucket(workdir) and not tf.io.gfile.isdir(workdir):
        raise errors.WorkdirError(f"--workdir={workdir} is not a directory; name the "
                                  f"--workdir of a run.")
    with said_while_waiting(f"the checkpoints of {workdir} to be listed and read",
                            why=gcs.retry_reason):
        entries = inventory.survey(absolute(workdir))
    for line in table(entries):
        print(line)
    good = next((e for e in entries if e.state == inventory.COMPLETE), None)
    print(f"resume: step {good.step} ({good.path})" if good else
          f"resume: none ({'no checkpoint' if not entries else 'no complete checkpoint'} "
          f"in {workdir}: a run starts from scratch)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.checkpoint.show",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="the run's --workdir")
    args = parser.parse_args(argv)
    return int(errors.call(show, args.workdir))


if __name__ == "__main__":
    sys.exit(main())
