"""A Google Cloud Storage emulator on the simulated hosts' head node, for gs:// tests.

TensorFlow's GCS filesystem has no endpoint override: it always calls
``https://www.googleapis.com`` / ``https://storage.googleapis.com``. So the emulator
(:mod:`tests.cluster.gcs_emulator`) runs in the head node's namespace on ports 443 and
80, ``netns_hosts.sh`` maps those names to the head's address in every host's
``/etc/hosts``, and clients on the hosts trust a test CA made here with ``openssl``.
With no route out of the namespaces, a request that would leave them fails at once.

Contracts:

* :meth:`GcsEmulator.start` is idempotent: it reuses an emulator already serving (one
  ``.ci/run`` started) and otherwise makes the CA (once per cluster directory), starts
  the emulator detached on the head (spared by the cluster fixtures' cleanup:
  :data:`PROCESS_NAME`) and waits until it answers. It raises :class:`GcsError` with the
  reason (the emulator's output) when it cannot.
* :meth:`GcsEmulator.client_env` is the environment a process on a host needs to use the
  emulator through TensorFlow (``CURL_CA_BUNDLE``), tensorstore/orbax
  (``TENSORSTORE_CA_BUNDLE``) and google-cloud-storage (``STORAGE_EMULATOR_HOST``,
  ``REQUESTS_CA_BUNDLE``), with ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` so no client asks a
  metadata server for credentials.
* :meth:`GcsEmulator.requests` is every request the emulator answered, in order.
* :meth:`GcsEmulator.inject` makes the next N requests whose path contains a string
  answer an error status (an outage, for the retry tests); :data:`FORBIDDEN_BUCKET`
  answers 403 to everything (a bucket the caller may not use).

``python -m tests.cluster.gcs start`` (as root, the cluster up) is what ``.ci/run`` runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.cluster.hosts import DEFAULT_DIR, SCRIPT, SimulatedCluster

PROCESS_NAME = "gcs-emulator"  # its /proc/PID/comm
BUCKET = "tfsim-bucket"  # the bucket the emulator serves (tests use prefixes of their own)
FORBIDDEN_BUCKET = "tfsim-forbidden"  # every request naming it answers 403 (no permission)
STORAGE_NAMES = ("www.googleapis.com", "storage.googleapis.com", "oauth2.googleapis.com")
START_TIMEOUT_S = 60
_PROBE = ("import socket, sys\n"
          "try:\n"
          "    socket.create_connection(('storage.googleapis.com', 443), timeout=2).close()\n"
          "except OSError as e:\n"
          "    sys.exit(str(e))\n")


class GcsError(RuntimeError):
    """The emulator could not be started or reached (message says why)."""


class GcsEmulator:
    """The emulator of ``cluster`` (files in ``cluster.root``/gcs)."""

    def __init__(self, cluster: SimulatedCluster, latency_ms: float = 0.0):
        self.cluster = cluster
        self.latency_ms = latency_ms  # added before each answer (benchmarks/checkpoints/bucket_checkpoint.py)
        self.dir = cluster.root / "gcs"
        self.ca = self.dir / "ca.pem"

    def serving(self) -> bool:
        """Whether the emulator accepts connections on 443, as seen from the first host."""
        result = subprocess.run(self.cluster.wrap(self.cluster.hosts[0], [sys.executable, "-c", _PROBE]),
                                env=self.cluster.env(), capture_output=True, text=True, timeout=60)
        return result.returncode == 0

    def start(self) -> None:
        if self.serving():
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if not (self.dir / "server.pem").exists():
            make_certificates(self.dir)
        shutil.rmtree(self.dir / "data", ignore_errors=True)
        (self.dir / "requests.jsonl").unlink(missing_ok=True)
        (self.dir / "faults.json").unlink(missing_ok=True)
        (self.dir / "latency.json").unlink(missing_ok=True)
        log = open(self.dir / "emulator.log", "w")
        emulator = Path(__file__).with_name("gcs_emulator.py")
        proc = subprocess.Popen(
            self.cluster.wrap(self.cluster.head, [sys.executable, emulator, "--dir", self.dir,
                                                  "--bucket", BUCKET,
                                                  "--forbidden_bucket", FORBIDDEN_BUCKET,
                                                  "--process-name", PROCESS_NAME,
                                                  "--latency_ms", str(self.latency_ms)]),
            env=self.cluster.env(), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while "ready" not in (self.dir / "emulator.log").read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise GcsError(f"the GCS emulator did not start on {self.cluster.head.name} "
                               f"(exit {proc.poll()}); its output:\n"
                               f"{(self.dir / 'emulator.log').read_text()[-3000:]}")
            time.sleep(0.2)
        if not self.serving():
            raise GcsError(f"the GCS emulator runs on {self.cluster.head.name} but "
                           f"storage.googleapis.com:443 is not reachable from "
                           f"{self.cluster.hosts[0].name}: is {SCRIPT.name} up with the "
                           f"storage names in /etc/netns/*/hosts?")

    def client_env(self) -> dict[str, str]:
        ca = str(self.ca)
        return {"CURL_CA_BUNDLE": ca, "TENSORSTORE_CA_BUNDLE": ca, "REQUESTS_CA_BUNDLE": ca,
                "SSL_CERT_FILE": ca,
                "STORAGE_EMULATOR_HOST": "https://storage.googleapis.com",
                "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator-token",
                "GOOGLE_CLOUD_PROJECT": "tfsim", "NO_GCE_CHECK": "True"}

    def inject(self, status: int, count: int, path_contains: str,
               methods: tuple[str, ...] | None = None) -> None:
        """The next ``count`` requests whose path, or URL-encoded object name (also a
        multipart upload's), contains ``path_contains`` (and whose method is in
        ``methods``, default any) answer ``status`` instead of being served
        (``faults.json``, read by the emulator)."""
        spec = {"id": time.time_ns(), "status": status, "count": count,
                "path_contains": path_contains, "methods": list(methods or ())}
        tmp = self.dir / "faults.json.tmp"
        tmp.write_text(json.dumps(spec))
        tmp.replace(self.dir / "faults.json")

    def set_latency(self, ms: float | None) -> None:
        """Every answer from now on comes ``ms`` later (None: back to the emulator's
        ``--latency_ms``)."""
        path = self.dir / "latency.json"
        if ms is None:
            path.unlink(missing_ok=True)
            return
        tmp = self.dir / "latency.json.tmp"
        tmp.write_text(json.dumps({"ms": ms}))
        tmp.replace(path)

    def requests(self) -> list[dict]:
        path = self.dir / "requests.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def make_certificates(directory: Path) -> None:
    """A test CA (``ca.pem``) and a server certificate for :data:`STORAGE_NAMES`."""
    san = ",".join(f"DNS:{name}" for name in STORAGE_NAMES)

    def openssl(*args: str) -> None:
        result = subprocess.run(["openssl", *args], cwd=directory, capture_output=True, text=True)
        if result.returncode != 0:
            raise GcsError(f"openssl {' '.join(args)} failed: {result.stderr.strip()}")

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-subj",
            "/CN=tfsim test CA", "-keyout", "ca.key", "-out", "ca.pem")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=storage.googleapis.com",
            "-keyout", "server.key", "-out", "server.csr")
    (directory / "san.cnf").write_text(f"subjectAltName={san}\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "3650", "-extfile", "san.cnf", "-out", "server.pem")


def main(argv: list[str]) -> None:
    if argv != ["start"]:
        sys.exit("usage: python -m tests.cluster.gcs start   (as root, the simulated hosts up)")
    cluster = SimulatedCluster(hosts=2, name=os.environ.get("CLUSTER_NAME", "tfsim"),
                               subnet=os.environ.get("CLUSTER_SUBNET", "10.213.7"),
                               root=Path(os.environ.get("CLUSTER_DIR", DEFAULT_DIR)))
    cluster.up()
    try:
        GcsEmulator(cluster).start()
    except GcsError as error:
        sys.exit(f"tests.cluster.gcs: {error}")
    print(f"[gcs] emulator serving {', '.join(STORAGE_NAMES)} on {cluster.head.name}")


if __name__ == "__main__":
    main(sys.argv[1:])
