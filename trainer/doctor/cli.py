"""The performance doctor: why is this run as fast as it is, in one command.

    python -m trainer.doctor --config=models/configs/digits.py [--steps 100] [--json] \
        [--memory_budget_mb 4096] [--sections=baseline,input,compute] [--time_budget_s 60] \
        [--config.train.global_batch_size=256 ...]

This module is the command line, free of TensorFlow: flags, ``--sections`` and the
config are checked first (:mod:`trainer.cli`; a mistake is one message, exit 2 for a
usage error, 1 for a config error; a ``gs://`` data_dir that cannot be listed, one
line within ``TRAINER_BUCKET_CHECK_S``), then the measurements run
(:mod:`trainer.doctor.measure`, which describes each section) within ``--time_budget_s``
(:mod:`trainer.doctor.phases`), each phase saying on stderr when it starts and ends.
Output: a table, or with ``--json`` one JSON object.

The measurements (:mod:`trainer.doctor.measure`) are loaded only through
:func:`load_measure`, the deferred import of this command
(``tests/test_architecture.py`` accepts ``importlib.import_module`` of a project module
only in the documented entry points).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from types import ModuleType

from absl import app, flags, logging
from ml_collections import config_flags

from trainer import cli, errors
from trainer import config as config_lib
from trainer.doctor.phases import DEFAULT_BUDGET_S
from trainer.doctor.report import SECTIONS, format_table
from trainer.runtime import fast_exit, signals

PROGRAM = "python -m trainer.doctor"
OWN_FLAGS = ("config", "steps", "json", "memory_budget_mb", "max_batch_doublings",
             "top_layers", "sections", "time_budget_s", "traceback")


def load_measure() -> ModuleType:
    """The measurements (:mod:`trainer.doctor.measure`, TensorFlow), imported here only."""
    return importlib.import_module("trainer.doctor.measure")


def check_sections(sections: list[str]) -> list[str]:
    """Returns ``sections`` or raises a UsageError naming the unknown ones."""
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        raise errors.UsageError(
            f"--sections={','.join(sections)}: unknown section(s) {', '.join(unknown) or '(none given)'}; "
            f"choose a comma-separated list from {', '.join(SECTIONS)}.")
    return sections


def main(argv: list[str]) -> int:
    """Checks, then measures and prints the report; returns the exit status."""
    values = flags.FLAGS
    if len(argv) > 1:
        raise errors.UsageError(f"unexpected arguments: {' '.join(argv[1:])}; flags take the "
                                f"form --name=value ({PROGRAM} --help lists them).")
    sections = check_sections(list(values.sections))
    config = cli.loaded_config(values["config"], sys.argv, OWN_FLAGS, PROGRAM)
    config_lib.validate(config)
    cli.check_trainer_path(config.trainer)
    cli.check_data_dir(config)  # a gs:// data_dir: one line within a bound, not minutes of retries
    logging.set_verbosity(logging.WARNING)
    overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
    report = load_measure().diagnose(
        config, steps=values.steps, sections=sections,
        memory_budget_mb=values.memory_budget_mb,
        max_batch_doublings=values.max_batch_doublings, top_layers=values.top_layers,
        config_path=config_flags.get_config_filename(values["config"]), overrides=overrides,
        time_budget_s=values.time_budget_s,
        say=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(report) if values.json else format_table(report), flush=True)
    return 0


def run() -> None:
    """Console-script entry point (``tf-trainer-doctor``). SIGTERM/SIGINT end it at once
    with 128 + the signal, in every phase (:mod:`trainer.runtime.signals`)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    signals.install()
    config_flags.DEFINE_config_file("config", None, cli.config_help(), lock_config=True)
    flags.DEFINE_integer("steps", 100, "Timed steps per measurement.")
    flags.DEFINE_bool("json", False, "Print one JSON object instead of the table.")
    flags.DEFINE_float("memory_budget_mb", 0, "CPU batch search: peak RSS bound (0: half the RAM).")
    flags.DEFINE_integer("max_batch_doublings", 3, "Batch search: doublings of the global batch.")
    flags.DEFINE_integer("top_layers", 8, "Layers listed in the per-layer table.")
    flags.DEFINE_list("sections", list(SECTIONS), f"Which measurements: {', '.join(SECTIONS)}.")
    flags.DEFINE_float("time_budget_s", DEFAULT_BUDGET_S,
                       "Seconds the diagnosis may take: baseline, input and compute always "
                       "run, the other sections only while the budget lasts.", lower_bound=0)
    flags.DEFINE_bool("traceback", False, "Also print the Python traceback of a user error "
                                          "(or set TF_TRAINER_TRACEBACK=1).")
    flags.mark_flag_as_required("config")
    app.run(fast_exit.then_exit(lambda argv: errors.call(main, argv)),
            flags_parser=lambda argv: cli.parse_flags(argv, OWN_FLAGS, PROGRAM))


if __name__ == "__main__":
    run()
