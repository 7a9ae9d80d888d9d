"""The benchmarks as one suite.

    python -m benchmarks [--list]                  every benchmark by group (the question
                                                   it answers): its short name, summary,
                                                   "root" if it needs it
    python -m benchmarks NAME [NAME ...] [-- ARGS] run those, one after another, each as
                                                   python -m benchmarks.GROUP.NAME ARGS
    python -m benchmarks --all [-- ARGS]           run every benchmark (those needing root
                                                   only as root)

ARGS go to every benchmark named (``-- --help`` shows one's flags). Exits 1 when one
failed or was skipped. benchmarks/README.md has each one's current table.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import suite


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run")
    parser.add_argument("--list", action="store_true", help="list the benchmarks (default)")
    parser.add_argument("--all", action="store_true", help="run every benchmark")
    args = parser.parse_args(own)
    groups = suite.discover()
    if args.list or not (args.names or args.all):
        print(suite.format_list(groups))
        return 0
    benchmarks = suite.every_benchmark(groups)
    chosen = benchmarks if args.all else suite.select(args.names, benchmarks)
    return 1 if suite.run(chosen, extra, is_root=suite.running_as_root()) else 0


if __name__ == "__main__":
    sys.exit(main())
