"""A chaos run: one training run into a bucket, hit by faults and restarted after each.

The launcher tests' digits run (:data:`CONFIG`, input slowed to :data:`STEP_S` a
batch so faults land mid-run) trains into ``gs://`` on a simulated host; each attempt
ends in one fault, then the same command starts again (as a launcher or Slurm would).
Fault kinds:

* ``sigterm_stalled_upload``: the host is cut off from the bucket right after a save is
  issued; once the next save is skipped (the upload still stalled), SIGTERM; the bucket
  comes back 3 s later. The attempt must save its step and exit 143.
* ``sigkill``: the process is killed mid-run (a lost VM): what was not saved is lost.
* ``corrupt_newest``: after the attempt ends by SIGTERM, one byte of the newest
  checkpoint's largest file is flipped in the bucket: the next attempt falls back.
* ``bucket_errors``: 503 answers to the attempt's first checkpoint writes (retried).

The last attempt (:data:`LAST`, ``sigkill_worker``) is a group of two workers started
by ``launch.multiworker --max_restarts 1``; one worker is killed mid-run (a lost VM of
the group): the launcher stops the other and restarts the group from the last
checkpoint (on another worker count than the attempts before), which runs to the end.

:func:`goodput` is productive training time over wall time (as Google's ML goodput
defines it), as the run's own goodput record says (``workdir/goodput.json``, kept by
the chief: :mod:`trainer.telemetry.goodput`): overall, and per fault kind the
productive time of the attempts the fault ended (less the steps the next attempt redid)
over their wall time from process start to the next attempt's start.

Used by tests/cluster/test_chaos_run.py (a short campaign) and benchmarks/checkpoints/chaos_run.py
(a longer one).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import signal
import time
from pathlib import Path

from tests.cluster.gcs import BUCKET, GcsEmulator
from tests.cluster.hosts import Host, SimulatedCluster
from tests.cluster.runs import CONFIG, RUN_S, bucket_url, start, trainer_argv
from tests.launch_helpers.running import task_pids
from trainer.telemetry import goodput_record

STEP_S = 0.1  # input sleep per batch: 10 steps/s
KINDS = ("sigterm_stalled_upload", "sigkill", "corrupt_newest", "bucket_errors")
LAST = "sigkill_worker"
# The launcher of the group of sigkill_worker: a restart after the lost worker; the
# stopped survivor (TensorFlow's coordination service catches its SIGTERM) is killed 2 s on.
GROUP = ["python", "-m", "launch.multiworker", "--workers", "2", "--max_restarts", "1",
         "--grace_s", "2"]

_DELETE = ("import sys\nfrom google.cloud import storage\n"
           "b = storage.Client().bucket(sys.argv[1])\n"
           "for blob in b.list_blobs(prefix=sys.argv[2]):\n    blob.delete()\n")
_CORRUPT = ("import re, sys\nfrom google.cloud import storage\n"
            "b = storage.Client().bucket(sys.argv[1])\n"
            "blobs = [x for x in b.list_blobs(prefix=sys.argv[2] + '/checkpoints/')\n"
            "         if re.search(r'/checkpoints/\\d+/state/', x.name)]\n"
            "step = max(int(x.name.split('/checkpoints/')[1].split('/')[0]) for x in blobs)\n"
            "blob = max((x for x in blobs if f'/checkpoints/{step}/' in x.name and\n"
            "            not x.name.endswith('.json')), key=lambda x: x.size)\n"
            "data = bytearray(blob.download_as_bytes())\n"
            "data[len(data) // 2] ^= 1\n"
            "b.blob(blob.name).upload_from_string(bytes(data))\n"
            "print(step, blob.name)\n")


@dataclasses.dataclass
class Attempt:
    """One process of the campaign: the fault that ended it, the step it resumed
    from, its exit status and wall seconds."""

    fault: str
    resumed: int
    status: int
    wall_s: float
    output: str


def flags(steps: int, every: int = 10) -> list[str]:
    return [f"--config.train.steps={steps}", "--config.train.steps_per_loop=5",
            "--config.train.log_every_steps=5", f"--config.checkpoint.every_steps={every}",
            "--config.telemetry.probe_every_windows=0", "--config.checkpoint.lease_s=10"]


def wait_for_step(run, steps: int, target: int) -> None:
    """Waits until ``run`` printed the progress line of a step >= ``target``."""
    deadline = time.monotonic() + RUN_S
    while True:
        found = [int(s) for s in re.findall(rf"^step (\d+)/{steps}", run.output, re.M)]
        if found and found[-1] >= target:
            return
        assert run.proc.poll() is None and time.monotonic() < deadline, run.output[-3000:]
        time.sleep(0.05)


def wait_for_count(run, pattern: str, count: int) -> None:
    """Waits until ``run`` printed ``count`` lines matching ``pattern``."""
    deadline = time.monotonic() + RUN_S
    while len(re.findall(pattern, run.output, re.M)) < count:
        assert run.proc.poll() is None and time.monotonic() < deadline, run.output[-3000:]
        time.sleep(0.05)


def resumed_from(output: str) -> int:
    found = re.search(r"resumed from step (\d+) \(", output)
    return int(found.group(1)) if found else 0


class Campaign:
    """The attempts of one chaos run on ``host`` into ``gs://BUCKET/prefix``."""

    def __init__(self, cluster: SimulatedCluster, gcs: GcsEmulator, host: Host, prefix: str,
                 steps: int, seed: int = 0, every: int = 10):
        self.cluster, self.gcs, self.host, self.prefix = cluster, gcs, host, prefix
        self.steps, self.rng = steps, random.Random(seed)
        self.argv = trainer_argv(bucket_url(prefix), *flags(steps, every), config=CONFIG)
        self.attempts: list[Attempt] = []

    def _script(self, script: str, *args: str) -> str:
        return self.cluster.run(self.host, ["python", "-c", script, BUCKET, *args],
                                env=self.gcs.client_env(), timeout=120).stdout

    def attempt(self, fault: str) -> Attempt:
        """Runs the command once, ending it by ``fault`` (one of :data:`KINDS`; the group
        of :data:`LAST` runs to the end after its launcher's restart)."""
        self._script(_DELETE, f"{self.prefix}/slow-")  # every attempt is slowed alike
        if fault == "bucket_errors":
            self.gcs.inject(503, count=4, path_contains=f"{self.prefix}%2Fcheckpoints%2F")
        started = time.monotonic()
        argv = [*GROUP, *self.argv[3:]] if fault == LAST else self.argv
        run = start(self.cluster, self.gcs, self.host, argv,
                    env={"LAUNCH_TEST_SLOW_FROM": f"0:{STEP_S}"})
        if fault == "sigterm_stalled_upload":
            run.wait_for(r"checkpoint of step \d+ -> .*\(async\)", RUN_S)
            self.cluster.partition(self.host)
            try:
                run.wait_for(r"checkpoint of step \d+ skipped", RUN_S)
                run.proc.send_signal(signal.SIGTERM)
                time.sleep(3)
            finally:
                self.cluster.heal(self.host)
        elif fault == LAST:
            # A group's saves are slow (seconds in the bucket): once a second save after
            # the resume is issued, the first is committed (a save is skipped while the
            # one before is in flight), so the restart has a newer checkpoint to resume.
            wait_for_count(run, r"^\[worker:0\] .*checkpoint of step \d+ -> .*\(async\)", 2)
            os.kill(task_pids(run.lines)["worker:1"], signal.SIGKILL)  # same PID namespace
        elif fault in ("sigkill", "corrupt_newest", "bucket_errors"):
            run.wait_for(rf"^step \d+/{self.steps}", RUN_S)  # started: its resume printed
            wait_for_step(run, self.steps, resumed_from(run.output) + self.rng.randrange(15, 30))
            if fault == "sigkill":
                run.proc.kill()
            else:
                run.proc.send_signal(signal.SIGTERM)
        status = run.finish(RUN_S)
        self.gcs.inject(503, count=0, path_contains=self.prefix)  # a burst left over ends
        if fault == "corrupt_newest":
            self._script(_CORRUPT, self.prefix)
        attempt = Attempt(fault, resumed_from(run.output), status,
                          time.monotonic() - started, run.output)
        self.attempts.append(attempt)
        return attempt

    def run(self, faults: list[str]) -> list[Attempt]:
        """One attempt per fault of :data:`KINDS`, then the group of :data:`LAST` (it
        ends the run, its final weights in ``weights-worker-0.npz``)."""
        for fault in [*faults, LAST]:
            self.attempt(fault)
        return self.attempts


