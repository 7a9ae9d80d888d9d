"""A Slurm cluster on the simulated hosts, for tests: submit, watch, cancel, lose nodes.

``tests/slurm/start_multinode_slurm.sh`` owns the cluster (slurmctld on the head node,
one slurmd per host, NodeName = host name; its header lists the timeouts). Slurm's
commands run on the head node (the login node) with ``SLURM_CONF`` set; jobs run on the
hosts with the node-local HOME / TFDS_DATA_DIR / TMPDIR of the host they land on.

Contracts: :meth:`SlurmCluster.submit` returns a :class:`Job` whose output file is in
the directory it was submitted from (a shared one: the batch script runs on a host);
every wait has a timeout and fails naming the job's state and the end of its output;
:meth:`SlurmCluster.cleanup` (the per-test fixture calls it) cancels every job and
brings every node back to idle.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Iterable, Mapping

from tests.cluster.hosts import ClusterError, Host, SimulatedCluster
from tests.support.helpers import REPO

START_SCRIPT = REPO / "tests" / "slurm" / "start_multinode_slurm.sh"
# Programs that stay up for the whole session (SimulatedCluster.cleanup spares them).
SLURM_DAEMONS = frozenset({"slurmctld", "slurmscriptd", "slurmd"})
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                          "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"})
USABLE_NODE_STATES = frozenset({"idle", "mixed", "allocated", "completing"})


class SlurmError(RuntimeError):
    """The multi-node Slurm could not be started or answered with an error."""


def base_state(state: str) -> str:
    """A node state without sinfo's suffixes: ``down*`` -> ``down``, ``idle~`` -> ``idle``."""
    return state.rstrip("*~#!%$@^-").split("+")[0].lower()


