"""A workdir's goodput record (``workdir/goodput.json``): where every attempt's time went.

One entry per attempt (a process that ran ``fit()`` on the workdir: the first run and
every restart after a preemption, a SIGKILL, a lost VM), in order::

    {"version": 1, "attempts": [
      {"start": T0,              # the process's start (Unix seconds)
       "restored_step": R,       # the step it resumed from (0: none)
       "last_step": S, "last_time": T,  # its last recorded progress
       "steps": N, "step_s": X,  # steps it trained, its measured seconds per step
       "seconds": {CATEGORY: s}, # its time from T0 to T, by MEASURED category
       "wasted_steps": W, "wasted_s": w,  # the previous attempt's steps past its last
       "wasted_input_s": i,               # checkpoint, redone by this one (i of w: input
                                          # wait)
       "recovery_s": r},         # T0 - the previous attempt's last_time
      ...]}

:func:`summary` adds the attempts up; the categories (:data:`CATEGORIES`) sum to the wall
time from the first attempt's start to the last record. :class:`RecordFile` reads and
writes the file (a bucket object for ``gs://``, through the process's client and its
retry policy: :mod:`trainer.runtime.gcs`). :func:`table` is the end-of-run table.

Host only; no TensorFlow.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from tf_cluster.storage_schemes import is_bucket
from trainer.runtime import gcs

FILE = "goodput.json"
VERSION = 1
#: What an attempt measures itself, from its process start to its last record.
MEASURED = ("program_startup", "training_prep", "data_loading", "checkpoint_save",
            "checkpoint_restore", "evaluation", "productive", "other")
#: Every category of the summary, in the table's order (productive first).
CATEGORIES = ("productive", "program_startup", "training_prep", "data_loading",
              "checkpoint_save", "checkpoint_restore", "evaluation", "wasted_progress",
              "infrastructure_recovery", "other")
#: The numbers of a ``goodput`` record of metrics.jsonl (and its TensorBoard tags).
KEYS = ("goodput/goodput", "goodput/total_s", "goodput/attempts", "goodput/wasted_steps",
        *(f"goodput/{category}_s" for category in CATEGORIES))
_LABELS = {"productive": "productive training", "program_startup": "program startup",
           "training_prep": "training prep", "data_loading": "data loading wait",
           "checkpoint_save": "checkpoint save (blocking)",
           "checkpoint_restore": "checkpoint restore", "evaluation": "evaluation",
           "wasted_progress": "wasted progress", "infrastructure_recovery":
           "infrastructure recovery", "other": "other"}


class RecordFile:
    """``workdir/goodput.json``: read whole, replaced whole (a local file by rename, a
    bucket object by one upload)."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, FILE)
        self._blob = None
        if is_bucket(workdir):
            bucket, name = gcs.split_url(self.path)
            self._blob = gcs.client().bucket(bucket).blob(name)

    def read(self) -> list[dict[str, Any]]:
        """The attempts recorded so far ([]: no record yet). Raises ValueError for a
        record that does not parse, OSError (or the client's error) when unreadable."""
        if self._blob is None:
            try:
                with open(self.path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                return []
        else:
            from google.api_core.exceptions import NotFound

            try:
                data = self._blob.download_as_bytes(retry=gcs.default_retry())
            except NotFound:
                return []
        record = json.loads(data)
        if record.get("version") != VERSION or not isinstance(record.get("attempts"), list):
            raise ValueError(f"not a version-{VERSION} goodput record")
        return record["attempts"]

    def write(self, attempts: list[dict[str, Any]]) -> None:
        """Replaces the record by ``attempts``."""
        data = json.dumps({"version": VERSION, "attempts": attempts}, indent=1).encode()
        if self._blob is not None:
            self._blob.upload_from_string(data, retry=gcs.default_retry())
            return
        directory = os.path.dirname(self.path)
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile("wb", dir=directory, suffix=".tmp",
                                         delete=False) as f:
            f.write(data)
        os.replace(f.name, self.path)


def follow(previous: dict[str, Any] | None, start: float, restored: int) -> dict[str, float]:
    """What an attempt starting at ``start`` from step ``restored`` says of the attempt
    before it (None: none): its steps past ``restored`` (recorded, so trained, then lost)
    at its measured seconds per step (``wasted_s``; ``wasted_input_s`` of it was input
    wait, in the share of its loop time that was), and the time from its last record to
    ``start``."""
    if previous is None:
        return {"wasted_steps": 0, "wasted_s": 0.0, "wasted_input_s": 0.0, "recovery_s": 0.0}
    wasted = max(0, int(previous["last_step"]) - restored)
    spent = previous["seconds"]
    trained_s = spent["productive"] + spent["data_loading"]
    wasted_s = min(wasted * float(previous["step_s"]), trained_s)
    return {"wasted_steps": wasted, "wasted_s": wasted_s,
            "wasted_input_s": wasted_s * spent["data_loading"] / trained_s if trained_s else 0.0,
            "recovery_s": max(0.0, start - float(previous["last_time"]))}


def summary(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """The attempts added up: ``seconds`` by category (:data:`CATEGORIES`), ``total_s``
    (wall time, first start to last record), ``goodput`` (productive / total),
    ``attempts``, ``wasted_steps``, ``step`` (the last recorded)."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for attempt in attempts:
        for category, value in attempt["seconds"].items():
            seconds[category] += value
        seconds["wasted_progress"] += attempt["wasted_s"]
        seconds["productive"] -= attempt["wasted_s"] - attempt["wasted_input_s"]
        seconds["data_loading"] -= attempt["wasted_input_s"]
        seconds["infrastructure_recovery"] += attempt["recovery_s"]
    total = attempts[-1]["last_time"] - attempts[0]["start"]
    return {"seconds": seconds, "total_s": total,
            "goodput": seconds["productive"] / total if total > 0 else 0.0,
            "attempts": len(attempts), "step": attempts[-1]["last_step"],
            "wasted_steps": sum(a["wasted_steps"] for a in attempts)}


def scalars(summed: dict[str, Any]) -> dict[str, float]:
    """A :func:`summary` as flat numbers under :data:`KEYS` (a metrics.jsonl record's
    and TensorBoard's)."""
    return dict(zip(KEYS, [summed["goodput"], summed["total_s"], summed["attempts"],
                           summed["wasted_steps"],
                           *(summed["seconds"][c] for c in CATEGORIES)]))


def table(record: dict[str, Any]) -> str:
    """The end-of-run table of a ``goodput`` record (:func:`scalars` and its step)."""
    total = record["goodput/total_s"]
    attempts = int(record["goodput/attempts"])
    lines = [f"goodput {record['goodput/goodput']:.1%} at step {record['step']}: "
             f"{total:.1f} s of wall time over {attempts} attempt{'s' * (attempts > 1)} "
             f"(the workdir's {FILE})"]
    for category in CATEGORIES:
        value = record[f"goodput/{category}_s"]
        note = (f"  ({int(record['goodput/wasted_steps'])} steps redone)"
                if category == "wasted_progress" else "")
        lines.append(f"  {_LABELS[category]:<28}{value:>10.1f} s {value / max(total, 1e-9):>6.1%}"
                     f"{note}")
    return "\n".join(lines)
