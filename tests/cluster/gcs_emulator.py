"""The tests' Google Cloud Storage: ``gcp-storage-emulator`` served as the real host names.

Run on the head node by :mod:`tests.cluster.gcs` (never by hand needed)::

    python tests/cluster/gcs_emulator.py --dir DIR --bucket NAME [--bucket NAME ...]
        [--forbidden_bucket NAME ...] [--latency_ms MS] [--process-name NAME]

serves the JSON/upload API on ``0.0.0.0:443`` (TLS, ``DIR/server.pem`` + ``DIR/server.key``
signed by the test CA ``DIR/ca.pem``) and ``0.0.0.0:80`` (plain), keeps the objects in
memory (for the emulator's life: the test session), creates the named buckets and
prints ``ready`` on stdout once both ports accept. ``--process-name`` sets its
``comm``, so the cluster fixtures can tell it from the trainers and spare it between
tests.

What it adds for the tests:

* **a request log**: one JSON line per answer in ``DIR/requests.jsonl``:
  ``{"client", "port", "method", "path", "object", "status", "t", "end", "read_s",
  "wait_s", "handle_s", "bytes", "response_bytes"}`` (``object`` the object named, also
  a multipart upload's; ``t`` and ``end`` the wall-clock start and answer; seconds
  reading the body, waiting for the API lock, and handling; the request body's size
  and the answer body's, its ``Content-Length``: what a download received);
* **latency**: ``--latency_ms`` is slept before each answer, outside the lock (a slow
  link's round trip, for ``benchmarks/checkpoints/bucket_checkpoint.py``); ``DIR/latency.json``
  (``{"ms": N}``, written by :meth:`tests.cluster.gcs.GcsEmulator.set_latency`)
  changes it while the emulator runs;
* **a forbidden bucket**: every request naming a ``--forbidden_bucket`` answers ``403``
  with the error GCS gives a caller without permission;
* **injected outages**: ``DIR/faults.json`` (``{"id", "status", "count",
  "path_contains", "methods"}``, written by :meth:`tests.cluster.gcs.GcsEmulator.inject`)
  makes the next ``count`` requests (of ``methods``, default any) whose path or
  URL-encoded object name contains ``path_contains`` answer ``status`` (e.g. 503)
  instead of being served; the file is re-read when it changes, a new ``id``
  restarts the count.

Why ``gcp-storage-emulator`` (pure Python, PyPI) and not ``fake-gcs-server``: the
latter answers TensorFlow's resumable-upload initiation with ``501 Unsupported transfer
encoding``, a fault in the server that no wrapper of ours can mend (its binary), while
the former's faults are mended here in test code (each seen with a real client):

* it builds resumable-upload ``Location`` URLs as ``http://HOST...`` whatever scheme the
  request came on: the TLS port rewrites them to ``https://`` (and port 80 serves the
  ``mediaLink``/``selfLink`` URLs it writes into object resources);
* TensorFlow uploads with ``Transfer-Encoding: chunked`` *and* a ``Content-Length``;
  the emulator reads Content-Length bytes of the chunked stream (the object would hold
  the chunk framing). Here every body is read by :func:`read_body` (chunked wins, as
  RFC 9112 6.3 says) and handed to the emulator with its true length;
* an empty media upload (the ``dir/`` marker ``tf.io.gfile.makedirs`` writes) crashes
  its upload handler (``len(None)``): :class:`_Request` hands it ``b""``; TensorFlow's
  compose request (``GCS_APPEND_MODE=compose``) is a Python literal in single quotes,
  which GCS takes and the emulator's JSON parser does not: it is read as a literal (and
  its optional ``destination`` defaulted);
* it has no ``storageLayout`` (GCS's bucket layout, which TensorFlow asks for before
  renaming a directory, e.g. TFDS's ``incomplete.*`` directory when it prepares a
  dataset in a bucket): :func:`_storage_layout` answers a flat bucket;
* its disk store maps the object ``a/`` and the objects ``a/b`` onto one path, a file
  and a directory at once, and fails: objects are kept in memory;
* it dumps all its metadata as indented JSON after every write (:class:`_Storage` does
  not): with thousands of objects that made a 100-step digits run 49 s instead of 18 s;
* it ignores generation preconditions, which tensorstore (orbax's arrays and OCDBT
  manifests) and TensorFlow (``ifGenerationMatch=0`` on directory markers) rely on:
  :func:`precondition_failure` answers ``ifGenerationMatch`` / ``ifGenerationNotMatch``
  with 412 (or 304 for a read), as GCS does, and media reads carry
  ``x-goog-generation``;
* its server is one thread speaking HTTP/1.0 (a slow client stalls all, every request a
  new TLS handshake) and its object store is not thread-safe: here every connection has
  a thread and HTTP/1.1 keep-alive; the TLS handshake and the request body are read in
  that thread *outside* the lock (a client cut off mid-upload stalls only its own
  connection, until the socket timeout), and only the API call itself is serialized.

Nothing is patched inside the package: the wrapper subclasses its request handler and
storage, and reuses its handlers and bucket creation.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import email.message
import io
import json
import os
import re
import ssl
import sys
import threading
import time
import traceback
import urllib.parse
from http import HTTPStatus, server
from pathlib import Path
from urllib.parse import unquote

from gcp_storage_emulator import server as emulator
from gcp_storage_emulator.handlers import buckets
from gcp_storage_emulator.storage import Storage

_API_LOCK = threading.Lock()  # the emulator's Storage is not thread-safe
_LOG_LOCK = threading.Lock()
SOCKET_TIMEOUT_S = 60  # a silent client (cut off) frees its connection's thread after this
_BUCKET_IN_PATH = re.compile(r"^(?:/upload|/download)?(?:/storage/v1)?/b/([-.\w]+)|^/([-.\w]+)/")
_DOWNLOAD_ROUTES = ("objects.download", "objects.get")
_STORAGE_LAYOUT = re.compile(r"/storage/v1/b/([-.\w]+)/storageLayout")


class _Storage(Storage):
    """The emulator's in-memory store without its metadata dump after each write."""

    def _write_config_to_file(self) -> None:
        pass  # nothing reads it back: the objects live as long as this process


