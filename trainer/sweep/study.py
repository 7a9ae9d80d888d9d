"""The study: an Optuna study in a real database, and what each trial keeps in it.

Storage: ``--storage`` is any SQLAlchemy URL Optuna's ``RDBStorage`` takes
(``postgresql://...``, ``mysql+pymysql://...`` for many machines), or
``journal:///PATH``: Optuna's journal file (``JournalStorage(JournalFileBackend(PATH))``,
an append-only log for a shared filesystem without a database server); by default
``sqlite:///DIR/study.db``, a file in the sweep's directory (one machine). The study's
name defaults to DIR's base name. A storage that cannot be opened is one line
(:class:`StorageError`).

The study keeps what the sweep was started with (its user attributes ``space`` and
``metric``): a later run with another space or metric is refused in one line, since its
trials would not be comparable. Each trial keeps, as user attributes (:data:`ATTRS`):
its ``workdir``, the ``command`` that reproduces it, the ``overrides`` it sets, how often
it was ``resumed`` and ``retries`` after a crash, the ``step`` it reached, its ``seconds``
of runs, the ``error`` it failed with, the step it was ``pruned`` at (written by its
run), and who runs it: ``owner`` (``host:pid`` of the sweep process, ``""`` once
preempted), ``pid`` (its ``trainer.main`` process) and ``heartbeat`` (Unix time, renewed
while it runs); and ``mlflow_run``, its MLflow run's id (:mod:`trainer.sweep.mlflow_runs`).

A preempted trial stays RUNNING in Optuna (no state means "paused"), released
(``owner=""``); a trial whose sweep process is gone (killed) is stale: no process on
this host with that pid runs ``trainer.sweep``, or, from another host, no heartbeat for
:data:`STALE_S` seconds. Both are resumed (:func:`resumable`) in their own workdir and
told to Optuna under their own number: a resumed trial is the same trial.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from trainer.errors import ConfigError, UserError, first_line
from trainer.runtime import studies

try:  # the [sweep] extra; trainer.sweep.cli says what to install without it
    import optuna
except ImportError:  # pragma: no cover - exercised only without the extra
    optuna = None

ATTRS = ("workdir", "command", "overrides", "resumed", "retries", "step", "seconds",
         "error", "owner", "pid", "heartbeat", "mlflow_run", "pruned")
HEARTBEAT_S = 10.0
STALE_S = 60.0


class StorageError(UserError):
    """``--storage`` cannot be opened (a path that does not exist, no driver, no server)."""

    prefix = "Storage error"


def default_storage(root: str) -> str:
    """``sqlite:///ROOT/study.db`` (absolute)."""
    return f"sqlite:///{os.path.join(os.path.abspath(root), 'study.db')}"


def default_name(root: str) -> str:
    """The base name of ``root``: the study's default name."""
    return os.path.basename(os.path.normpath(os.path.abspath(root)))


def owner_id() -> str:
    """``host:pid`` of this sweep process."""
    return f"{socket.gethostname()}:{os.getpid()}"


def sqlite_path(url: str) -> str:
    """The file of a ``sqlite:///PATH`` URL."""
    return url[len("sqlite:///"):]


def open_storage(url: str):
    """Optuna's storage for ``url``; raises :class:`StorageError` in one line."""
    try:
        return studies.open_storage(url)
    except Exception as error:  # noqa: BLE001 - SQLAlchemy, drivers, Optuna: all one line
        first = first_line(error).rstrip(".")
        missing = getattr(error.__cause__, "name", None)  # the driver SQLAlchemy imported
        if isinstance(error.__cause__, ImportError) and missing:
            first = f"{first} (no module {missing!r}: install the URL's driver)"
        raise StorageError(f"--storage={url} cannot be opened: {type(error).__name__}: "
                           f"{first}. Give a SQLAlchemy URL of a database this machine "
                           f"reaches, e.g. sqlite:////abs/path/study.db, or "
                           f"journal:///abs/path/study.log.") from error


