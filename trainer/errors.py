"""User errors and bugs: how a command line of this package ends when something fails.

A *user error* is something the user can fix (a flag, the config file, the workdir, the
data their hooks return, a port, a device): it subclasses :class:`UserError` and its
message says what is wrong, where (file, field, path, step, hook) and what to do. The
command lines (``trainer.main``, ``trainer.doctor``) run through :func:`call`, which
prints a user error as the LAST lines of the output, without a Python traceback, and
returns its exit status (:data:`EXIT_USAGE` = 2 for a command-line misuse, else
:data:`EXIT_ERROR` = 1; :data:`EXIT_PEER_LOST` = 170, retryable, when a peer task of a
multi-worker run was lost). Anything else is a bug (here or in a Trainer subclass): its
traceback is printed, followed by one line saying it is an internal error.

``--traceback`` on the command line, or ``TF_TRAINER_TRACEBACK=1`` in the environment,
prints the traceback of a user error too.

This module imports neither TensorFlow nor anything of this package: it is the bottom
layer, so every module can raise these errors.
"""

from __future__ import annotations

import difflib
import errno
import os
import re
import sys
import traceback
from typing import Any, Callable

# EXIT_PEER_LOST (170): a peer task of a multi-worker run was lost (killed, its host down
# or cut off): the group must restart, which resumes from the last checkpoint. 128-255, so
# schedulers retry it (Slurm requeue, a TFJob's ExitCode policy, --max_restarts).
from tf_cluster.exit_codes import EXIT_PEER_LOST  # noqa: F401 (shared with the launchers)

EXIT_ERROR = 1
EXIT_USAGE = 2
TRACEBACK_ENV = "TF_TRAINER_TRACEBACK"
TRACEBACK_FLAG = "--traceback"


class UserError(Exception):
    """An error the user can fix; ``str(error)`` says what, where and what to do.

    ``prefix`` starts the printed line (e.g. ``"Configuration error"``); ``exit_code``
    is the process status :func:`call` returns for it.
    """

    prefix = "Error"
    exit_code = EXIT_ERROR


class ConfigError(UserError, ValueError):
    """A configuration value is invalid; the message names the field and the fix
    (raised by :mod:`trainer.config`, which re-exports it)."""

    prefix = "Configuration error"


class UsageError(UserError):
    """The command line itself is wrong (a flag, a missing argument): exit status 2."""

    prefix = "Usage error"
    exit_code = EXIT_USAGE


class HookError(UserError, ValueError):
    """A mistake in the user's code: a hook of the Trainer subclass returned the wrong
    kind of value, or raised. The message names the class, the hook, what it returned
    (or raised) and what it must return; :mod:`trainer.checks.hooks` raises it."""

    prefix = "Hook error"


class InputError(HookError):
    """The data a hook returns does not fit the model or the loss; names the hook."""

    prefix = "Input error"


class TensorFlowError(UserError):
    """TensorFlow stopped a compiled loop with an error that is not traced to the user's
    hooks (a collective across replicas, a runtime check the framework cannot attribute).

    The message says what TensorFlow said, where (the steps), what to try to narrow it
    down and ``--traceback``; it never blames a hook it has not checked."""

    prefix = "TensorFlow error"


class WorkdirError(UserError):
    """The workdir cannot be created or written (a file, permissions, disk)."""

    prefix = "Workdir error"


class StorageError(UserError):
    """A checkpoint could not be written (full disk, quota, read-only or vanished
    workdir): names the path, the step that was not saved and the last good checkpoint
    (:mod:`trainer.checkpoint.service` raises it; exit status 1)."""

    prefix = "Storage error"


class ReplicaDivergenceError(UserError):
    """The copies of a variable differ between replicas or workers: names the variable,
    the step, the likely cause and the fix (:mod:`trainer.services.consistency`)."""

    prefix = "Replica divergence"


class PeerLostError(UserError):
    """A peer task of the run stopped responding; the group must restart (exit 170).

    The message names the task and its TF_CONFIG address, the step and the last
    checkpoint (:mod:`trainer.distribution.lost_peer` builds it from TensorFlow's error)."""

    prefix = "Lost peer"
    exit_code = EXIT_PEER_LOST


