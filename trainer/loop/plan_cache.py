"""Plans measured before, kept per user: a later run of the same key adopts one at once.

A run that measured its execution plan (:mod:`trainer.loop.plan`) writes the choice to
``DIRECTORY/KEY.json``; a later run with the same key — short or long, any workdir —
adopts it before its first step instead of measuring (short runs are never measured, so
without the cache they keep the configured plan). ``perf.plan_cache`` is the directory:
``""`` (default) ``$XDG_CACHE_HOME/tf-trainer/plans`` (``~/.cache/...`` without
``XDG_CACHE_HOME``), a path, or ``"off"``.

The key (:func:`key_fields`) is what a measurement is valid for: the trainer class, the
model's variables (paths, shapes, dtypes), one replica's train batch spec, the settings
that change the step (precision policy, ``perf.*`` but the plan's own fields, the global
batch, ``train.steps_per_loop`` and ``train.log_every_steps`` that bound the
candidates, the ``model`` and ``distribute`` sections) and the plan signature (strategy, replica and worker
counts, devices, CPUs, TensorFlow version). Anything else measures again.

Read and written by the chief alone (the planner broadcasts its choice); a file that
cannot be read or written is one warning, never an error. Host only.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import tempfile
from typing import Any

from absl import logging

DEFAULT_SUBDIR = os.path.join("tf-trainer", "plans")
_PLAN_FIELDS = ("plan", "plan_min_run_s", "plan_trial_s", "plan_rounds", "plan_cache")


def directory(setting: str) -> str | None:
    """The cache directory of ``perf.plan_cache`` (None: ``"off"``)."""
    if setting == "off":
        return None
    if setting:
        return os.path.expanduser(setting)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, DEFAULT_SUBDIR)


def key_fields(trainer: Any, batch_spec: Any, signature: dict[str, Any]) -> dict[str, Any]:
    """What a plan measured for ``trainer`` (a built :class:`trainer.Trainer`) on batches
    of ``batch_spec`` (one replica's) under ``signature`` is valid for (module doc)."""
    config = trainer.config
    cls = type(trainer)
    return {
        "trainer": f"{cls.__module__}:{cls.__qualname__}",
        "variables": [[v.path, list(v.shape), str(v.dtype)] for v in trainer.model.weights],
        "batch": repr(batch_spec),
        "settings": {
            "precision": config.precision.policy,
            "perf": {k: v for k, v in config.perf.to_dict().items() if k not in _PLAN_FIELDS},
            "global_batch_size": config.train.global_batch_size,
            "steps_per_loop": config.train.steps_per_loop,
            "log_every_steps": config.train.log_every_steps,
            "model": config.model.to_dict(),
            "distribute": config.distribute.to_dict(),  # all-reduce, packs, sync BN ...
        },
        "signature": signature,
    }


def for_run(trainer: Any, batch_spec: Any, signature: dict[str, Any]) -> "PlanCache | None":
    """The cache entry of ``trainer``'s run (:func:`key_fields`) on its chief; None on
    the other workers and with ``perf.plan_cache="off"``."""
    root = directory(trainer.config.perf.plan_cache)
    if root is None or not trainer.is_chief:
        return None
    return PlanCache(root, key_fields(trainer, batch_spec, signature))


class PlanCache:
    """The entry of one key in ``root`` (:func:`directory`): :meth:`read` before the
    first step, :meth:`write` after a measurement (chief)."""

    def __init__(self, root: str, fields: dict[str, Any]):
        text = json.dumps(fields, sort_keys=True, default=str)
        self.fields = json.loads(text)  # as stored (tuples as lists)
        self.key = hashlib.sha256(text.encode()).hexdigest()[:32]
        self.path = os.path.join(root, f"{self.key}.json")

    def read(self) -> dict[str, Any] | None:
        """``{"chosen": {...}, "measured_at": "YYYY-MM-DD..."}`` of this key, or None
        (none stored; a file that cannot be read is one warning)."""
        try:
            with open(self.path, encoding="utf-8") as f:
                entry = json.load(f)
            if entry["fields"] != self.fields:
                return None  # another key with the same digest prefix: measure
            datetime.date.fromisoformat(entry["measured_at"][:10])
            return {"chosen": dict(entry["chosen"]), "measured_at": entry["measured_at"]}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:
            logging.warning("plan cache: %s cannot be read (%s: %s); ignored, this run "
                            "measures as if it were not there (and rewrites it).",
                            self.path, type(error).__name__, error)
            return None

    def write(self, record: dict[str, Any]) -> None:
        """Stores the plan a measurement chose (``record``: the decision's event fields)
        atomically; a failed write is one warning."""
        entry = {"chosen": record["chosen"], "measured_at": datetime.datetime.now().isoformat(
            timespec="seconds"), "ratio": record.get("ratio"), "plans": record.get("plans"),
            "fields": self.fields}
        temporary = None
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(self.path),
                                             suffix=".tmp", delete=False) as f:
                temporary = f.name
                json.dump(entry, f, indent=1, default=str)
            os.replace(temporary, self.path)
        except OSError as error:
            if temporary and os.path.exists(temporary):
                os.unlink(temporary)
            logging.warning("plan cache: cannot write %s (%s); later runs measure again. "
                            "Set perf.plan_cache to a writable directory or 'off'.",
                            self.path, error)