class _Body:
    """What the emulator's body parser reads from: the body already read, its length."""

    def __init__(self, headers, raw: bytes):
        self.headers = email.message.Message()  # case-insensitive, as the request's
        for key, value in headers.items():
            if key.lower() not in ("transfer-encoding", "content-length"):
                self.headers[key] = value
        self.headers["Content-Length"] = str(len(raw))
        self.rfile = io.BytesIO(raw)


class _Request(emulator.Request):
    """The emulator's request over a body read beforehand (:func:`read_body`); an empty
    media upload has ``b""`` for data, not the emulator's ``None``."""

    def __init__(self, handler, method: str, raw: bytes):
        super().__init__(handler, method)
        self._body = _Body(handler.headers, raw)

    @property
    def data(self):
        if self._data is emulator._UNSET:
            try:
                self._data = emulator._read_data(self._body, self._query)
            except ValueError:
                if not self.path.endswith("/compose"):
                    raise
                # TensorFlow's compose body (GCS_APPEND_MODE=compose) is a Python literal
                # ('single quotes'), which GCS accepts and JSON does not.
                self._data = ast.literal_eval(self._body.rfile.getvalue().decode())
            if self.path.endswith("/compose"):
                self._data.setdefault("destination", {})  # optional in GCS, not here
        if self._data is None and self.query.get("uploadType") == ["media"]:
            return b""
        return self._data


def read_body(rfile, headers) -> bytes:
    """The request's body from ``rfile``: the chunks of a ``Transfer-Encoding: chunked``
    body (its trailers consumed, any ``Content-Length`` ignored), else
    ``Content-Length`` bytes, else nothing (an HTTP/1.1 request without either has no
    body). Raises ``ConnectionError`` when the client stops before the end."""
    if "chunked" in headers.get("Transfer-Encoding", "").lower():
        chunks = []
        while True:
            line = rfile.readline()
            if not line:
                raise ConnectionError("the client closed the connection mid-body")
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(chunks)
            chunks.append(rfile.read(size))
            rfile.readline()
    length = int(headers.get("Content-Length") or 0)
    raw = rfile.read(length) if length else b""
    if len(raw) != length:
        raise ConnectionError(f"the client sent {len(raw)} of {length} bytes")
    return raw


