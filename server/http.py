"""The supervisor's HTTP endpoint: /metrics (all processes), /healthz and /readyz.

prometheus_client's WSGI app does the exposition; the standard library's WSGI server runs it in
a thread so a slow scrape never touches the event loop. The address family is the host's
(getaddrinfo): an IPv6 address (a pod IP on an IPv6 cluster, ::1) binds as IPv4 ones do.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app, multiprocess

from . import metrics

# Connections served at once: a thread each (a scrape, a probe, `epd topology` take one for a
# moment); beyond this a new connection is closed at once. And how long one may stay silent:
# a review held 300 idle connections open, 300 supervisor threads for good, enough under the
# unit's task limit to keep the engines from starting threads for new sessions.
MAX_CONNECTIONS = 32
IDLE_SECONDS = 10.0
# And how long one may take in all: a read timeout alone let a client that sends a byte every
# few seconds hold its slot, and forty such held /healthz shut (a fuzzer). Past this the
# connection is shut down, whatever it is doing.
REQUEST_SECONDS = 5.0


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # (address_family AF_INET, socketserver's)

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._deadlines: dict[socket.socket, float] = {}  # connection -> when it is cut
        self._deadline_lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._cut_late, name="epd-http-deadlines", daemon=True).start()

    def server_close(self) -> None:
        closed = getattr(self, "_closed", None)  # (a failed bind closes before activating)
        if closed is not None:
            closed.set()
        super().server_close()

    def _cut_late(self) -> None:
        """One thread for every connection's REQUEST_SECONDS (not a timer thread each)."""
        while not self._closed.wait(0.25):
            now = time.monotonic()
            with self._deadline_lock:
                late = [r for r, t in self._deadlines.items() if t <= now]
                for r in late:
                    del self._deadlines[r]
            for r in late:
                _shut(r)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # (busy: the client may try again)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        with self._deadline_lock:
            self._deadlines[request] = time.monotonic() + REQUEST_SECONDS
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._deadline_lock:
                self._deadlines.pop(request, None)
            self._slots.release()


def _shut(request: socket.socket) -> None:
    """End a connection past REQUEST_SECONDS: its thread's read or write fails and it ends."""
    with contextlib.suppress(OSError):  # (closed meanwhile)
        request.shutdown(socket.SHUT_RDWR)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    timeout = IDLE_SECONDS  # (a read that waits longer ends the connection and its thread)

    def log_message(self, format, *args):  # scrapes every few seconds: not worth a log line
        pass


def make_app(ready: Callable[[], tuple[bool, str]]):
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    metrics_app = make_wsgi_app(registry)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        if path == "/readyz":
            ok, text = ready()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "text/plain")])
            return [text.encode() + b"\n"]
        if path in ("/metrics", "/"):
            with metrics.COLLECT_LOCK:  # (not while a dead engine's files are folded)
                return metrics_app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /metrics, /healthz or /readyz\n"]

    return app


def start(host: str, port: int, ready: Callable[[], tuple[bool, str]]) -> _Server:
    """Serve on host:port (an IPv4 or IPv6 address or a name: the first address getaddrinfo
    gives; "": every IPv4 address, as before). OSError (socket.gaierror for a host that does
    not resolve) where it cannot listen there."""
    family, _, _, _, address = socket.getaddrinfo(
        host or "0.0.0.0", port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = _Server6 if family == socket.AF_INET6 else _Server
    server = server_class(address, _QuietHandler)
    server.set_app(make_app(ready))
    threading.Thread(target=server.serve_forever, name="epd-http", daemon=True).start()
    return server


def url(server: _Server, path: str = "/metrics") -> str:
    """http://HOST:PORT<path> of a started server (an IPv6 host in brackets)."""
    host, port = server.server_address[:2]
    return f"http://[{host}]:{port}{path}" if ":" in host else f"http://{host}:{port}{path}"
