"""The command lines' first second: flags, the config file and the workdir, checked
without TensorFlow.

``trainer.main`` and ``trainer.doctor`` parse their flags through :func:`parse_flags`
(absl's ``flags_parser``). Everything that can go wrong while absl parses them and
ml_collections loads the config file (an unknown flag or ``--config.`` override key, a
missing config file, a syntax error in it, no ``get_config``, ``get_config`` raising)
becomes one :class:`trainer.errors.UserError` naming the flag, file, line or field,
printed as the last line; usage errors exit 2, config file errors 1.

Nothing here imports TensorFlow (``tests/test_user_errors.py`` checks it): a typo is
reported in about a second instead of after TensorFlow's 5-20 s import.
"""

from __future__ import annotations

import difflib
import json
import importlib
import importlib.util
import os
import sys
import tempfile
import traceback
from typing import Iterable

import ml_collections
from absl import flags

from tf_cluster.storage_schemes import absolute, is_bucket, is_local, unreachable_scheme
from trainer import config as config_lib
from trainer.checks import bucket
from trainer.errors import UsageError, UserError, WorkdirError, report, write_error

#: trainer.main's --mode values (trainer.commands.continuous_eval runs the two eval modes).
MODES = ("train", "eval", "continuous_eval")
DEFAULT_EVAL_TIMEOUT_S = 3600.0  # --eval_timeout_s: Model Garden's continuous_eval_timeout


class ConfigFileError(UserError):
    """The config file cannot be loaded: missing ``get_config``, a syntax error, or
    ``get_config`` raising. The message names the file and line."""

    prefix = "Config file error"


