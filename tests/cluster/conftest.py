"""Fixtures for tests on simulated hosts (see tests/cluster/README.md).

``simulated_cluster`` (session): :data:`HOSTS` hosts + a head node, up for the whole
session, torn down at its end (no namespace, interface or process left).
``cluster`` (per test): the same object; after the test every host is healed and every
process the test left on the hosts is killed (except the session's daemons).
``slurm_cluster`` (session) / ``multinode_slurm`` (per test): a Slurm cluster with one
slurmd per host (tests/cluster/slurm.py); before and after each test no job is left,
every daemon runs and every node is usable.

Without root or network namespaces these fixtures skip with the reason; under
``CI=true`` they fail instead: CI must run these tests.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from tests.cluster.hosts import ClusterError, SimulatedCluster, cluster_problem
from tests.cluster.slurm import SLURM_DAEMONS, SlurmCluster, SlurmError

HOSTS = 2  # hosts of the session's cluster (plus the head node)


def unavailable(message: str) -> None:
    """Skips the test with ``message``; fails it under CI=true (CI must run it)."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message}\nCI=true: the simulated-host tests must run, not skip.")
    pytest.skip(message)


@pytest.fixture(scope="session")
def simulated_cluster() -> Iterator[SimulatedCluster]:
    problem = cluster_problem()
    if problem:
        unavailable(f"no simulated hosts: {problem}")
    cluster = SimulatedCluster(hosts=HOSTS)
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