# OSError numbers that mean "the place you asked me to write to cannot take it":
# errno -> (what it means, what to do).
class Preempted(RuntimeError):
    """Raised by ``fit()`` after SIGTERM, once the stop's save of ``step`` is committed and
    checked (``saved == step``) or known not to be (see
    :mod:`trainer.checkpoint.guards.preemption`). ``last_good``: the checkpoint a restart
    resumes from, for the message."""

    def __init__(self, step: int, saved: int | None = None, last_good: str = "unknown"):
        if saved == step:
            told = (f"a checkpoint of that step was saved. Its files are committed and "
                    f"checked ({last_good}). Run the same command (or notebook cell) again "
                    f"to resume.")
        else:
            told = (f"NO checkpoint of that step could be saved: the last good checkpoint is "
                    f"{last_good}. Run the same command (or notebook cell) again to resume "
                    f"from there.")
        super().__init__(f"preempted at step {step}; {told}")
        self.step, self.saved, self.last_good = step, saved, last_good


_WRITABLE = "choose a directory this user can write (--workdir)"
_WRITE_ERRNOS = {
    errno.ENOSPC: ("the disk is full", "free space or choose another disk (--workdir)"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space or choose another disk (--workdir)"),
    errno.EROFS: ("the file system is read-only", _WRITABLE),
    errno.EACCES: ("permission denied", _WRITABLE),
    errno.EPERM: ("operation not permitted", _WRITABLE),
    errno.ENOTDIR: ("a part of the path is a file, not a directory", _WRITABLE),
}


# Errors that can only come from a write, so report() translates them wherever they
# come from (a checkpoint, a summary...); the others only where a write is known.
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def write_error(error: OSError, what: str) -> WorkdirError | None:
    """A :class:`WorkdirError` for an ``OSError`` raised while writing, or None.

    ``what`` names what was being written (e.g. ``"--workdir=/tmp/run"``). Only the
    errors a user fixes (full or read-only disk, permissions, a file in the path) are
    translated; None means the error is something else (keep its traceback).
    """
    known = _WRITE_ERRNOS.get(getattr(error, "errno", None))
    if known is None:
        return None
    reason, fix = known
    where = f"{error.filename} ({what})" if error.filename else what
    return WorkdirError(f"cannot write {where}: {reason} [{os.strerror(error.errno)}]; {fix}.")


_STORAGE_ERRNOS = {**{e: reason for e, (reason, _) in _WRITE_ERRNOS.items()},
                   errno.ENOENT: "a directory vanished", errno.EIO: "an I/O error"}
_DISK_FIX = "Free space or make the workdir writable"
# tensorstore (orbax's writer) loses the OSError; its message keeps the number, or
# only its status code for a file or directory that is not there (a vanished workdir).
_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'|\[Errno (\d+)\]")
_TENSORSTORE_NOT_FOUND = "NOT_FOUND: "
# orbax's check of a write it finalizes: files it wrote are no longer there.
_ORBAX_FILES_GONE = re.compile(r"Save failed: \d+/\d+ params are missing")
# An object store's answer (a bucket): the HTTP status in the text of TensorFlow's GCS
# errors and tensorstore's, else the error's kind (TensorFlow's, google-cloud's, or the
# status name tensorstore starts its message with). After the client's own retries.
_HTTP_STATUS = re.compile(r"HTTP (?:response code|status)[:= ]+(\d{3})")
_STATUS_OF_KIND = {
    "PermissionDeniedError": 403, "PERMISSION_DENIED": 403, "Forbidden": 403,
    "UnauthenticatedError": 401, "UNAUTHENTICATED": 401, "Unauthorized": 401,
    "ResourceExhaustedError": 429, "RESOURCE_EXHAUSTED": 429, "TooManyRequests": 429,
    "UnavailableError": 503, "UNAVAILABLE": 503, "ServiceUnavailable": 503,
    "AbortedError": 503, "ABORTED": 503, "InternalServerError": 500, "BadGateway": 502,
    "DeadlineExceededError": 504, "DEADLINE_EXCEEDED": 504, "GatewayTimeout": 504,
    "NotFoundError": 404, "NotFound": 404,
}
_STATUS_FAULTS = {  # status -> (what it means, what to do)
    401: ("the storage refused the credentials (401)",
          "Log in again (gcloud auth application-default login) or fix the service account"),
    403: ("the storage refused the write (403: this account may not write there)",
          "Grant this account write access (e.g. roles/storage.objectAdmin on the bucket) "
          "or choose another --workdir"),
    404: ("an object or directory is gone (404: removed by another writer or a lifecycle "
          "rule?)", "Make sure one run alone writes to this workdir"),
    429: ("the storage throttled the requests (429) beyond the client's retries",
          "Save less often (checkpoint.every_steps) or ask for a higher request quota"),
}
_SERVER_FAULT = ("the storage kept failing ({status}) beyond the client's retries",
                 "Check the storage's status page or retry later")


def _http_fault(error: BaseException) -> tuple[str, str] | None:
    """(reason, fix) when ``error`` is an object store's refusal or failure."""
    match = _HTTP_STATUS.search(str(error))
    status = int(match.group(1)) if match else _STATUS_OF_KIND.get(type(error).__name__)
    if status is None:
        status = _STATUS_OF_KIND.get(str(error).partition(":")[0])
    if status in _STATUS_FAULTS:
        return _STATUS_FAULTS[status]
    if status is not None and 500 <= status < 600:
        return _SERVER_FAULT[0].format(status=status), _SERVER_FAULT[1]
    return None


def _fault(error: BaseException | None) -> tuple[str, str] | None:
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        number = getattr(error, "errno", None) if isinstance(error, OSError) else None
        if number is None:
            match = _OS_ERROR_CODE.search(str(error))
            number = int(match.group(1) or match.group(2)) if match else None
        if number is None:  # TensorFlow's file errors keep only the text
            number = next((n for n in _STORAGE_ERRNOS if os.strerror(n) in str(error)), None)
        if number is None and (str(error).startswith(_TENSORSTORE_NOT_FOUND)
                               or _ORBAX_FILES_GONE.search(str(error))):
            number = errno.ENOENT
        if number in _STORAGE_ERRNOS:
            return f"{_STORAGE_ERRNOS[number]} [{os.strerror(number)}]", _DISK_FIX
        if (http := _http_fault(error)) is not None:
            return http
        seen.append(error)
        error = error.__cause__ or error.__context__
    return None


def storage_fault(error: BaseException) -> str | None:
    """What is wrong with the storage when ``error`` (or an error in its cause/context
    chain) is a failed write of a full, read-only, vanished ... file system (an
    ``OSError``, or orbax's / tensorstore's error naming its errno) or an object store's
    refusal or failure after retries (403, 401, 404, 429, 5xx: in TensorFlow's,
    tensorstore's or google-cloud's words); else None."""
    found = _fault(error)
    return found[0] if found else None


def storage_fault_fix(error: BaseException) -> str:
    """What to do about the :func:`storage_fault` of ``error`` (a sentence without its
    final period)."""
    found = _fault(error)
    return found[1] if found else _DISK_FIX


_AUTOGRAPH_REWRITE = "in user code:"  # how AutoGraph starts an error message it rewrote


def user_error_in(error: BaseException) -> UserError | None:
    """A fresh copy of the first :class:`UserError` in ``error``'s cause/context chain,
    or None. (AutoGraph re-raises an error of a traced function, as another type or as
    the same type with the trace in its message, "in user code: ..."; the user's error
    as raised is then further down the chain, and is the one returned.)"""
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        rewritten = str(error).startswith(_AUTOGRAPH_REWRITE)
        if isinstance(error, UserError) and not rewritten:
            try:
                return type(error)(*error.args)
            except TypeError:
                return error
        seen.append(error)
        error = error.__cause__ or error.__context__
    return None


def wants_traceback(argv: list[str] | None = None) -> bool:
    """True when the user asked for tracebacks of user errors (flag or environment)."""
    argv = sys.argv if argv is None else argv
    env = os.environ.get(TRACEBACK_ENV, "").strip().lower()
    return env not in ("", "0", "false", "no") or any(
        a == TRACEBACK_FLAG or (a.startswith(TRACEBACK_FLAG + "=")
                                and a.split("=", 1)[1].lower() in ("1", "true"))
        for a in argv)


def report(error: BaseException) -> int:
    """Prints ``error`` the contract's way on stderr and returns the exit status.

    A :class:`UserError` (or an ``OSError`` of a full or read-only disk) is one message
    (its traceback first when :func:`wants_traceback`); anything else is a bug: its
    traceback, then a line saying so.
    """
    user = error if isinstance(error, UserError) else (
        write_error(error, "writing the run's files")
        if isinstance(error, OSError) and error.errno in _DISK_ERRNOS else None)
    sys.stdout.flush()
    if user is None:
        traceback.print_exception(error)
        print(f"Internal error (a bug in tf-trainer or in the Trainer subclass, not a usage "
              f"error): {type(error).__name__}: {error}. The traceback above shows where: "
              f"fix your hook if it ends in your code, else report it with the traceback.",
              file=sys.stderr)
        sys.stderr.flush()
        return EXIT_ERROR
    if wants_traceback():
        traceback.print_exception(error)
    print(f"{user.prefix}: {user}", file=sys.stderr)
    sys.stderr.flush()
    return user.exit_code


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type's name when it has none)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def call(fn: Callable[..., object], *args: object) -> object:
    """Runs ``fn(*args)``; an exception is reported (:func:`report`) and its exit status
    returned instead. ``SystemExit`` and ``KeyboardInterrupt`` pass through."""
    try:
        return fn(*args)
    except Exception as error:  # noqa: BLE001 - every failure ends in report()
        return report(error)


# ---------------------------------------------------------------- config rules
# The rules a config field is checked by (``trainer.config.validate`` applies them): each
# raises one ConfigError naming the field, its value and what it must be.
def suggest(name: str, choices) -> str:
    """" Did you mean 'X'?" for the closest of ``choices``, or ""."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


def check_choice(field: str, value: Any, choices) -> None:
    """Raises ``config.FIELD=VALUE is not one of ...`` (with a suggestion) unless in ``choices``."""
    if value not in choices:
        raise ConfigError(
            f"config.{field}={value!r} is not one of {', '.join(map(repr, choices))}."
            f"{suggest(str(value), choices)}"
        )


def check_positive(field: str, value: Any, allow_zero: bool = False) -> None:
    """Raises unless ``value`` is an int > 0 (``>= 0`` with ``allow_zero``)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and (
        value >= 0 if allow_zero else value > 0
    )
    if not ok:
        bound = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"config.{field}={value!r} must be {bound} integer.")


