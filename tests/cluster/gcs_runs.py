"""Moved to :mod:`tests.cluster.runs` (the cluster runs' config and helpers, in one
module); this name re-exports the gs:// helpers for the benchmarks' ``chaos_run.py``
(benchmarks/ is another change's) until it imports :mod:`tests.cluster.runs`; the
tests import :mod:`tests.cluster.runs`.
"""

from __future__ import annotations

from tests.cluster.runs import DIGITS, RUN_S, bucket_url, fetch, one_error_line, start, trainer_argv

__all__ = ["DIGITS", "RUN_S", "bucket_url", "fetch", "one_error_line", "start", "trainer_argv"]