def precondition_failure(method: str, query: dict, generation: int | None) -> HTTPStatus | None:
    """The answer GCS gives when a request's generation precondition fails, or None.

    ``generation`` is the object's current generation (None: no such object, which
    ``ifGenerationMatch=0`` requires). ``ifGenerationMatch=G``: 412 unless the object's
    generation is G; ``ifGenerationNotMatch=G``: a read of generation G is ``304 Not
    Modified`` (the caller's copy is current), a write 412. A read of a missing object
    is left to the handler (404)."""
    if generation is None and method == emulator.GET:
        return None
    current = generation or 0
    match = query.get("ifGenerationMatch")
    if match and int(match[0]) != current:
        return HTTPStatus.PRECONDITION_FAILED
    not_match = query.get("ifGenerationNotMatch")
    if not_match and int(not_match[0]) == current:
        return HTTPStatus.NOT_MODIFIED if method == emulator.GET else HTTPStatus.PRECONDITION_FAILED
    return None


class _Faults:
    """The outage of ``DIR/faults.json`` (see the module docstring), re-read on change."""

    def __init__(self, path: Path):
        self.path = path
        self.mtime = None
        self.spec: dict = {}
        self.left = 0

    def status_for(self, path: str, name: str | None = None, method: str = "GET"
                   ) -> int | None:
        """The status to answer instead of serving ``path`` (counted), or None.
        ``name``: the object the request names (matched URL-encoded as well)."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return None
        if mtime != self.mtime:
            self.mtime = mtime
            spec = json.loads(self.path.read_text() or "{}")
            if spec.get("id") != self.spec.get("id"):
                self.left = int(spec.get("count", 0))
            self.spec = spec
        where = path + " " + urllib.parse.quote(name or "", safe="")
        methods = self.spec.get("methods") or [method]
        if self.left > 0 and self.spec.get("path_contains", "") in where and method in methods:
            self.left -= 1
            return int(self.spec.get("status", 503))
        return None


class _Latency:
    """The delay before each answer: ``--latency_ms``, or ``{"ms": N}`` of
    ``DIR/latency.json`` while that file exists (re-read on change)."""

    def __init__(self, path: Path, default_s: float):
        self.path, self.default_s = path, default_s
        self.mtime, self.value_s = None, default_s

    def seconds(self) -> float:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return self.default_s
        if mtime != self.mtime:
            self.mtime = mtime
            self.value_s = float(json.loads(self.path.read_text() or "{}").get("ms", 0)) / 1e3
        return self.value_s


_UPLOAD_NAME = re.compile(rb'"name"\s*:\s*"([^"]+)"')


def object_of(path: str, raw: bytes = b"") -> str | None:
    """The object a request names: in its path (``/o/NAME``, ``/b/B/NAME`` for media
    links), in its query (``name=``), or in the metadata part of a multipart upload."""
    parsed = urllib.parse.urlsplit(path)
    query = urllib.parse.parse_qs(parsed.query)
    if "name" in query:
        return query["name"][0]
    match = re.search(r"/o/([^/?]+)", parsed.path)
    if match:
        return urllib.parse.unquote(match.group(1))
    if query.get("uploadType") == ["multipart"]:
        found = _UPLOAD_NAME.search(raw[:4096])
        return found.group(1).decode() if found else None
    return None


class _Handler(emulator.RequestHandler):
    """The emulator's routing (its ``HANDLERS`` table, its ``Response``) behind the
    mends of the module docstring; a handler that raises answers 500 instead of closing
    the connection without an answer."""

    tls = False
    log_file = None
    latency: _Latency | None = None
    forbidden: frozenset = frozenset()
    faults: _Faults | None = None
    protocol_version = "HTTP/1.1"  # keep-alive: one TLS handshake per connection
    timeout = SOCKET_TIMEOUT_S

    def _route(self, method: str) -> None:
        started = time.time()
        self._timing, self._in_route = {"t": round(started, 3)}, True
        try:
            raw = read_body(self.rfile, self.headers)
        except (ConnectionError, OSError, ValueError) as error:
            sys.stderr.write(f"{self.client_address[0]} {self.command} {self.path}: {error}\n")
            self.close_connection, self._in_route = True, False
            return
        self._timing.update(read_s=round(time.time() - started, 4), bytes=len(raw),
                            object=object_of(self.path, raw), t=round(started, 4))
        time.sleep(self.latency.seconds() if self.latency else 0.0)  # a round trip (no lock)
        method = self.headers.get("x-http-method-override") or method
        waited = time.time()
        with _API_LOCK:
            handling = time.time()
            self._timing["wait_s"] = round(handling - waited, 4)
            self._answer(method, raw)
            self._timing["handle_s"] = round(time.time() - handling, 4)
        self._write_log()
        self._in_route = False

    def _answer(self, method: str, raw: bytes) -> None:
        request, response = _Request(self, method, raw), emulator.Response(self)
        bucket = _bucket_of(request.path)
        injected = (self.faults.status_for(self.path, self._timing.get("object"), method)
                    if self.faults else None)
        if injected:
            return _error(response, HTTPStatus(injected), "injected by the test (faults.json)")
        if bucket in self.forbidden:
            return _error(response, HTTPStatus.FORBIDDEN,
                          f"tfsim-tester@tfsim.iam.gserviceaccount.com does not have "
                          f"storage.objects.get access to the Google Cloud Storage bucket "
                          f"{bucket}. Permission 'storage.objects.get' denied on resource "
                          f"(or it may not exist).")
        layout = _STORAGE_LAYOUT.fullmatch(self.path.split("?", 1)[0])
        if layout and method == emulator.GET:
            return _storage_layout(response, layout.group(1), self.storage)
        response.status = HTTPStatus.NOT_IMPLEMENTED
        for regex, handlers in emulator.HANDLERS:
            match = re.fullmatch(regex, request.path)
            if not match:
                continue
            handler = handlers.get(method)
            if handler is not None:
                request.set_match(match)
                response.status = HTTPStatus.OK
                target = _target(request, match)
                generation = self._generation(*target) if target else None
                failed = precondition_failure(method, request.query, generation)
                if failed:
                    return _error(response, failed, "generation precondition not met")
                try:
                    handler(request, response, self.storage)
                except Exception as error:  # noqa: BLE001 (answered, and in the log)
                    traceback.print_exc()
                    return _error(response, HTTPStatus.INTERNAL_SERVER_ERROR, repr(error))
                is_media = f"{handler.__module__.rsplit('.', 1)[-1]}.{handler.__name__}" in _DOWNLOAD_ROUTES
                if target and is_media and response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
                    response["x-goog-generation"] = str(self._generation(*target))
                    response["x-goog-metageneration"] = "1"
            break
        response.close()

    def _generation(self, bucket: str, name: str) -> int | None:
        obj = self.storage.objects.get(bucket, {}).get(name)
        return int(obj["generation"]) if obj else None

    def _write_log(self, code: int | str = "-") -> None:
        record = {"client": self.client_address[0], "port": self.server.server_address[1],
                  "method": self.command, "path": self.path,
                  "status": getattr(self, "_status", code), **getattr(self, "_timing", {}),
                  "end": round(time.time(), 4)}
        with _LOG_LOCK:
            self.log_file.write(json.dumps(record) + "\n")
            self.log_file.flush()

    def do_GET(self) -> None:
        self._route(emulator.GET)

    def do_POST(self) -> None:
        self._route(emulator.POST)

    def do_PUT(self) -> None:
        self._route(emulator.PUT)

    def do_DELETE(self) -> None:
        self._route(emulator.DELETE)

    def do_PATCH(self) -> None:
        self._route(emulator.PATCH)

    def send_header(self, keyword: str, value: str) -> None:
        if keyword.lower() == "content-length" and hasattr(self, "_timing"):
            self._timing["response_bytes"] = int(value)  # the answer's body, for the log
        if self.tls and keyword.lower() == "location" and value.startswith("http://"):
            value = "https://" + value[len("http://"):]
        super().send_header(keyword, value)

    def log_request(self, code="-", size="-") -> None:
        self._status = int(code) if str(code).isdigit() else str(code)
        if not getattr(self, "_in_route", False):  # the base class's answer (malformed request)
            self._timing = {"t": round(time.time(), 3)}
            self._write_log(code)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base's name)
        sys.stderr.write(f"{self.client_address[0]} {format % args}\n")


def _error(response, status: HTTPStatus, message: str) -> None:
    """Answers ``status`` with GCS's JSON error body."""
    response.status = status
    if status != HTTPStatus.NOT_MODIFIED:
        response.json({"error": {"code": status.value, "message": message,
                                 "errors": [{"message": message, "reason": status.phrase}]}})
    response.close()


