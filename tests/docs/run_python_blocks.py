"""Runs the python code blocks of one page in this process, in order.

``python -m tests.docs.run_python_blocks SPEC.json``: SPEC is a list of
``{"id", "module", "source"}``; a block with a ``module`` (a ``# FILE:`` block, already
written) is imported, any other is executed as a script in a fresh namespace. One line
``BLOCK-RESULT {"id": ..., "error": traceback or null}`` per block on stdout.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    for block in spec:
        try:
            if block["module"]:
                importlib.import_module(block["module"])
            else:
                exec(compile(block["source"], block["id"], "exec"), {"__name__": "__main__"})
            error = None
        except BaseException:  # noqa: BLE001 - reported per block, SystemExit included
            error = traceback.format_exc()
        print("BLOCK-RESULT " + json.dumps({"id": block["id"], "error": error}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