class Job:
    """A submitted batch job. ``output`` is its stdout+stderr file (``job-<id>.out``)."""

    def __init__(self, slurm: "SlurmCluster", job_id: str, directory: Path):
        self.slurm = slurm
        self.id = job_id
        self.dir = directory
        self.output_path = directory / f"job-{job_id}.out"

    def output(self) -> str:
        """The job's output so far ("" before it starts; a requeued run rewrites it)."""
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""

    def state(self) -> dict[str, str]:
        """``scontrol show job`` as a dict: JobState, Restarts, ExitCode, NodeList, ..."""
        out = self.slurm.command("scontrol", "show", "job", "-o", self.id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def _fail(self, message: str):
        state = self.state()
        self.cancel()
        raise AssertionError(f"job {self.id}: {message}; state {state}; output:\n"
                             f"{self.output()[-6000:]}")

    def wait(self, states: Iterable[str] = FINAL_STATES, timeout: float = 300) -> dict[str, str]:
        """Waits until JobState is one of ``states`` (default: any final state); returns
        the job's state. Fails (and cancels the job) after ``timeout`` s."""
        wanted = set(states)
        deadline = time.monotonic() + timeout
        while (state := self.state())["JobState"] not in wanted:
            if time.monotonic() > deadline:
                self._fail(f"still {state['JobState']} after {timeout} s (waited for {sorted(wanted)})")
            time.sleep(0.3)
        return state

    def wait_for_output(self, pattern: str, timeout: float = 300) -> re.Match:
        """Waits for a line of the output matching ``pattern``; fails if the job ends
        (any final state) or ``timeout`` s pass first."""
        regex = re.compile(pattern, re.M)
        deadline = time.monotonic() + timeout
        while not (match := regex.search(self.output())):
            state = self.state()["JobState"]
            if state in FINAL_STATES or time.monotonic() > deadline:
                self._fail(f"no output line matching {pattern!r} (job {state})")
            time.sleep(0.3)
        return match

    def nodes(self) -> list[str]:
        """The nodes of the job's current (or last) allocation."""
        node_list = self.state().get("NodeList", "")
        if node_list in ("", "(null)"):
            return []
        return self.slurm.command("scontrol", "show", "hostnames", node_list).stdout.split()

    def cancel(self, signal: str | None = None, batch: bool = False) -> None:
        """``scancel`` (with ``--signal=SIGNAL`` and ``--batch`` when given: a signal to
        the batch script only, the job keeps running unless the script exits)."""
        args = ["scancel", *([f"--signal={signal}"] if signal else []),
                *(["--batch"] if batch else []), self.id]
        self.slurm.command(*args)


NODES = 2  # the Slurm nodes: the first NODES hosts (start_multinode_slurm.sh's SLURM_NODES)


class SlurmCluster:
    """The multi-node Slurm of ``cluster``'s first :data:`NODES` hosts (one node per host,
    not the head; the other hosts stay outside Slurm)."""

    def __init__(self, cluster: SimulatedCluster):
        self.cluster = cluster
        self.conf = cluster.root / "slurm" / "slurm.conf"
        self.logs = cluster.root / "slurm" / "log"
        self._jobs = 0

    @property
    def nodes(self) -> list[str]:
        return [host.name for host in self.cluster.hosts[:NODES]]

    def _start_script(self, *args: str) -> None:
        result = subprocess.run([str(START_SCRIPT), *args], env=self.cluster.env(), text=True,
                                capture_output=True, timeout=120)
        if result.returncode != 0:
            raise SlurmError(f"{START_SCRIPT.name} {' '.join(args)} failed (exit "
                             f"{result.returncode}): {(result.stderr or result.stdout).strip()}")

    def start(self) -> None:
        """Starts slurmctld and every missing slurmd (idempotent); waits for idle nodes."""
        self._start_script()

    def stop(self) -> None:
        """Stops every daemon of this cluster (``netns_hosts.sh down`` also does)."""
        self._start_script("--stop")

    def command(self, *argv: str, timeout: float = 60, check: bool = True,
                env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Runs a Slurm command (``sbatch``, ``squeue``...) on the head node."""
        try:
            return self.cluster.run(self.cluster.head, argv, timeout=timeout, check=check,
                                    env={"SLURM_CONF": str(self.conf), **(env or {})})
        except ClusterError as error:
            raise SlurmError(str(error)) from error

    def submit(self, script: str | Path, *sbatch_args: str, directory: Path,
               env: Mapping[str, str] | None = None) -> Job:
        """``sbatch`` of ``script`` (its text, or a file) from ``directory`` (shared:
        the job runs there) with ``sbatch_args`` and ``env`` added to the environment
        the job inherits (the harness's: PYTHONPATH = the repository, this Python).
        The output goes to :attr:`Job.output_path` (do not pass ``--output``)."""
        if isinstance(script, str):
            self._jobs += 1
            path = directory / f"script-{self._jobs}.sh"
            path.write_text(script)
            script = path
        result = self.command("sbatch", "--parsable", f"--chdir={directory}",
                              f"--output={directory}/job-%j.out", *sbatch_args, str(script),
                              env=env)
        return Job(self, result.stdout.strip().split(";")[0], directory)

    def node_state(self, node: str | Host) -> str:
        """The node's state without suffixes: ``idle``, ``allocated``, ``down``, ..."""
        out = self.command("sinfo", "-h", "-N", "-n", str(node), "-o", "%T").stdout.split()
        if not out:
            raise SlurmError(f"sinfo knows no node {node}; nodes: {self.nodes}")
        return base_state(out[0])

    def wait_node_state(self, node: str | Host, states: Iterable[str], timeout: float = 60) -> float:
        """Waits until ``node``'s state is one of ``states``; returns the seconds waited.
        Fails naming the state after ``timeout`` s."""
        wanted = set(states)
        start = time.monotonic()
        while (state := self.node_state(node)) not in wanted:
            if time.monotonic() - start > timeout:
                raise AssertionError(f"node {node} is {state}, not {sorted(wanted)}, after "
                                     f"{timeout} s; see {self.logs}")
            time.sleep(0.2)
        return time.monotonic() - start

    def cleanup(self) -> None:
        """Heals every host, cancels every job, restarts any daemon that is gone (a host
        killed by a test) and waits until every node is usable again."""
        for host in self.cluster.all_hosts:
            self.cluster.heal(host)
        self.command("scancel", "--full", "--user=root", check=False)
        deadline = time.monotonic() + 60
        while self.command("squeue", "-h", "-o", "%i", check=False).stdout.strip():
            if time.monotonic() > deadline:
                raise SlurmError("jobs still in the queue 60 s after scancel: "
                                 + self.command("squeue", check=False).stdout)
            time.sleep(0.3)
        self.start()
        for node in self.nodes:
            if self.node_state(node) not in USABLE_NODE_STATES:
                self.command("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
            self.wait_node_state(node, USABLE_NODE_STATES)
