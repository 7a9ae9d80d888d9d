"""Fixtures for tests on simulated hosts (see tests/cluster/README.md).

``simulated_cluster`` (session): :data:`HOSTS` hosts + a head node, up for the whole
session, torn down at its end (no namespace, interface or process left).
``cluster`` (per test): the same object; after the test every host is healed and every
process the test left on the hosts is killed (except the session's daemons).
``slurm_cluster`` (session) / ``multinode_slurm`` (per test): a Slurm cluster with one
slurmd per host (tests/cluster/slurm.py); before and after each test no job is left,
every daemon runs and every node is usable.
``gcs`` (session): a Google Cloud Storage emulator on the head node serving the real
storage host names to every host (tests/cluster/gcs.py); ``gcs.client_env()`` is what a
process on a host needs to use gs://.

Without root or network namespaces these fixtures skip with the reason; under
``CI=true`` they fail instead: CI must run these tests. CLUSTER_NAME, CLUSTER_SUBNET and
CLUSTER_DIR (as for netns_hosts.sh) give a session a cluster of its own; two sessions on
the same one run one after the other (a lock in CLUSTER_DIR).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.cluster.gcs import PROCESS_NAME as GCS_PROCESS, GcsEmulator, GcsError
from tests.cluster.hosts import (DEFAULT_DIR, DEFAULT_NAME, DEFAULT_SUBNET, ClusterError,
                                 SimulatedCluster, cluster_problem)
from tests.cluster.slurm import SLURM_DAEMONS, SlurmCluster, SlurmError

HOSTS = 4  # hosts of the session's cluster (plus the head node)
LOCK_WAIT_S = 1800  # how long a second session on the same cluster waits for the first


def unavailable(message: str) -> None:
    """Skips the test with ``message``; fails it under CI=true (CI must run it)."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message}\nCI=true: the simulated-host tests must run, not skip.")
    pytest.skip(message)


@contextlib.contextmanager
def one_session_at_a_time(root: Path, timeout: float = LOCK_WAIT_S) -> Iterator[None]:
    """Holds ``root``/session.lock: a second pytest session on the same cluster waits
    (its teardown would destroy the first one's hosts), then fails after ``timeout``."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "session.lock", "w") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"another pytest session has used the simulated cluster in {root} "
                                f"for over {timeout:.0f} s; wait for it, or give this session its "
                                f"own cluster: CLUSTER_NAME=tfsimb CLUSTER_SUBNET=10.213.9 "
                                f"CLUSTER_DIR=/tmp/tfsimb-cluster pytest ...")
                time.sleep(1)
        yield


@pytest.fixture(scope="session")
def simulated_cluster() -> Iterator[SimulatedCluster]:
    problem = cluster_problem()
    if problem:
        unavailable(f"no simulated hosts: {problem}")
    cluster = SimulatedCluster(hosts=HOSTS, name=os.environ.get("CLUSTER_NAME", DEFAULT_NAME),
                               subnet=os.environ.get("CLUSTER_SUBNET", DEFAULT_SUBNET),
                               root=Path(os.environ.get("CLUSTER_DIR", DEFAULT_DIR)))
    with one_session_at_a_time(cluster.root):
        try:
            cluster.up()
        except ClusterError as error:
            unavailable(f"no simulated hosts: {error}")
        yield cluster
        cluster.down()


@pytest.fixture
def cluster(simulated_cluster: SimulatedCluster) -> Iterator[SimulatedCluster]:
    yield simulated_cluster
    simulated_cluster.cleanup()


@pytest.fixture(scope="session")
def slurm_cluster(simulated_cluster: SimulatedCluster) -> Iterator[SlurmCluster]:
    slurm = SlurmCluster(simulated_cluster)
    try:
        slurm.start()
    except SlurmError as error:
        unavailable(f"no multi-node Slurm on the simulated hosts: {error}")
    simulated_cluster.daemons.update(SLURM_DAEMONS)
    yield slurm
    simulated_cluster.daemons.difference_update(SLURM_DAEMONS)
    slurm.stop()


@pytest.fixture
def multinode_slurm(slurm_cluster: SlurmCluster, cluster: SimulatedCluster) -> Iterator[SlurmCluster]:
    slurm_cluster.cleanup()  # an earlier test may have killed a host's slurmd
    yield slurm_cluster
    slurm_cluster.cleanup()


@pytest.fixture(scope="session")
def gcs(simulated_cluster: SimulatedCluster) -> Iterator[GcsEmulator]:
    emulator = GcsEmulator(simulated_cluster)
    try:
        emulator.start()
    except GcsError as error:
        unavailable(f"no GCS emulator on the simulated hosts: {error}")
    simulated_cluster.daemons.add(GCS_PROCESS)
    yield emulator
    simulated_cluster.daemons.discard(GCS_PROCESS)
