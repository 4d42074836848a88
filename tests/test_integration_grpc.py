"""The integration suite once more with a daemon that offers no fast path, so every call of
every rank travels on gRPC (test_integration.py runs on the fast path, the clients' default):
both transports pass the same semantic suite."""

from test_integration import *  # noqa: F403  (the same tests, collected again here)

DAEMON_EXTRA = ["--no-fast-path"]  # read by conftest's module-scoped `daemon` fixture


def test_this_module_really_uses_grpc(daemon) -> None:
    from epd.client import Session
    with Session(daemon.socket(0)) as s:
        assert s.transport == "grpc"
        assert "disabled" in s.fast_path_error
