"""The supervisor's HTTP endpoint: /metrics (all processes), /healthz and /readyz.

prometheus_client's WSGI app does the exposition; the standard library's WSGI server runs it in
a thread so a slow scrape never touches the event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app, multiprocess

from . import metrics


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
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
    server = make_server(host, port, make_app(ready), server_class=_Server,
                         handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="epd-http", daemon=True).start()
    return server
