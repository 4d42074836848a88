"""A hostile local tenant with a valid session of its own (CPU backend): what test_security,
test_validation, test_fuzz and test_fast_path do not reach. Each test failed before its fix."""

from __future__ import annotations

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
