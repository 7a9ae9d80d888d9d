"""trainer/checkpoint's docstring is a map a newcomer can follow: every module of the
package is on it, and each of its three call paths (a periodic save, the stop's save, a
restore) names every module of the package that path's code runs, as a traced run on
a local workdir shows (:mod:`tests.support.call_walk`). The gs:// side of each path
(``storage.bucket_steps``, ``storage.bucket``) is named there too and run by the tests in
tests/cluster/ (tests/README.md says which)."""

from __future__ import annotations

import re

import pytest

import trainer
from tests.support import toy
from tests.support.call_walk import module_walk
from tests.support.helpers import REPO
from trainer.checkpoint import resume
from trainer.checkpoint.service import Checkpointer
from trainer.checkpoint.stop_save import StopSave
from trainer.errors import Preempted

PACKAGE = "trainer.checkpoint"
PATHS = {"periodic": "Periodic save.", "stop": "Stop's save.", "restore": "Restore."}


def docstring() -> str:
    import trainer.checkpoint as package

    return package.__doc__


def named(text: str) -> set[str]:
    """The ``dotted`` names in ``text`` (a method's name kept apart: ``storage.steps.readable``
    names ``storage.steps`` too)."""
    names = set()
    for name in re.findall(r"``([a-z_][a-z_.]*)``", text):
        parts = name.split(".")
        names |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return names


def paragraph(start: str) -> str:
    text = docstring()
    begin = text.index(start)
    end = text.find("\n\n", begin)
    return text[begin:end if end >= 0 else None]


def modules_of_the_package() -> set[str]:
    root = REPO / "trainer" / "checkpoint"
    modules = {".".join(p.relative_to(root).with_suffix("").parts) for p in root.rglob("*.py")
               if "__pycache__" not in p.parts}
    return {m.removesuffix(".__init__") for m in modules if m != "__init__"}


def test_every_module_of_the_package_is_on_its_map():
    missing = sorted(modules_of_the_package() - named(docstring()))
    assert not missing, f"trainer/checkpoint/__init__.py's map does not name {missing}"


@pytest.fixture(scope="module")
def walks(tmp_path_factory) -> dict[str, list[str]]:
    """The modules each path's code runs on a local workdir: a periodic save (the
    checkpoint service at a save step), the stop's save after a preemption, and a
    restore in a new Trainer."""
    work = tmp_path_factory.mktemp("map")
    config = toy.toy_config(**{"train.steps": 4, "checkpoint.every_steps": 2,
                               "train.steps_per_loop": 1})
    saving = toy.ToyTrainer(config, str(work / "periodic"))
    periodic = module_walk(saving.fit, Checkpointer.on_loop_end)

    class Preempt(trainer.Callback):
        def on_loop_end(self, t):
            if t.step == 1:
                t.context.request_preemption()

    stopped = toy.ToyTrainer(config, str(work / "stop"), callbacks=[Preempt()])

    def fit_until_preempted():
        with pytest.raises(Preempted):
            stopped.fit()

    stop = module_walk(fit_until_preempted, StopSave.on_train_end)
    restoring = toy.ToyTrainer(config, str(work / "stop"))
    restore = module_walk(restoring.restore, resume.restore)
    return {"periodic": max(periodic, key=len), "stop": stop[0], "restore": restore[0]}


@pytest.mark.parametrize("path", list(PATHS))
def test_each_call_path_names_every_module_its_code_runs(walks, path):
    ran = {m[len(PACKAGE) + 1:] for m in walks[path] if m.startswith(PACKAGE + ".")}
    assert ran, f"the {path} path ran no module of {PACKAGE}"
    missing = sorted(ran - named(paragraph(PATHS[path])))
    assert not missing, (f"the paragraph '{PATHS[path]}' of trainer/checkpoint's map does "
                         f"not name {missing}, which that path ran")


def test_the_stops_save_starts_in_its_module_and_reports_its_outcome_as_an_event(walks):
    assert walks["stop"][0] == f"{PACKAGE}.stop_save"
    assert f"{PACKAGE}.service" in walks["stop"]
