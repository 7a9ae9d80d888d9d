"""A sweep in TensorBoard's HParams dashboard: ``tensorboard --logdir DIR``.

Written by the sweep process (TensorBoard's protos and record writer, no TensorFlow),
when ``config.telemetry.loggers`` has ``"tensorboard"`` and the ``tensorboard`` package
is installed:

* each trial's *session* (its swept values, its number as the trial id) in its workdir
  ``DIR/trials/NNNN``, when it first starts: the parent directory of the runs its
  ``trainer.main`` writes scalars to (``trials/NNNN/train``, ``trials/NNNN/eval``), so the
  dashboard reads the metric ``eval/accuracy`` of session ``trials/NNNN`` from run
  ``trials/NNNN/eval``, tag ``accuracy``; a resumed trial keeps its session;
* the *experiment*, once, in ``DIR`` when the first trial completes (``config.sweep.space``
  only): the swept keys with their domains (``float``/``log``: an interval, ``int``: an
  integer interval, ``choice``: the values) and as metrics the sweep's metric, then every
  train and eval value that trial's run reported. Until then, and for a
  ``search_space(trial)`` sweep, the dashboard infers it from the sessions (every key
  they set, every scalar of their runs).

The sweep writes these rather than the trials: it alone knows the space, a trial stays
an ordinary run whose command reproduces it, and the session exists from the moment the
trial starts. Each file is written whole under a temporary name, then renamed.
"""

from __future__ import annotations

import glob
import os
import threading
import time
from typing import Any

from trainer.sweep.space import Dimension

try:  # with TensorFlow, or the [tensorboard] extra; without it there is no dashboard
    from tensorboard.compat.proto import event_pb2
    from tensorboard.plugins.hparams import summary_v2
    from tensorboard.summary.writer.record_writer import RecordWriter
except ImportError:  # pragma: no cover - exercised only without tensorboard
    summary_v2 = None

SESSION, EXPERIMENT = "sweep-session", "sweep-experiment"
_SCALARS = (bool, int, float, str)


def available() -> bool:
    """Whether the ``tensorboard`` package is installed (it holds the HParams protos)."""
    return summary_v2 is not None


def _write_events(directory: str, kind: str, summary) -> None:
    """``DIRECTORY/events.out.tfevents.TIME.KIND``: the file version, then ``summary``."""
    os.makedirs(directory, exist_ok=True)
    now = time.time()
    path = os.path.join(directory, f"events.out.tfevents.{now:.6f}.{kind}")
    tmp = os.path.join(directory, f".{kind}.tmp")
    with open(tmp, "wb") as f:
        writer = RecordWriter(f)
        for event in (event_pb2.Event(wall_time=now, file_version="brain.Event:2"),
                      event_pb2.Event(wall_time=now, step=0, summary=summary)):
            writer.write(event.SerializeToString())
        writer.flush()
    os.replace(tmp, path)


def _written(directory: str, kind: str) -> bool:
    return bool(glob.glob(os.path.join(glob.escape(directory), f"*.tfevents.*.{kind}")))


def hparam_value(value: Any) -> bool | int | float | str:
    """A swept value as the dashboard holds it: a number, bool or string (else its repr)."""
    return value if isinstance(value, _SCALARS) else repr(value)


def domain(dim: Dimension):
    """The HParams domain of a dimension (None: a choice of values it cannot list)."""
    if dim.dist == "int":
        return summary_v2.IntInterval(*dim.args)
    if dim.dist in ("float", "log"):
        return summary_v2.RealInterval(*dim.args)
    kinds = {type(v) for v in dim.args}
    if len(kinds) == 1 and kinds <= set(_SCALARS):
        return summary_v2.Discrete(list(dim.args))
    return None


class HParamsView:
    """Writes the sweep's HParams sessions and experiment (see the module docstring).

    Args:
      root: the sweep's directory.
      dims: the parsed ``config.sweep.space``; None for a ``search_space(trial)`` sweep.
      metric: ``config.sweep.metric``.
    """

    def __init__(self, root: str, dims: list[Dimension] | None, metric: str):
        self.root, self.dims, self.metric = os.path.abspath(root), dims, metric
        self.lock = threading.Lock()

    def trial_starts(self, number: int, values: dict[str, Any], workdir: str,
                     resumed: bool) -> dict[str, str]:
        """Writes the trial's session into ``workdir`` unless it holds one; no env."""
        if not _written(workdir, SESSION):
            session = summary_v2.hparams_pb({k: hparam_value(v) for k, v in values.items()},
                                            trial_id=f"{number:04d}", start_time_secs=time.time())
            _write_events(workdir, SESSION, session)
        return {}

    def trial_completed(self, number: int, results: dict[str, float]) -> None:
        """The first COMPLETE trial of a ``config.sweep.space`` sweep: the experiment."""
        if self.dims is None:
            return
        with self.lock:
            if _written(self.root, EXPERIMENT):
                return
            names = [self.metric, *sorted(k for k in results if k != self.metric
                                          and k.split("/")[0] in ("train", "eval"))]
            metrics = [summary_v2.Metric(n.split("/", 1)[1], group=n.split("/", 1)[0],
                                         display_name=n) for n in names]
            hparams = [summary_v2.HParam(d.key, domain(d)) for d in self.dims]
            _write_events(self.root, EXPERIMENT,
                          summary_v2.hparams_config_pb(hparams, metrics, time.time()))

    def sweep_ends(self, code: int) -> None:
        """Nothing more to write."""
