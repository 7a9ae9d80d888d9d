"""Every error docs/errors.md and docs/numerics.md name ends a command as its one line.

The documented names are read from the pages (the ``Xxx error`` prefixes of the exit
code table of errors.md, the ``XxxError`` classes both pages name), each is matched to
its :class:`trainer.errors.UserError` subclass, raised through :func:`errors.call` (what
``trainer.main`` and ``trainer.doctor`` run) and its output checked: one line, its
prefix, no traceback, the documented exit status. Then the non-finite stop end to end:
its line names the step and the last good checkpoint on disk, written by an earlier
run, skipping a newer one that does not verify.
"""

from __future__ import annotations

import glob
import os
import re

import pytest

from tests.support import toy
from tests.support.helpers import REPO
from tests.properties.scenario import PoisonableTrainer
from trainer import errors

ERRORS_MD = (REPO / "docs" / "errors.md").read_text()
NUMERICS_MD = (REPO / "docs" / "numerics.md").read_text()
STATUS = {"Usage error": errors.EXIT_USAGE, "Lost peer": errors.EXIT_PEER_LOST}


def user_error_classes() -> dict[str, type]:
    """Every UserError subclass of the packages, by prefix and by class name."""
    import models.tfds_data  # noqa: F401 - defines the "Data error" classes
    import trainer.checkpoint.state  # noqa: F401
    import trainer.cli  # noqa: F401
    import trainer.precision  # noqa: F401

    found, todo = {}, [errors.UserError]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        found.setdefault(cls.prefix, cls)
        found[cls.__name__] = cls
    return found


def documented_names() -> list[str]:
    table = next(line for line in ERRORS_MD.splitlines()
                 if line.startswith("| 1 | any error but a usage error"))
    prefixes = re.findall(r"`([A-Z][A-Za-z-]+(?: file)? error)`", table)
    classes = re.findall(r"`(\w+Error)`", ERRORS_MD + NUMERICS_MD)
    return sorted({*prefixes, "Usage error", "Lost peer", *classes})


def test_the_pages_name_the_errors_this_test_walks():
    names = documented_names()
    assert {"Storage error", "Non-finite error", "Checkpoint error", "Workdir error",
            "TensorFlow error", "NonFiniteError"} <= set(names), names


@pytest.mark.parametrize("name", documented_names())
def test_a_documented_error_is_one_line_without_traceback(name, capsys, monkeypatch):
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
    cls = user_error_classes().get(name)
    assert cls is not None, f"{name} is documented but no UserError subclass has it"

    def fail() -> None:
        raise cls("something is wrong at step 7; do this to fix it.")

    status = errors.call(fail)
    err = capsys.readouterr().err
    assert err.splitlines() == [f"{cls.prefix}: something is wrong at step 7; do this to "
                                f"fix it."], err
    assert status == cls.exit_code == STATUS.get(cls.prefix, errors.EXIT_ERROR)


def test_a_non_finite_stop_names_the_step_and_the_last_good_checkpoint_of_any_run(
        tmp_path, capsys, monkeypatch):
    """A first run saves steps 5 and 10; the file of step 10 is then damaged; a second
    run resumes from 5 and meets NaN gradients at step 8 under on_nonfinite='stop'
    (before step 10, whose save would replace the damaged copy)."""
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
    workdir = str(tmp_path)
    common = {"train.steps_per_loop": 1, "checkpoint.every_steps": 5,
              "train.on_nonfinite": "stop", "checkpoint.fast_io": True}
    toy.ToyTrainer(toy.toy_config(**common, **{"train.steps": 10}), workdir).fit()
    with open(sorted(glob.glob(os.path.join(workdir, "checkpoints", "10", "state",
                                            "*.npy")))[0], "r+b") as f:
        f.seek(5000)
        f.write(b"\xff")
    config = toy.toy_config(**common, **{"train.steps": 20})
    config.data.poison_step = 7
    status = errors.call(lambda: PoisonableTrainer(config, workdir).fit())
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and not any("Traceback" in line for line in err), err
    assert err[-1].startswith("Non-finite error: Non-finite gradients (NaN/inf) at step 8")
    assert f"the last good checkpoint is step 5 ({workdir}/checkpoints/5)" in err[-1]