def goodput(workdir: Path, attempts: list[Attempt]) -> dict[str, float]:
    """The goodput the run's own record says (``workdir/goodput.json`` of the fetched
    run: :mod:`trainer.telemetry.goodput`), overall and per fault kind (see the module
    doc). Checks that the record has one entry per process of the chief (the group of
    :data:`LAST` has two: before and after its launcher's restart), each resumed from
    the step the campaign saw."""
    record = goodput_record.RecordFile(str(workdir)).read()
    kinds = [a.fault for a in attempts] + [LAST]
    assert [r["restored_step"] for r in record[:len(attempts)]] == [
        a.resumed for a in attempts] and len(record) == len(kinds), record
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for i, (kind, entry) in enumerate(zip(kinds, record)):
        after = record[i + 1] if i + 1 < len(record) else None
        redone = after["wasted_s"] - after["wasted_input_s"] if after else 0.0
        productive = entry["seconds"]["productive"] - redone
        wall = entry["last_time"] - entry["start"] + (after["recovery_s"] if after else 0.0)
        by_kind.setdefault(kind, []).append((productive, wall))
    out = {kind: sum(p for p, _ in rows) / sum(w for _, w in rows)
           for kind, rows in by_kind.items()}
    out["overall"] = goodput_record.summary(record)["goodput"]
    return out