def config_help() -> str:
    """The ``--config`` flag's help: how to override, and every field with its default."""
    schema = config_lib.get_config()
    sections = []
    for key, value in schema.items():
        if isinstance(value, ml_collections.ConfigDict):
            if key in config_lib.FREE_FORM_SECTIONS:
                sections.append(f"{key}.* (free-form, the Trainer's own)")
            else:
                fields = ", ".join(f"{k}={v!r}" for k, v in value.items())
                sections.append(f"{key}.{{{fields}}}")
        else:
            sections.append(f"{key}={value!r}")
    return ("Experiment config file: a Python file defining get_config() (e.g. "
            "models/configs/digits.py). Override any field with --config.SECTION.FIELD=VALUE. "
            "Fields and defaults (docs/configuration.md explains each): "
            + "; ".join(sections) + ".")


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes/contexts, outermost first."""
    out: list[BaseException] = []
    while error is not None and error not in out:
        out.append(error)
        error = error.__cause__ or error.__context__
    return out


def _flag_value(argv: Iterable[str], name: str) -> str | None:
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _where_in(path: str, chain: list[BaseException]) -> str:
    """``"PATH line N (in FUNC)"`` of the deepest frame in the config file, or PATH."""
    real = os.path.realpath(path)
    for error in reversed(chain):
        frames = [f for f in traceback.extract_tb(error.__traceback__)
                  if os.path.realpath(f.filename) == real]
        if frames:
            return f"{path} line {frames[-1].lineno} (in {frames[-1].name})"
    return path


def _override_error(key: str, argv: list[str], config_path: str | None) -> UserError | None:
    """The message for an override ``--config.A.B=V`` whose path has no field ``key``."""
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        parts = arg[len("--config."):].split("=", 1)[0].split(".")
        if key not in parts:
            continue
        where = "config" + "".join(f".{p}" for p in parts[:parts.index(key)])
        schema = config_lib.get_config()
        parent = schema
        for part in parts[:parts.index(key)]:
            parent = parent.get(part) if isinstance(parent, ml_collections.ConfigDict) else None
        section = parts[0] if len(parts) > 1 else None
        if section in config_lib.FREE_FORM_SECTIONS:
            return UsageError(
                f"{arg}: {where} has no field {key!r} in {config_path}. An override can only "
                f"set a field the config file defines: add {where}.{key} = ... to its "
                f"get_config(), or check the spelling.")
        known = list(parent.keys()) if isinstance(parent, ml_collections.ConfigDict) else []
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" Did you mean {where}.{close[0]}?" if close else ""
        fields = f" Fields of {where}: {', '.join(known)}." if known else ""
        return UsageError(f"{arg}: {where} has no field {key!r}.{hint}{fields}")
    return None


def flag_error(error: BaseException, argv: list[str], own_flags: Iterable[str],
               program: str) -> UserError:
    """Translates an exception raised while parsing ``argv`` (absl flags + ml_collections
    loading ``--config``) into the :class:`UserError` to print; the original is kept as
    ``__cause__`` (shown with ``--traceback``)."""
    chain = _chain(error)
    config_path = _flag_value(argv, "config")
    user = _translate(chain, argv, sorted(own_flags), program, config_path)
    user.__cause__ = error
    return user


def _translate(chain: list[BaseException], argv: list[str], own: list[str], program: str,
               config_path: str | None) -> UserError:
    outer, inner = chain[0], chain[-1]
    text = str(outer)
    if isinstance(outer, flags.UnrecognizedFlagError):
        name = outer.flagname
        if name.startswith("config.") and "config" in own and config_path is None:
            return UsageError(f"--config is required (--{name} overrides a field of it): add "
                              f"--config=FILE, e.g. --config=models/configs/digits.py.")
        close = difflib.get_close_matches(name, own, n=1)
        hint = f" Did you mean --{close[0]}?" if close else ""
        # The doctor builds its Trainer without a workdir: a local or gs:// one has no use.
        writes_nothing = (" It writes nothing, so it takes no workdir (local or gs://): "
                          "drop --workdir." if name == "workdir" else "")
        return UsageError(f"unknown flag --{name}.{hint} {program}'s flags: "
                          f"{', '.join('--' + f for f in own)} (--helpfull lists all)."
                          f"{writes_nothing}")
    if "must have a value other than None" in text:
        name = text.split("--", 1)[1].split("=", 1)[0]
        example = (", e.g. --config=models/configs/digits.py" if name == "config" else "")
        return UsageError(f"--{name} is required{example} ({program} --help lists the flags).")
    if config_path and any(isinstance(e, OSError) and "Failed loading config file" in str(e)
                           for e in chain):
        if not os.path.exists(config_path):
            return UsageError(f"--config={config_path}: no such file. Give the path of a Python "
                              f"file defining get_config(), e.g. "
                              f"--config=models/configs/digits.py.")
        return ConfigFileError(f"--config={config_path} cannot be read: {inner}.")
    syntax = next((e for e in chain if isinstance(e, SyntaxError)), None)
    if syntax is not None:
        code = f": {syntax.text.strip()}" if syntax.text else ""
        return ConfigFileError(f"{syntax.filename} line {syntax.lineno}: {syntax.msg}{code}. "
                               f"Fix the config file.")
    if isinstance(inner, AttributeError) and "get_config" in str(inner):
        return ConfigFileError(
            f"{config_path} defines no get_config(). Add `def get_config():` returning an "
            f"ml_collections.ConfigDict; start from trainer.config.get_config() as "
            f"models/configs/digits.py does.")
    key_error = next((e for e in reversed(chain) if isinstance(e, KeyError)), None)
    if key_error is not None and key_error.args and any(a.startswith("--config.") for a in argv):
        found = _override_error(str(key_error.args[0]), argv, config_path)
        if found is not None:
            return found
    if isinstance(outer, flags.Error) and "Error whilst parsing config file" not in text:
        value_hint = (" Give a value of the field's type (see --help for the defaults)."
                      if "--config." in text else "")
        return UsageError(f"{text.removeprefix('flag ')}.{value_hint}")
    if config_path:
        where = _where_in(config_path, chain)
        return ConfigFileError(f"{where}: loading the config raised {type(inner).__name__}: "
                               f"{inner}. Fix the config file (add --traceback to see the "
                               f"traceback).")
    return UsageError(f"{text} ({program} --help lists the flags).")


def parse_flags(argv: list[str], own_flags: Iterable[str], program: str) -> list[str]:
    """absl ``flags_parser``: parses ``argv`` into ``flags.FLAGS``; on any error prints
    the contract's message (:func:`flag_error`) and exits with its status. ``program``
    (e.g. ``"python -m trainer.main"``) and ``own_flags`` (its flags' names) shape the
    messages."""
    try:
        return flags.FLAGS(argv)
    except Exception as error:  # noqa: BLE001 - every parse failure is reported
        sys.exit(report(flag_error(error, argv, own_flags, program)))


def loaded_config(holder: flags.FlagHolder, argv: list[str], own_flags: Iterable[str],
                  program: str) -> ml_collections.ConfigDict:
    """The config of a ``DEFINE_config_file`` flag. ml_collections defers a missing
    file's error to the first use of the config: it is translated here like the errors
    of :func:`parse_flags` (raised as a :class:`UserError`)."""
    config = holder.value
    try:
        config.keys()
    except OSError as error:
        raise flag_error(error, argv, own_flags, program) from error
    return config


def check_workdir(path: str, contact_bucket: bool = True) -> None:
    """Raises :class:`WorkdirError` unless ``path`` is (or can be made) a directory this
    process can write: it is created if missing, and a small probe file is written,
    flushed to disk and removed (a full or read-only disk fails here, not at the first
    checkpoint). A ``gs://`` URL is checked by :func:`check_bucket`; another URL scheme
    is one line saying what to use instead (``contact_bucket=False``: the bucket is not
    asked, e.g. on a machine that only submits the job). A non-chief worker task of a
    TF_CONFIG cluster writes nothing (only the chief does), so it neither creates nor
    checks a local directory."""
    if not is_local(path):
        problem = unreachable_scheme(path, "--workdir")
        if problem:
            raise WorkdirError(problem)
        if contact_bucket:
            check_bucket(path, "--workdir")
        return
    if not _writes_files():
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise WorkdirError(f"--workdir={path} is a file, not a directory. Give a directory "
                           f"(it is created if missing).")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_probe_") as probe:
            probe.write(b"\0" * 4096)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        translated = write_error(error, f"--workdir={path}")
        if translated is None:
            raise WorkdirError(f"--workdir={path} cannot be used: {error}. Choose another "
                               f"directory.") from error
        raise translated from error


def check_bucket(url: str, what: str) -> None:
    """For a ``gs://`` ``url``: raises :class:`WorkdirError` with one line naming the
    bucket and what to check when, within ``TRAINER_BUCKET_CHECK_S`` seconds (default
    30), it cannot be listed: no such bucket (404), no permission (403), no credentials,
    no answer, or google-cloud-storage / tensorstore not installed
    (:func:`trainer.checks.bucket.bucket_problem`; no TensorFlow). Other URLs pass."""
    if not is_bucket(url):
        return
    problem = bucket.bucket_problem(url, what)
    if problem:
        raise WorkdirError(problem)


def check_data_dir(config: ml_collections.ConfigDict) -> None:
    """:func:`check_bucket` of ``config.data.data_dir`` when the config has one in a
    bucket (``--config.data.data_dir=gs://BUCKET/tfds``)."""
    data_dir = config.get("data", {}).get("data_dir", "") or ""
    if isinstance(data_dir, str):
        check_bucket(data_dir, "--config.data.data_dir")


def resolve_paths(config: ml_collections.ConfigDict, workdir: str | None) -> str | None:
    """The paths a user passes, made absolute here, where they are read: returns
    ``workdir`` absolute and sets ``config.data.data_dir`` (when the config has a local
    one) to its absolute path. URLs (``gs://``) are unchanged. The checks' messages name
    the paths as typed; everything after them (checkpoints, TensorBoard, the TFDS
    reader, every task of a group) sees absolute paths (orbax refuses relative ones)."""
    data = config.get("data")
    data_dir = data.get("data_dir") if data is not None else None
    if isinstance(data_dir, str) and data_dir and absolute(data_dir) != data_dir:
        data.data_dir = absolute(data_dir)
    return absolute(workdir) if workdir else workdir


def _writes_files() -> bool:
    """False for a TF_CONFIG ``worker`` task that is not the chief (worker 0 is the chief
    when the cluster has no ``chief`` task); True otherwise (no TF_CONFIG, chief,
    evaluator, or a TF_CONFIG that the TensorFlow side will reject with its own message)."""
    try:
        tf_config = json.loads(os.environ.get("TF_CONFIG") or "{}")
        task, cluster = tf_config.get("task", {}), tf_config.get("cluster", {})
        return not (task.get("type") == "worker"
                    and (cluster.get("chief") or int(task.get("index", 0)) > 0))
    except (ValueError, TypeError, AttributeError):
        return True


# ------------------------------------------------------------ config.trainer
def _split_trainer_path(path: str) -> tuple[str, str]:
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise config_lib.ConfigError(
            f"config.trainer={path!r} must name a Trainer subclass as "
            f"'package.module:ClassName', e.g. 'models.digits:DigitsTrainer'."
        )
    module_name, class_name = path.split(":")
    return module_name, class_name


def check_trainer_path(path: str) -> None:
    """Checks ``config.trainer`` without importing its module (no TensorFlow): the form
    ``"package.module:ClassName"`` and that the module can be found. Raises ConfigError."""
    module_name, _ = _split_trainer_path(path)
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as error:
        found, reason = None, f" ({error})"
    else:
        reason = ""
    if found is None:
        raise config_lib.ConfigError(
            f"config.trainer={path!r}: module '{module_name}' cannot be found{reason}. "
            f"Check the spelling and that its package is on PYTHONPATH.")


def import_trainer_class(path: str) -> type:
    """Imports the class named ``"package.module:ClassName"`` (the ``config.trainer`` form).

    Raises ConfigError naming the module or attribute that cannot be found. Whether it
    is a ``Trainer`` subclass is checked by ``trainer.trainer.resolve_trainer_class``.
    """
    module_name, class_name = _split_trainer_path(path)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise config_lib.ConfigError(
            f"config.trainer={path!r}: module '{module_name}' cannot be imported ({error}). "
            f"Check the spelling and that its package is on PYTHONPATH."
        ) from error
    cls = getattr(module, class_name, None)
    if cls is None:
        raise config_lib.ConfigError(
            f"config.trainer={path!r}: module '{module_name}' has no attribute "
            f"'{class_name}'.{_close_names(class_name, module)}"
        )
    return cls


def _close_names(name: str, module) -> str:
    """" Did you mean 'A' or 'B'?" naming the classes defined in ``module`` closest to
    ``name`` (difflib, up to 3, closest first; any public name when it defines no class),
    or ""."""
    public = [n for n in dir(module) if not n.startswith("_")]
    defined = [n for n in public if isinstance(getattr(module, n), type)
               and getattr(module, n).__module__ == module.__name__]
    close = difflib.get_close_matches(name, defined or public, n=3)
    if not close:
        return ""
    quoted = [f"'{n}'" for n in close]
    names = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    return f" Did you mean {names}?"