def check_seconds(field: str, value: Any, zero_turns_off: str = "") -> None:
    """Raises unless ``value`` is a number of seconds > 0 (``>= 0`` when 0 turns
    ``zero_turns_off`` off)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if zero_turns_off:
        require(field, value, number and value >= 0,
                f"a number of seconds >= 0 (0 turns {zero_turns_off} off)")
    else:
        require(field, value, number and value > 0, "a number of seconds > 0")


def require(field: str, value: Any, ok: bool, rule: str) -> None:
    """Raises ``config.FIELD=VALUE must be RULE.`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"config.{field}={value!r} must be {rule}.")


def check_known_fields(where: str, section: Any, schema: Any) -> None:
    """Raises ``WHERE.FIELD is not a field of the schema`` (with a suggestion) for a key of
    ``section`` that ``schema`` lacks, recursively through its sub-sections (both
    ``ml_collections.ConfigDict`` or dicts)."""
    for sub in section.keys():
        if sub not in schema:
            raise ConfigError(
                f"{where}.{sub} is not a field of the schema.{suggest(sub, schema.keys())} "
                f"Known fields of {where}: {', '.join(sorted(schema.keys()))}.")
        if hasattr(schema[sub], "keys"):
            if not hasattr(section[sub], "keys"):
                raise ConfigError(f"{where}.{sub} must be a section (ConfigDict), got "
                                  f"{section[sub]!r}.")
            check_known_fields(f"{where}.{sub}", section[sub], schema[sub])
