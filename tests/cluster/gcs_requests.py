"""Reading the GCS emulator's request log as a bill: requests by phase, and the rounds.

Used by ``tests/cluster/test_gcs_request_budget.py`` (the request budget of a save, a
stop's save and a restore) and ``benchmarks/checkpoints/bucket_checkpoint.py`` (the same table at
several latencies).

* :func:`phase` names what a request of a run in ``gs://BUCKET/PREFIX`` was for:
  ``listing``, ``metadata`` (an object's or bucket's metadata), ``data upload``,
  ``commit`` (a step's commit marker), ``read`` (an object's bytes), ``delete``
  (of checkpoint objects: retention), ``telemetry`` (metrics.jsonl, event files:
  uploads, composes and their parts' deletes), ``lease`` (lease.json), ``other``.
* :func:`rounds` is the number of sequential round trips a set of requests took: the
  groups of requests whose spans ``[t, end]`` overlap (requests in flight together
  are one round; one after another, one each).
* :func:`bill` puts both in one row: ``{"requests", "rounds", "seconds", PHASE: n}``.
"""

from __future__ import annotations

import urllib.parse
from collections import Counter
from typing import Iterable

PHASES = ("listing", "metadata", "data upload", "commit", "read", "delete", "telemetry",
          "lease", "other")
_TELEMETRY = ("metrics.jsonl", "/train/", "/eval/")


def listed_prefix(record: dict) -> str | None:
    """The prefix a listing request asks for, or None."""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(record["path"]).query)
    return query.get("prefix", [None])[0]


def belongs(record: dict, prefix: str) -> bool:
    """Whether ``record`` is a request about the run under ``prefix`` (its objects, or
    a listing inside it)."""
    name = record.get("object") or listed_prefix(record) or ""
    return name.startswith(prefix)


def phase(record: dict) -> str:
    """What the request was for (one of :data:`PHASES`)."""
    name = record.get("object") or ""
    path, method = record["path"], record["method"]
    if name.endswith("lease.json"):
        return "lease"
    if any(t in name for t in _TELEMETRY) or path.split("?")[0].endswith("/compose"):
        return "telemetry"
    if not name:
        return "listing" if listed_prefix(record) is not None else "other"
    if method == "DELETE":
        return "delete"
    if "/upload/" in path or method in ("PUT", "POST"):
        return "commit" if name.endswith("/commit_success.txt") else "data upload"
    if "alt=media" in path or not path.startswith("/storage/v1/"):
        return "read"
    return "metadata"


def rounds(records: Iterable[dict]) -> int:
    """Sequential round trips: groups of requests whose spans overlap."""
    spans = sorted((r["t"], r.get("end", r["t"])) for r in records)
    count, reach = 0, float("-inf")
    for start, end in spans:
        if start > reach:
            count += 1
        reach = max(reach, end)
    return count


def bill(records: list[dict]) -> dict:
    """``{"requests", "rounds", "seconds" (first start to last answer), PHASE: n}``."""
    phases = Counter(phase(r) for r in records)
    seconds = (max(r.get("end", r["t"]) for r in records) - min(r["t"] for r in records)
               if records else 0.0)
    return {"requests": len(records), "rounds": rounds(records), "seconds": round(seconds, 2),
            **{p: phases.get(p, 0) for p in PHASES}}


def between(records: list[dict], start: float, end: float) -> list[dict]:
    """The requests that started in ``[start, end]``."""
    return [r for r in records if start <= r["t"] <= end]


def step_requests(records: list[dict], directory: str, step: int) -> list[dict]:
    """The requests naming objects of ``directory/step/``, or listing inside it
    (``directory``: the object prefix of a checkpoint directory, e.g. ``run/checkpoints``)."""
    prefix = f"{directory.rstrip('/')}/{step}/"
    return [r for r in records if (r.get("object") or listed_prefix(r) or "").startswith(prefix)]


def commit_of(records: list[dict], directory: str, step: int) -> dict | None:
    """The request that committed ``directory/step`` (its marker's upload), or None."""
    marker = f"{directory.rstrip('/')}/{step}/commit_success.txt"
    found = [r for r in records if r.get("object") == marker and phase(r) == "commit"
             and r.get("status") == 200]
    return found[-1] if found else None
