"""The shape of the code: layers, private names, lazy imports and module size.

The layer order itself is import-linter's contract (``.importlinter``, run here as a
subprocess: CI checks it only through this test); the rules import-linter cannot express are checked on the source with ``ast``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import REPO

PROJECT = ("trainer", "launch", "models", "tf_cluster")
# Optional or heavy third-party modules that may be imported inside a function, to keep
# start-up fast or the dependency optional (orbax/JAX and tfds take a noticeable time to import;
# IPython exists only where a notebook kernel runs; google-cloud-storage, with google.auth,
# google.api_core and requests under it, only with the [gcs] extra: trainer.checks.bucket).
LAZY_ALLOWED = ("orbax", "jax", "pynvml", "tensorflow_datasets", "ml_dtypes", "tensorflow",
                "sklearn", "mlflow", "tensorboard_plugin_profile", "IPython", "google",
                "requests", "optuna")


def sources(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (REPO / package).rglob("*.py"))


def test_import_linter_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.fail("lint-imports is not installed: pip install -e '.[test]'")
    run = subprocess.run([str(lint)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "0 broken" in run.stdout


@pytest.mark.parametrize("path", sources(*PROJECT), ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_uses_another_modules_private_names(path):
    tree = ast.parse(path.read_text())
    project_aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PROJECT:
            for alias in node.names:
                assert not alias.name.startswith("_"), (
                    f"{path.name}:{node.lineno} imports {node.module}.{alias.name}")
                project_aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PROJECT:
                    project_aliases.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                and node.value.id in project_aliases):
            pytest.fail(f"{path.name}:{node.lineno} reads {node.value.id}.{node.attr}")


@pytest.mark.parametrize("path", sources("trainer", "launch", "tf_cluster"),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_function_local_imports_only_for_optional_third_party_modules(path):
    tree = ast.parse(path.read_text())
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] in LAZY_ALLOWED, (
                    f"{path.name}:{node.lineno} imports {name} inside {func.name}()")


@pytest.mark.parametrize("path", sources("trainer"), ids=lambda p: str(p.relative_to(REPO)))
def test_library_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= 400, f"{path.name} has {lines} lines; split it by concern"


@pytest.mark.parametrize("path", sources("launch", "tf_cluster"),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_launcher_functions_stay_short(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            assert lines <= 80, f"{path.name}:{node.lineno} {node.name}() has {lines} lines"


# The documented deferred imports of this package: the TensorFlow-free command lines load
# their TensorFlow side with importlib.import_module("trainer.<module>") in one function
# each (trainer.main.load_fit_command, trainer.doctor.cli.load_measure), after the flags and
# config are checked. trainer/__init__.py loads Trainer/Callback lazily the same way
# (PEP 562 __getattr__). Nowhere else may a module hide a project import this way.
DEFERRED_ENTRY_POINTS = {"trainer/main.py": "load_fit_command", "trainer/doctor/cli.py": "load_measure"}


@pytest.mark.parametrize("path", sources(*PROJECT), ids=lambda p: str(p.relative_to(REPO)))
def test_importlib_loads_project_modules_only_in_the_documented_entry_points(path):
    relative = str(path.relative_to(REPO))
    tree = ast.parse(path.read_text())
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "import_module" and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).split(".")[0] in PROJECT):
                continue
            assert DEFERRED_ENTRY_POINTS.get(relative) == func.name, (
                f"{relative}:{node.lineno} imports {node.args[0].value} with importlib in "
                f"{func.name}(); import it at the top of the module")


def test_the_command_lines_check_flags_without_tensorflow():
    """trainer.main, trainer.doctor and trainer.sweep import nothing that imports TensorFlow."""
    code = ("import sys, trainer.main, trainer.doctor.cli, trainer.cli, trainer.sweep.cli; "
            "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


# The loop driver is the Trainer's (trainer.py builds it, loop/driver.py is it,
# loop/context.py is its face towards the services). The doctor times the driver's
# compiled train loop itself.
DRIVER_MODULE = "trainer.loop.driver"
DRIVER_OWNERS = ("trainer/trainer.py", "trainer/loop/driver.py", "trainer/loop/context.py",
                 "trainer/doctor/measure.py")
SERVICE_PACKAGES = ("trainer/checkpoint", "trainer/telemetry", "trainer/services")


def imports_of(tree: ast.AST) -> set[str]:
    """Every module a source imports, by its full name (``from P import M`` counts as
    ``P.M`` as well as ``P``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_driver_check_names_the_modules_that_exist():
    """A move of the driver (or of its owners) must move this check with it: else it
    would pass for every module."""
    for owner in DRIVER_OWNERS:
        assert (REPO / owner).is_file(), f"DRIVER_OWNERS names {owner}, which does not exist"
    driver = REPO / (DRIVER_MODULE.replace(".", "/") + ".py")
    assert "LoopDriver" in _members_of_module(driver), f"{DRIVER_MODULE} defines no LoopDriver"
    assert DRIVER_MODULE in imports_of(ast.parse((REPO / "trainer/trainer.py").read_text()))


@pytest.mark.parametrize("path", sources("trainer"), ids=lambda p: str(p.relative_to(REPO)))
def test_only_the_trainer_and_the_loop_touch_the_loop_driver(path):
    relative = str(path.relative_to(REPO))
    if relative in DRIVER_OWNERS:
        return
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        assert not (isinstance(node, ast.Attribute) and node.attr == "driver"), (
            f"{relative}:{node.lineno} reads .driver; services see the run context "
            f"(trainer.run_context.RunContext) instead")
    assert DRIVER_MODULE not in imports_of(tree), (
        f"{relative} imports the loop driver's module {DRIVER_MODULE}")


@pytest.mark.parametrize("path", [p for p in sources("trainer")
                                  if str(p.relative_to(REPO)).startswith(SERVICE_PACKAGES)],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_services_get_the_run_context_and_dispatch_no_callbacks(path):
    """A service is a run_context.Service (its hooks get the context, not the Trainer),
    never reads the callback list (it announces; the dispatcher dispatches)."""
    relative = str(path.relative_to(REPO))
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.module != "trainer.callbacks", (
                f"{relative}:{node.lineno} imports trainer.callbacks; a service derives "
                f"from trainer.run_context.Service")
        assert not (isinstance(node, ast.Attribute) and node.attr == "callbacks"), (
            f"{relative}:{node.lineno} reads .callbacks; announce through the run context")


# A config schema literal is long by nature: the one function allowed over the limit.
LONG_FUNCTIONS_ALLOWED = {("trainer/config.py", "get_config")}
MAX_FUNCTION_LINES = 80


@pytest.mark.parametrize("path", sources("trainer", "launch"),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_no_function_is_longer_than_80_lines(path):
    relative = str(path.relative_to(REPO))
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        lines = node.end_lineno - node.lineno + 1
        if (relative, node.name) not in LONG_FUNCTIONS_ALLOWED:
            assert lines <= MAX_FUNCTION_LINES, (
                f"{relative}:{node.lineno} {node.name}() has {lines} lines; split it by job")


def _members_of_module(path: Path) -> set[str]:
    return {node.name for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.ClassDef, ast.FunctionDef))}


def _members(path: Path, cls: str) -> set[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            names = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
            return names
    raise AssertionError(f"no class {cls} in {path}")


def test_the_loop_context_implements_every_member_the_run_context_documents():
    documented = _members(REPO / "trainer" / "run_context.py", "RunContext")
    implemented = _members(REPO / "trainer" / "loop" / "context.py", "LoopContext")
    assert documented - implemented == set()
    # Beyond the protocol only the constructor and the dispatcher's side.
    assert implemented - documented == {"__init__", "take_announcements"}


# The root of trainer/ is the public API and the entries (docs/architecture.md); every
# other module lives in the package of its part.
ROOT_MODULES = {"__init__", "trainer", "callbacks", "config", "config_checkpoint", "errors",
                "run_context", "service_order", "cli", "main", "manual", "precision", "optimizers"}


def test_the_root_of_trainer_holds_only_the_public_api_and_the_entries():
    root = {p.stem for p in (REPO / "trainer").glob("*.py")}
    assert root == ROOT_MODULES, (
        f"trainer/ holds {sorted(root - ROOT_MODULES)} beside the public API: put each "
        f"in the package of its part (docs/architecture.md)")


def packages_of(*roots: str) -> list[Path]:
    return sorted({p.parent for root in roots for p in (REPO / root).rglob("*.py")
                   if "__pycache__" not in p.parts})


@pytest.mark.parametrize("package", packages_of(*PROJECT), ids=lambda p: str(p.relative_to(REPO)))
def test_every_package_has_an_init_so_the_wheel_holds_it(package):
    """``packages = find:`` drops a folder without ``__init__.py`` from the wheel silently."""
    assert (package / "__init__.py").is_file(), f"{package.relative_to(REPO)} has no __init__.py"


@pytest.mark.parametrize("package", packages_of("trainer"), ids=lambda p: str(p.relative_to(REPO)))
def test_every_trainer_package_says_what_it_is_and_lists_its_public_names(package):
    init = package / "__init__.py"
    tree = ast.parse(init.read_text())
    doc = ast.get_docstring(tree)
    assert doc and doc.splitlines()[0].strip(), f"{init.relative_to(REPO)} has no docstring"
    exported = [node for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)]
    assert exported, f"{init.relative_to(REPO)} has no __all__"
    names = ast.literal_eval(exported[0].value)
    defined = {p.stem for p in package.glob("*.py")} | {p.name for p in package.iterdir()
                                                        if (p / "__init__.py").exists()}
    for node in tree.body:
        if isinstance(node, (ast.ImportFrom, ast.Import)):
            defined.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
    if package.name == "trainer":
        defined |= {"Trainer", "Callback"}  # loaded on first use (PEP 562)
    missing = sorted(set(names) - defined)
    assert not missing, f"{init.relative_to(REPO)} lists {missing} in __all__ but has none"



def modules_of_the_tests() -> dict[str, Path]:
    """{dotted name: path} of every test module (``tests/**/test_*.py``)."""
    return {".".join(p.relative_to(REPO).with_suffix("").parts): p
            for p in sorted((REPO / "tests").rglob("test_*.py")) if "__pycache__" not in p.parts}


def imported_modules(path: Path, tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """``(line, the import as written, the full module names it may import)`` for every
    import of ``path`` (in functions too); a relative import is resolved from the
    package of ``path``, and ``from P import M`` may import ``P.M`` as well as ``P``."""
    package = list(path.relative_to(REPO).parent.parts)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((node.lineno, f"import {alias.name}", [alias.name]))
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            written = f"from {'.' * node.level}{node.module or ''} import " + ", ".join(
                alias.name for alias in node.names)
            found.append((node.lineno, written,
                          [module] + [f"{module}.{alias.name}" for alias in node.names]))
    return found


def test_no_test_module_imports_another_test_module():
    """What several test modules share lives in a support module (tests/README.md:
    tests/support/, or beside them, e.g. tests/cluster/runs.py); importing a test module
    runs its module code again in another module and ties the two together."""
    modules = modules_of_the_tests()
    broken = []
    for name, path in modules.items():
        for line, written, candidates in imported_modules(path, ast.parse(path.read_text())):
            hits = [c for c in candidates if c in modules and c != name]
            if hits:
                broken.append(f"{path.relative_to(REPO)}:{line}: {written} (test module {hits[0]})")
    assert not broken, ("test modules import test modules; move what they share into a "
                        "support module:\n" + "\n".join(broken))


#: Where a path lives is asked in one module, and a bucket is reached through one client:
#: (what a line must not contain, the one module that may, what to call instead).
PATH_QUESTIONS = (
    ('"://" in', "tf_cluster/storage_schemes.py", "storage_schemes.is_local"),
    ('"://" not in', "tf_cluster/storage_schemes.py", "storage_schemes.is_local"),
    ('startswith("gs://")', "tf_cluster/storage_schemes.py", "storage_schemes.is_bucket"),
    ("storage.Client(", "trainer/runtime/gcs.py", "trainer.runtime.gcs.client"),
    ("Retry(", "trainer/runtime/gcs.py", "trainer.runtime.gcs.retry"),
)


def test_where_a_path_lives_is_asked_in_one_module_and_buckets_have_one_client():
    """"Is this a GCS bucket" and "is this a local path" are ``is_bucket`` and ``is_local``
    of :mod:`tf_cluster.storage_schemes`; every request to a bucket goes through the
    client and retry policy of :mod:`trainer.runtime.gcs` (an address such as
    ``grpc://`` in tf_cluster's TF_CONFIG and TPU code is no path)."""
    addresses = {"tf_cluster/tf_config.py", "tf_cluster/tpu.py"}
    found = []
    for root in ("trainer", "models", "tf_cluster"):
        for path in sorted((REPO / root).rglob("*.py")):
            where = str(path.relative_to(REPO))
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for text, home, instead in PATH_QUESTIONS:
                    if (text in line.replace("'", '"') and where != home
                            and not (text.startswith('"://"') and where in addresses)):
                        found.append(f"{where}:{number}: {line.strip()} (use {instead})")
    assert not found, "\n".join(found)


def test_no_project_module_is_named_like_a_standard_library_module():
    """A module named like one of the standard library's (``inspect``, ``signal``...)
    shadows it for a script run from its directory and misleads a reader."""
    clash = [str(p.relative_to(REPO)) for root in (*PROJECT, "benchmarks", "tests")
             for p in (REPO / root).rglob("*.py")
             if p.stem in sys.stdlib_module_names and p.stem != "__init__"]
    clash += [str(p.relative_to(REPO)) for root in (*PROJECT, "benchmarks", "tests")
              for p in (REPO / root).rglob("__init__.py")
              if p.parent.name in sys.stdlib_module_names]
    assert not clash, f"named like a standard-library module: {clash}; rename them"
