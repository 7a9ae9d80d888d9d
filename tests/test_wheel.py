"""The built wheel holds every package and module of the source tree, and each imports
from it (not from this checkout): a folder without ``__init__.py`` would drop out of a
``packages = find:`` wheel silently, and only an editable install would hide it.

The wheel is installed with ``pip install --no-deps --target`` and imported by a Python
started without ``site`` (``-S``): the editable install's ``.pth`` is not read, while the
dependencies (TensorFlow, Keras, orbax, ...) come from this environment's site-packages.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.support.helpers import REPO

PACKAGES = ("trainer", "launch", "models", "tf_cluster")


def source_modules() -> set[str]:
    """Every module of the packages in this checkout, as a path inside the wheel."""
    return {str(p.relative_to(REPO)) for package in PACKAGES for p in (REPO / package).rglob("*.py")
            if "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (a build/ folder left in the checkout
    would hand the build stale copies of moved or removed modules)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("setup.py", "setup.cfg", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in PACKAGES:
        shutil.copytree(REPO / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                            *isolation, "--wheel-dir", str(out), str(source)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = out.glob("tf_trainer-*.whl")
    return path


def test_the_wheel_holds_every_module_of_the_source_tree(wheel):
    with zipfile.ZipFile(wheel) as archive:
        held = {name for name in archive.namelist() if name.endswith(".py")}
    missing = sorted(source_modules() - held)
    assert not missing, f"the wheel lacks {missing[:10]} (a folder without __init__.py?)"


def test_every_package_imports_from_the_installed_wheel(wheel, tmp_path):
    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
                                "--target", str(target), str(wheel)],
                               capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    packages = sorted({str(Path(m).parent).replace("/", ".") for m in source_modules()})
    code = (
        "import importlib, sys\n"
        f"sys.path[:0] = [{str(target)!r}, {sysconfig.get_paths()['purelib']!r}, "
        f"{sysconfig.get_paths()['platlib']!r}]\n"
        f"for name in {packages!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({str(target)!r}), (name, module.__file__)\n"
        "from trainer import Trainer, Callback, optimizers, precision\n"
        "import trainer.data, trainer.main, trainer.manual, trainer.checkpoint.show\n"
        "print(len(sys.modules) > 0, trainer.data.distribute.__module__)\n")
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "trainer.data.pipeline"]
