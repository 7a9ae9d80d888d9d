"""Every host writes and reads its share of a checkpoint in a bucket (issue 63, items 1-2).

Four simulated hosts, one worker each, the launcher tests' digits config
(``tests.cluster.runs.CONFIG``: 30 steps, its model's kernels and Adam's two slots of
each are several arrays of comparable size) with ``checkpoint.fast_io`` (each array one
``.npy`` file) and the workdir in the emulated bucket:

* the 4-worker run saves step 30: the emulator's request log (who sent what) shows every
  host uploading a share of the step's bytes, the largest <= :data:`MAX_SHARE` of them
  (one host alone sent 1.0 before), and each worker's share marker under the step;
* a fresh 4-worker run restores it (``train.steps`` is 30: nothing more to train, the
  weights it writes are the restored ones): the largest share of the restore's
  downloaded bytes <= :data:`MAX_SHARE`, and the weights equal the saved ones bit for bit;
* a fresh 2-worker run restores the 4 workers' save (the shares over the current
  worker count): the weights equal the saved ones too.

Measured shares are printed (``-s``).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from tests.cluster import gcs_requests
from tests.cluster.gcs import BUCKET
from tests.cluster.runs import STEPS, fetch, finish_all, outputs, per_host
from tests.support.helpers import load_weights

MAX_SHARE = 0.40  # the bound on one host's share of a save's or a restore's bytes
FLAGS = ("--config.checkpoint.fast_io=True", "--config.checkpoint.every_steps=0")


def _step_objects(records: list[dict], prefix: str) -> list[dict]:
    """The requests of the run under ``prefix`` naming an object of its step ``STEPS``
    or listing inside it."""
    return gcs_requests.step_requests(records, f"{prefix}/checkpoints", STEPS)


def _largest_share(records: list[dict], field: str) -> tuple[float, dict[str, int]]:
    """The largest fraction of ``field`` bytes (``bytes`` sent, ``response_bytes``
    received) one client accounts for, and each client's bytes."""
    by_client = Counter()
    for record in records:
        by_client[record["client"]] += int(record.get(field) or 0)
    total = sum(by_client.values())
    assert total > 0, records
    return max(by_client.values()) / total, dict(by_client)


def _weights(cluster, gcs, prefix: str, dest) -> list[np.ndarray]:
    """The weights the last run's first worker wrote in the bucket, fetched to ``dest``."""
    fetch(cluster, gcs, prefix, dest)
    return load_weights(dest / "weights-worker-0.npz")


def test_four_hosts_save_and_restore_their_shares_and_two_hosts_restore_exactly(
        cluster, gcs, tmp_path):
    hosts = cluster.hosts[:4]
    prefix = f"shares-{cluster.ports()[0]}"
    workdir = f"gs://{BUCKET}/{prefix}"

    logged = len(gcs.requests())
    runs = per_host(cluster, hosts, 1, workdir, FLAGS, env=gcs.client_env())
    assert finish_all(runs) == [0] * 4, outputs(runs)
    saved = _step_objects(gcs.requests()[logged:], prefix)
    uploads = [r for r in saved if gcs_requests.phase(r) in ("data upload", "commit")]
    share, by_host = _largest_share(uploads, "bytes")
    print(f"\n[measured] save of step {STEPS} on 4 hosts: largest host share of the uploaded "
          f"bytes {share:.2f} (before: 1.00); bytes by host {by_host}; requests "
          f"{gcs_requests.bill(saved)}, by host {Counter(r['client'] for r in saved)}")
    assert len(by_host) == 4 and share <= MAX_SHARE, by_host
    names = fetch(cluster, gcs, prefix, tmp_path / "saved")
    markers = sorted(n for n in names if n.startswith(f"checkpoints/{STEPS}/_SHARE."))
    assert [m.split(".")[1] for m in markers] == ["1", "2", "3"], markers
    expected = load_weights(tmp_path / "saved" / "weights-worker-0.npz")

    for workers in (4, 2):
        logged = len(gcs.requests())
        runs = per_host(cluster, hosts[:workers], 1, workdir, FLAGS, env=gcs.client_env())
        assert finish_all(runs) == [0] * workers, outputs(runs)
        assert f"resumed from step {STEPS}" in runs[0].output, outputs(runs)
        read = [r for r in _step_objects(gcs.requests()[logged:], prefix)
                if gcs_requests.phase(r) == "read"]  # the objects' bytes (not listings)
        share, by_host = _largest_share(read, "response_bytes")
        print(f"[measured] restore of step {STEPS} on {workers} hosts: largest host share "
              f"of the downloaded bytes {share:.2f} (before: 1.00); bytes by host {by_host}")
        assert len(by_host) == workers and share <= max(MAX_SHARE, 1.2 / workers), by_host
        restored = _weights(cluster, gcs, prefix, tmp_path / f"restored-{workers}")
        assert len(restored) == len(expected) >= 4
        for got, want in zip(restored, expected):
            np.testing.assert_array_equal(got, want)