class Study:
    """The Optuna study and the trial attributes the sweep keeps (see the module)."""

    def __init__(self, storage, name: str):
        self.storage, self.name = storage, name
        self.optuna = optuna.load_study(study_name=name, storage=storage)
        self.study_id = storage.get_study_id_from_name(name)

    @classmethod
    def open(cls, storage, name: str, direction: str, space: list[str],
             metric: str) -> "Study":
        """Creates the study or loads it; refuses a changed direction, space or metric."""
        study = optuna.create_study(storage=storage, study_name=name, direction=direction,
                                    load_if_exists=True)
        attrs = study.user_attrs
        if not attrs:
            study.set_user_attr("space", space)
            study.set_user_attr("metric", metric)
            attrs = {"space": space, "metric": metric}
        was = study.direction.name.lower()
        for what, before, now in (("config.sweep.direction", was, direction),
                                  ("config.sweep.metric", attrs.get("metric"), metric),
                                  ("the search space", attrs.get("space"), space)):
            if before != now:
                raise ConfigError(
                    f"study {name!r} was started with {what} {before!r}, now {now!r}: its "
                    f"trials would not compare. Use another --study or --workdir, or the "
                    f"original setting.")
        found = cls(storage, name)
        found.optuna = study
        return found

    @classmethod
    def load(cls, storage, name: str) -> "Study":
        """An existing study; raises StorageError when the storage has no such study."""
        try:
            return cls(storage, name)
        except KeyError as error:
            names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
            raise StorageError(f"no study {name!r} in that storage (it holds: "
                               f"{', '.join(names) or 'none'}); pass --study=NAME.") from error

    def trials(self) -> list:
        """Every trial, as Optuna's FrozenTrial (fresh from the storage)."""
        return self.optuna.get_trials(deepcopy=False)

    def trial(self, number: int):
        return self.storage.get_trial(self._trial_id(number))

    def _trial_id(self, number: int) -> int:
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)

    def set(self, number: int, **attrs: Any) -> None:
        """Sets trial ``number``'s user attributes (names from :data:`ATTRS`)."""
        trial_id = self._trial_id(number)
        for key, value in attrs.items():
            assert key in ATTRS, key
            self.storage.set_trial_user_attr(trial_id, key, value)

    def beat(self, number: int) -> None:
        """Renews running trial ``number``'s heartbeat. A trial that finished meanwhile
        (told between the runner's look at its running trials and this write) keeps its
        attributes: a finished trial needs no heartbeat."""
        try:
            self.set(number, heartbeat=time.time())
        except optuna.exceptions.UpdateFinishedTrialError:
            pass

    def ask(self, seed: int):
        """A new trial (Optuna's ``Trial``, RUNNING) whose values (drawn when they are
        suggested) come from a TPE sampler seeded with ``seed + its number``: they depend
        on the seed, the number and the trials finished so far, never on which process
        asks or how often the sweep was started (docs/sweeps.md, "Seeding"). One ask and
        its suggestions at a time (the runner holds its lock)."""
        trial = self.optuna.ask()
        self.optuna.sampler = optuna.samplers.TPESampler(seed=seed + trial.number)
        return trial

    def pruned_at(self, number: int) -> int | None:
        """The step at which the trial's run was pruned (its ``pruned`` attribute, which
        the run's chief writes: :mod:`trainer.services.pruning`), or None."""
        return self.trial(number).user_attrs.get("pruned")

    def prune(self, number: int, step: int) -> None:
        """Tells Optuna the trial is PRUNED at ``step`` (its value: the last one its run
        reported)."""
        self.set(number, owner="", step=step)
        self.optuna.tell(number, state=optuna.trial.TrialState.PRUNED)

    def finish(self, number: int, value: float | None = None, error: str = "") -> None:
        """Tells Optuna the trial is COMPLETE with ``value``, or FAIL with ``error``."""
        if value is None:
            self.set(number, error=error, owner="")
            self.optuna.tell(number, state=optuna.trial.TrialState.FAIL)
        else:
            self.set(number, owner="")
            self.optuna.tell(number, value)


def _alive_here(pid: Any, needle: str) -> bool:
    """Whether process ``pid`` runs on this host with ``needle`` in its command line."""
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            return needle in f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except (OSError, ValueError, TypeError):
        return False


def trial_process_alive(trial) -> bool:
    """Whether the trial's ``trainer.main`` process still runs here (an orphan of a sweep
    process that was killed)."""
    return _alive_here(trial.user_attrs.get("pid"), trial.user_attrs.get("workdir") or "\0")


def resumable(trial, now: float | None = None) -> bool:
    """A RUNNING trial nobody runs: preempted (released), or its sweep process gone."""
    if trial.state != optuna.trial.TrialState.RUNNING:
        return False
    attrs = trial.user_attrs
    owner = attrs.get("owner")
    if owner is None:  # asked, not yet claimed: stale only once old
        started = trial.datetime_start.timestamp() if trial.datetime_start else 0.0
        return (now or time.time()) - started > STALE_S
    if owner == "":
        return True
    host, _, pid = owner.rpartition(":")
    if host == socket.gethostname():
        return not _alive_here(pid, "trainer.sweep")
    return (now or time.time()) - float(attrs.get("heartbeat") or 0) > STALE_S


def state_of(trial) -> str:
    """COMPLETE, PRUNED, FAIL, RUNNING; PREEMPTED for a RUNNING trial nobody runs."""
    if trial.state == optuna.trial.TrialState.RUNNING and resumable(trial):
        return "PREEMPTED"
    return trial.state.name


def overrides_of(trial) -> dict[str, Any]:
    """The values the trial sets (its ``overrides`` attribute, a JSON object)."""
    try:
        return json.loads(trial.user_attrs.get("overrides") or "{}")
    except ValueError:
        return {}
