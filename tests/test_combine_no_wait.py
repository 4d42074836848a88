"""A stream-ordered combine sent without waiting for its answer (EPD_COMBINE_NO_WAIT=1, cuda):
the client claims the membership's next stream sequence, its stream writes READY and waits
for DONE of it at once, and the answer is read at the rank's next call (client/stream_calls.py
`_settle_combine`). These tests hold the client's reading of that answer; the engine's side is
in tests/test_answer_before_launch.py; the calls on a GPU in tests/gpu/test_stream_ordered.py."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from epd.client import stream_calls
from epd.proto import abi, counter_page
from epd.proto.errors import EpdError, ResourceExhausted
from epd.proto.v1 import epd_pb2


class _Call:
    def __init__(self, answer) -> None:
        self.answer = answer
        self.timeouts: list[float | None] = []

    def result(self, timeout=None):
        self.timeouts.append(timeout)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class _Slot:
    def __init__(self) -> None:
        self.words = np.zeros(abi.SLOT_BYTES // 8, dtype=np.int64)
        self.settled: list[int] = []

    def settle(self, seq: int, timeout: float) -> None:
        self.settled.append(seq)


class _Group:
    name = "g"

    def __init__(self, answer, seq: int = 7, before: int = 6) -> None:
        self.call = _Call(answer)
        self._pending_combine = (self.call, seq, before, 2.5)


def test_an_accepted_combine_settles_quietly() -> None:
    g, slot = _Group(epd_pb2.CombineResponse(stream_seq=7)), _Slot()
    stream_calls._settle_combine(g, slot)
    assert g._pending_combine is None and g.call.timeouts == [2.5]
    assert counter_page.stream_done(slot.words) == 0 and slot.settled == []
    stream_calls._settle_combine(g, slot)  # nothing out: nothing to read


def test_a_refusal_is_raised_at_the_next_call_with_the_engines_words() -> None:
    g, slot = _Group(epd_pb2.CombineResponse(
        stream_seq=7, refused_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
        refused_message="combine x has shape [3, 8], expected [4, 8]")), _Slot()
    with pytest.raises(EpdError) as e:
        stream_calls._settle_combine(g, slot)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "combine #7 (sent without waiting for its answer)" in e.value.message
    assert "expected [4, 8]" in e.value.message
    # the engine took #7 and its stream passes it: the client writes nothing
    assert counter_page.stream_done(slot.words) == 0 and slot.settled == []
    assert g._pending_combine is None


@pytest.mark.parametrize("before", [6, 0])
def test_an_error_status_lets_our_stream_pass_the_sequence_after_the_earlier_calls(
        before) -> None:
    g, slot = _Group(ResourceExhausted("the session's quota"), before=before), _Slot()
    with pytest.raises(EpdError) as e:
        stream_calls._settle_combine(g, slot)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota" in e.value.message
    assert slot.settled == ([6] if before else [])  # DONE in order: after #6's, not over it
    assert counter_page.stream_done(slot.words) == 7
    assert counter_page.stream_failure(slot.words) is None  # raised here, not again by check


def test_an_answer_numbered_otherwise_is_an_internal_error() -> None:
    with pytest.raises(EpdError) as e:
        stream_calls._settle_combine(_Group(epd_pb2.CombineResponse(stream_seq=8)), _Slot())
    assert e.value.code == grpc.StatusCode.INTERNAL and "#8" in e.value.message


def test_opt_in(monkeypatch) -> None:
    monkeypatch.delenv("EPD_COMBINE_NO_WAIT", raising=False)
    assert not stream_calls.combine_no_wait()
    monkeypatch.setenv("EPD_COMBINE_NO_WAIT", "1")
    assert stream_calls.combine_no_wait()
