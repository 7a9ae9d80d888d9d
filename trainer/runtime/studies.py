"""Opening an Optuna storage by URL, for the sweep (``trainer.sweep.study``) and for the
trials it prunes (``trainer.services.pruning``), so both read a ``--storage`` alike.

* ``journal:///PATH``: Optuna's ``JournalStorage`` over the file ``PATH`` (its directory
  must exist);
* anything else: a SQLAlchemy URL for Optuna's ``RDBStorage``; a ``sqlite:`` database
  waits up to :data:`SQLITE_TIMEOUT_S` for a lock (trials and sweep processes write at
  once).

Optuna (the ``[sweep]`` extra) is imported when a storage is opened, not before.
"""

from __future__ import annotations

import os

JOURNAL = "journal://"
SQLITE_TIMEOUT_S = 60


def open_storage(url: str):
    """Optuna's storage for ``url`` (see the module docstring); raises what Optuna,
    SQLAlchemy or the driver raise (callers make it one line)."""
    import optuna

    if url.startswith(JOURNAL):
        path = url[len(JOURNAL):]
        if not os.path.isdir(os.path.dirname(path) or "."):
            raise FileNotFoundError(f"no directory {os.path.dirname(path)}")
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
    kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if url.startswith("sqlite:") else {}
    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
