"""A hostile local tenant with a valid session of its own (CPU backend): what test_security,
test_validation, test_fuzz and test_fast_path do not reach. Each test failed before its fix."""

from __future__ import annotations

import os
import time

import grpc
import pytest

from epd.client import Session
from epd.proto import ring as R
from epd.proto.errors import EpdError
from epd.proto.v1 import epd_pb2

pytestmark = pytest.mark.slow
BUDGET = 8 << 20  # --max-region-bytes-per-session of the daemons below


def test_a_fast_path_ring_counts_against_the_sessions_bytes(daemon_factory) -> None:
    """OpenFastPath sizes the ring from the request (up to 1,024 slots of 1 MiB): an engine
    memfd its client maps read-write and can fill, which no budget counted, so a session of
    an 8 MiB --max-region-bytes-per-session made the engine hold 1 GiB."""
    with (daemon_factory(engines=1, extra=["--max-region-bytes-per-session", str(BUDGET)])
          as d, Session(d.socket(0), fast_path=False) as s):
        big = epd_pb2.OpenFastPathRequest(session_id=s.session_id, slots=R.MAX_SLOTS,
                                          slot_bytes=R.MAX_SLOT_BYTES)
        with pytest.raises(EpdError) as ei:
            s._transport.call("OpenFastPath", big, 10)
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
        assert "--max-region-bytes-per-session" in ei.value.message
        # (refused, it changed nothing: a ring within the budget opens, and its bytes count)
        s._transport.call("OpenFastPath", epd_pb2.OpenFastPathRequest(
            session_id=s.session_id, slots=4, slot_bytes=1 << 20), 10)
        with pytest.raises(EpdError) as ei:
            s.empty((BUDGET - (2 << 20),), "uint8")
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
        s.empty((BUDGET - (6 << 20),), "uint8")


def _unbound_session(endpoint: str):
    """OpenSession as a hostile client makes it: the lease stream opened, its first event read,
    the descriptor channel never connected (so the engine never learns its uid)."""
    from epd.client.transport import GrpcTransport
    t = GrpcTransport(endpoint)
    stream = t.open_stream(epd_pb2.OpenSessionRequest(client_name="squatter", pid=os.getpid()))
    first = next(stream)
    assert first.HasField("opened")
    return t, stream


def test_one_uid_cannot_hold_all_of_an_engines_sessions(daemon_factory) -> None:
    """--max-sessions-per-uid: a uid's sessions beyond the cap are refused when their
    descriptor channel connects (where the engine learns the uid), naming the flag; the
    engine's other places stay for other tenants, and a closed session frees its place."""
    with daemon_factory(engines=1, extra=["--max-sessions", "8",
                                          "--max-sessions-per-uid", "2"]) as d:
        held = [Session(d.socket(0), timeout=5) for _ in range(2)]
        try:
            with pytest.raises(EpdError) as err:
                Session(d.socket(0), timeout=5)
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
            assert "--max-sessions-per-uid" in err.value.message
            assert f"uid {os.getuid()} holds 2 sessions" in err.value.message
            held.pop().close()
            deadline = time.monotonic() + 10  # (the engine ends it when it sees the lease go)
            while held[0].stats().sessions > 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            with Session(d.socket(0), timeout=5) as again:
                again.ping()
            for s in held:
                s.ping()  # (untouched)
        finally:
            for s in held:
                s.close()


def test_sessions_left_unbound_give_their_places_to_new_ones(daemon_factory) -> None:
    """Sessions opened and never bound (no uid known, so no per-uid cap) filled
    --max-sessions and refused every other tenant for as long as their streams stayed open.
    Once the engine is full, the oldest one unbound past the grace period is closed for a new
    session; bound sessions are never taken, and a full engine of them still refuses."""
    from epd.server.engine import core
    with daemon_factory(engines=1, extra=["--max-sessions", "2"]) as d:
        squatters = [_unbound_session(d.socket(0)) for _ in range(2)]
        try:
            time.sleep(core.UNBOUND_GRACE_SECONDS + 0.5)
            with Session(d.socket(0), timeout=5) as s:
                s.ping()
                deadline = time.monotonic() + 5  # (the oldest was closed: its stream ends)
                while not squatters[0][1].done() and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert squatters[0][1].done() and not squatters[1][1].done()
                time.sleep(core.UNBOUND_GRACE_SECONDS + 0.5)
                with Session(d.socket(0), timeout=5) as s2:  # (the other squatter's place)
                    s2.ping()
                    with pytest.raises(EpdError) as err:  # two bound sessions: full
                        Session(d.socket(0), timeout=5)
                    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "--max-sessions" in err.value.message
                    s.ping()
        finally:
            for t, stream in squatters:
                stream.cancel()
                t.close()