def _storage_layout(response, bucket: str, storage: Storage) -> None:
    """GCS's ``storageLayout`` of ``bucket`` (flat: no hierarchical namespace), which
    TensorFlow's GCS filesystem asks for before it renames a directory."""
    if bucket not in storage.buckets:
        return _error(response, HTTPStatus.NOT_FOUND, f"The specified bucket does not exist: {bucket}")
    response.status = HTTPStatus.OK
    response.json({"kind": "storage#storageLayout", "bucket": bucket, "location": "US",
                   "locationType": "multi-region", "hierarchicalNamespace": {"enabled": False}})
    response.close()


def _bucket_of(path: str) -> str | None:
    found = _BUCKET_IN_PATH.match(path)
    return (found.group(1) or found.group(2)) if found else None


def _target(request, match: re.Match) -> tuple[str, str] | None:
    """(bucket, object) a request reads or writes: the destination of a copy/rewrite,
    the ``name`` of an upload (in the query, or in the upload's metadata), else the
    object of the path."""
    params = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
    if "dest_object_id" in params:
        return params["dest_bucket_name"], params["dest_object_id"]
    if "object_id" in params:
        return params["bucket_name"], params["object_id"]
    if "name" in request.query and "upload_id" not in request.query:
        return params.get("bucket_name", ""), request.query["name"][0]
    if request.query.get("uploadType") in (["multipart"], ["resumable"]) and isinstance(
            request.data, dict):  # google-cloud-storage names the object in the metadata
        return params.get("bucket_name", ""), request.data.get("meta", request.data).get("name")
    return None


