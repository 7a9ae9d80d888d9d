"""The tests' Google Cloud Storage: ``gcp-storage-emulator`` served as the real host names.

Run on the head node by :mod:`tests.cluster.gcs` (never by hand needed)::

    python tests/cluster/gcs_emulator.py --dir DIR --bucket NAME [--bucket NAME ...]

serves the JSON/upload API on ``0.0.0.0:443`` (TLS, ``DIR/server.pem`` + ``DIR/server.key``
signed by the test CA ``DIR/ca.pem``) and ``0.0.0.0:80`` (plain), keeps the objects in
memory (for the emulator's life: the test session), creates the named buckets, writes one JSON line per request to
``DIR/requests.jsonl`` (``{"client", "port", "method", "path", "status"}``) and
``ready`` on stdout once both ports accept. ``--process-name`` sets its ``comm``, so
the cluster fixtures can tell it from the trainers and spare it between tests.

Why ``gcp-storage-emulator`` (pure Python, PyPI) and not ``fake-gcs-server``: the
latter answers TensorFlow's resumable-upload initiation with ``501 Unsupported transfer
encoding``, a fault in the server that no wrapper of ours can mend (its binary), while
the former's faults are mended here in test code:

* it builds resumable-upload ``Location`` URLs as ``http://HOST...`` whatever scheme the
  request came on: the TLS port rewrites them to ``https://`` (and port 80 serves the
  ``mediaLink``/``selfLink`` URLs it writes into object resources);
* TensorFlow uploads with ``Transfer-Encoding: chunked`` *and* a ``Content-Length``;
  the emulator reads Content-Length bytes of the chunked stream (the object would hold
  the chunk framing): a chunked request's Content-Length is dropped, as HTTP says;
* its disk store maps the object ``a/`` (the directory marker ``tf.io.gfile.makedirs``
  writes) and the objects ``a/b`` onto one path, a file and a directory at once, and
  fails: objects are kept in memory;
* an empty media upload (that same marker) crashes its upload handler (``len(None)``):
  :class:`_Request` hands it ``b""``;
* its server is one thread (a slow client stalls all) and its object store is not
  thread-safe: here every connection has a thread (the TLS handshake and request
  reading happen there) and the API handling is serialized by one lock.

Nothing is patched inside the package: the wrapper subclasses its request handler and
reuses its ``Storage`` and bucket creation.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import ssl
import sys
import re
import threading
import time
import traceback
from http import HTTPStatus, server
from pathlib import Path

from gcp_storage_emulator import server as emulator
from gcp_storage_emulator.handlers import buckets
from gcp_storage_emulator.storage import Storage

_API_LOCK = threading.Lock()  # the emulator's Storage is not thread-safe
_LOG_LOCK = threading.Lock()


class _Request(emulator.Request):
    """An empty media upload (the ``dir/`` marker ``tf.io.gfile.makedirs`` writes) has
    ``b""`` for data: the emulator's ``None`` crashes its upload handler."""

    @property
    def data(self):
        data = super().data
        if data is None and self.query.get("uploadType") == ["media"]:
            return b""
        return data


class _Handler(emulator.RequestHandler):
    """The emulator's handler: serialized API calls, https Location, a request log.

    Routing is the emulator's (its ``HANDLERS`` table, its ``Response``) with
    :class:`_Request`; a handler that raises answers 500 instead of closing the
    connection without an answer.
    """

    tls = False
    log_file = None
    latency_s = 0.0
    protocol_version = "HTTP/1.0"

    def _route(self, method: str) -> None:
        time.sleep(self.latency_s)  # a slow link's round trip (no lock held)
        method = self.headers.get("x-http-method-override") or method
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            del self.headers["Content-Length"]  # RFC 9112 6.3: chunked wins
        with _API_LOCK:
            request, response = _Request(self, method), emulator.Response(self)
            response.status = HTTPStatus.NOT_IMPLEMENTED
            for regex, handlers in emulator.HANDLERS:
                match = re.fullmatch(regex, request.path)
                if not match:
                    continue
                if method in handlers:
                    request.set_match(match)
                    response.status = HTTPStatus.OK
                    try:
                        handlers[method](request, response, self.storage)
                    except Exception as error:  # noqa: BLE001 (answered, and in the log)
                        traceback.print_exc()
                        response.status = HTTPStatus.INTERNAL_SERVER_ERROR
                        response.json({"error": {"code": 500, "message": repr(error)}})
                break
            response.close()

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
        if self.tls and keyword.lower() == "location" and value.startswith("http://"):
            value = "https://" + value[len("http://"):]
        super().send_header(keyword, value)

    def log_request(self, code="-", size="-") -> None:
        record = {"client": self.client_address[0], "port": self.server.server_address[1],
                  "method": self.command, "path": self.path,
                  "status": int(code) if str(code).isdigit() else str(code)}
        with _LOG_LOCK:
            self.log_file.write(json.dumps(record) + "\n")
            self.log_file.flush()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base's name)
        sys.stderr.write(f"{self.client_address[0]} {format % args}\n")


class _TlsServer(server.ThreadingHTTPServer):
    """Accepts plain sockets; each connection's thread does the TLS handshake."""

    daemon_threads = True

    def __init__(self, address, handler, context: ssl.SSLContext):
        self.context = context
        super().__init__(address, handler)

    def finish_request(self, request, client_address) -> None:
        request.settimeout(60)
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
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--process-name", default="gcs-emulator")
    parser.add_argument("--latency_ms", type=float, default=0.0,
                        help="added before each answer (a slow link's round trip)")
    args = parser.parse_args(argv)
    _name_process(args.process_name)
    storage = Storage(use_memory_fs=True, data_dir=str(args.dir / "data"))
    for bucket in args.bucket:
        if storage.buckets.get(bucket) is None:
            buckets.create_bucket(bucket, storage)
    log_file = open(args.dir / "requests.jsonl", "a", encoding="utf-8")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(args.dir / "server.pem", args.dir / "server.key")

    def handler(tls: bool):
        return type("Handler", (_Handler,), {"tls": tls, "log_file": log_file,
                                              "latency_s": args.latency_ms / 1e3,
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