class _TlsServer(server.ThreadingHTTPServer):
    """Accepts plain sockets; each connection's thread does the TLS handshake."""

    daemon_threads = True

    def __init__(self, address, handler, context: ssl.SSLContext):
        self.context = context
        super().__init__(address, handler)

    def finish_request(self, request, client_address) -> None:
        request.settimeout(SOCKET_TIMEOUT_S)
        try:
            tls = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as error:
            sys.stderr.write(f"{client_address[0]} TLS handshake failed: {error}\n")
            return
        self.RequestHandlerClass(tls, client_address, self)


def _name_process(name: str) -> None:
    """Sets /proc/self/comm (prctl PR_SET_NAME) so the cluster fixtures can tell it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(15, name.encode()[:15], 0, 0, 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--bucket", action="append", default=[])
    parser.add_argument("--forbidden_bucket", action="append", default=[],
                        help="every request naming it answers 403")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--process-name", default="gcs-emulator")
    parser.add_argument("--latency_ms", type=float, default=0.0,
                        help="added before each answer (a slow link's round trip)")
    args = parser.parse_args(argv)
    _name_process(args.process_name)
    storage = _Storage(use_memory_fs=True, data_dir=str(args.dir / "data"))
    for bucket in args.bucket:
        if storage.buckets.get(bucket) is None:
            buckets.create_bucket(bucket, storage)
    log_file = open(args.dir / "requests.jsonl", "a", encoding="utf-8")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(args.dir / "server.pem", args.dir / "server.key")
    faults = _Faults(args.dir / "faults.json")
    latency = _Latency(args.dir / "latency.json", args.latency_ms / 1e3)

    def handler(tls: bool):
        return type("Handler", (_Handler,), {"tls": tls, "log_file": log_file,
                                              "latency": latency,
                                              "forbidden": frozenset(args.forbidden_bucket),
                                              "faults": faults,
                                              "__init__": _bind_storage(storage)})

    servers = [_TlsServer((args.host, 443), handler(True), context),
               server.ThreadingHTTPServer((args.host, 80), handler(False))]
    for srv in servers:
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


def _bind_storage(storage: Storage):
    def __init__(self, *args, **kwargs):
        emulator.RequestHandler.__init__(self, storage, *args, **kwargs)
    return __init__


if __name__ == "__main__":
    main()
