"""A refused request changes nothing (README, failure rules): no state is taken before the last
check that can refuse it. Each test here failed before its fix:

- a low-latency dispatch carrying a ready_event the backend cannot wait for released the
  handles it carried, then was refused (a normal dispatch checks the event first);
- a JoinGroup refused after it reserved its counter slot (a bad timeout, a policy refusal, a
  rendezvous refusal) gave the slot back at the end of the free list, so the next join got
  another slot than it would have;
- the coordinator registered a new group instance under the name before it refused a
  rendezvous without the session's credentials: the empty instance stayed and failed the next
  join of another spec under that name;
- stream-ordered layout, dispatch and combine took the member's stream sequence (and the
  dispatch its counter sequence) before the backend's refusal (a normal-mode call on a group
  beyond the kernels' ranks): the cuda backend's refusals, on stand-ins here."""

from __future__ import annotations

import asyncio
import math
import os
import types

import grpc
import numpy as np
import pytest
from ranklib import BF16, Case, join, plain_regions

from epd.client import Session
from epd.proto import abi
from epd.proto.errors import EpdError, FailedPrecondition
from epd.proto.v1 import epd_pb2
from epd.server.backends import cpu_plan
from epd.server.coordinator import Coordinator
from epd.server.engine.stream_calls import StreamCalls

WIRE_BF16 = epd_pb2.BFLOAT16
SOLO = dict(num_ranks=1, num_experts=4, hidden=128, num_topk=2, tokens=(6,), max_tokens=8)


def _solo(name: str) -> Case:
    return Case(group=name, **SOLO)


def _handles(s: Session) -> int:
    (g,) = s.stats().groups
    return g.handles


# -- engine, over gRPC ---------------------------------------------------------------------------
def test_refused_low_latency_dispatch_keeps_the_handles_it_carries(daemon) -> None:
    """A ready_event is known from the request alone to be one the cpu backend cannot wait
    for: the call is refused before anything it carries is applied, and the handle it named
    for release still combines."""
    s = Session(daemon.socket(0), timeout=10)
    try:
        g = join(s, _solo("npe-ll-event"), 0, timeout=10)
        c = _solo("npe-ll-event")
        inp = c.inputs(0)
        d = g.dispatch(inp["x"], inp["topk_idx"], inp["topk_weights"])
        assert _handles(s) == 1
        x = s.empty((6, 128), BF16)
        x[...] = inp["x"]
        idx = s.empty((6, 2), np.int64)
        idx[...] = [[0, 1]] * 6
        req = epd_pb2.LowLatencyDispatchRequest(
            session_id=s.session_id, group_id=g.group_id, num_max_dispatch_tokens_per_rank=8,
            num_experts=4, timeout_seconds=5, release_handles=[d.handle.handle_id],
            ready_event=b"\x01" * 64, **s._descs({"x": x, "topk_idx": idx}))
        with pytest.raises(EpdError) as err:
            s._transport.call("LowLatencyDispatch", req, 5)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "ready_event" in err.value.message
        assert _handles(s) == 1, "a refused call released the handle it carried"
        g.combine(np.asarray(d.recv_x), d.handle)  # (FAILED_PRECONDITION 'released' before)
    finally:
        s.close()


def test_refused_join_gives_its_counter_slot_back_where_it_was(daemon) -> None:
    """A JoinGroup refused after its reservation (here: a NaN timeout, checked once the slot
    is reserved) leaves the free slots as they were: the next join gets the same slot."""
    s = Session(daemon.socket(1), timeout=10)
    try:
        spec = epd_pb2.GroupSpec(name="npe-join", num_ranks=1, num_experts=4, hidden=128,
                                 max_tokens_per_rank=8, num_topk=2, x_dtype=WIRE_BF16)
        req = epd_pb2.JoinGroupRequest(session_id=s.session_id, spec=spec, rank=0,
                                       timeout_seconds=math.nan)
        with pytest.raises(EpdError) as err:
            s._transport.call("JoinGroup", req, 5)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "timeout_seconds" in err.value.message
        g = join(s, _solo("npe-join"), 0, timeout=10)
        assert g._counter_slot == 0, "a refused join moved the session's free counter slots"
    finally:
        s.close()


# -- coordinator ---------------------------------------------------------------------------------
def test_refused_rendezvous_registers_no_group(tmp_path) -> None:
    """A rendezvous without the session's credentials is PERMISSION_DENIED and leaves no
    instance under the name (it stayed, empty and forming, and failed the next join of
    another spec with FAILED_PRECONDITION 'exists with a different spec')."""
    coord = Coordinator(cpu_plan.CpuPlanner(str(tmp_path)))

    def req(hidden: int, has_peer: bool) -> epd_pb2.RendezvousRequest:
        return epd_pb2.RendezvousRequest(
            spec=epd_pb2.GroupSpec(name="npe-rdv", num_ranks=1, num_experts=4, hidden=hidden,
                                   max_tokens_per_rank=8, num_topk=2, x_dtype=WIRE_BF16),
            rank=0, engine_index=0, session_id="s0", timeout_seconds=5,
            peer_uid=os.getuid(), peer_gid=os.getgid(), has_peer=has_peer)

    async def run() -> epd_pb2.RendezvousResponse:
        with pytest.raises(EpdError) as err:
            await coord.rendezvous(req(128, has_peer=False))
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert coord.by_name == {} and coord.by_id == {}
        assert sum(coord.groups_by_class().values()) == 0
        return await coord.rendezvous(req(256, has_peer=True))  # another spec: it forms

    resp = asyncio.run(run())
    assert resp.group_id
    coord.close()


def test_a_daemon_out_of_descriptors_forms_no_group_and_says_so(tmp_path, monkeypatch) -> None:
    """The planner failing with EMFILE (a fuzzer filled the supervisor's descriptor table):
    every waiting rank gets RESOURCE_EXHAUSTED naming the cause (it was INTERNAL), nothing is
    registered under the name, and the next join forms once descriptors are back."""
    import errno

    planner = cpu_plan.CpuPlanner(str(tmp_path))
    coord = Coordinator(planner)
    real = planner.plan_group

    def out_of_fds(*a, **k):
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(planner, "plan_group", out_of_fds)
    req = epd_pb2.RendezvousRequest(
        spec=epd_pb2.GroupSpec(name="no-fds", num_ranks=1, num_experts=4, hidden=128,
                               max_tokens_per_rank=8, num_topk=2, x_dtype=WIRE_BF16),
        rank=0, engine_index=0, session_id="s0", timeout_seconds=5,
        peer_uid=os.getuid(), peer_gid=os.getgid(), has_peer=True)

    async def run() -> epd_pb2.RendezvousResponse:
        with pytest.raises(EpdError) as err:
            await coord.rendezvous(req)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert "no descriptor left" in err.value.message and "LimitNOFILE" in err.value.message
        assert coord.by_name == {} and coord.by_id == {}
        monkeypatch.setattr(planner, "plan_group", real)
        return await coord.rendezvous(req)

    assert asyncio.run(run()).group_id
    coord.close()


# -- stream-ordered calls (cuda backend), on stand-ins -------------------------------------------
class _RefusingComm:
    """A cuda comm whose stream-ordered calls the backend refuses (as CudaRankComm's
    `_normal_mode` does for a group beyond the normal-mode kernels' ranks)."""

    stream_ordered = True
    num_sms = 0

    def known_abort_reason(self) -> str | None:
        return None

    def _refuse(self, *args, **kw):
        raise FailedPrecondition("normal-mode calls take at most 8 ranks on the cuda engine")

    stream_layout = stream_dispatch = stream_combine = _refuse


class _Engine(StreamCalls):
    backend = types.SimpleNamespace(name="cuda", peer_class="nvlink")
    config = types.SimpleNamespace(per_expert_metrics=False)

    def _timeout(self, seconds: float) -> float:
        return 1.0

    def _check_handle_budget(self, session, member, releases, nbytes) -> None:
        pass

    @staticmethod
    def _new_handle_bytes(member, args, cached) -> int:
        return 0

    @staticmethod
    def _queued(session, member) -> None:
        pass


def _stream_setup():
    words = np.zeros(abi.SLOT_BYTES // 8, np.int64)
    session = types.SimpleNamespace(regions=plain_regions(4096),
                                    counter_page=types.SimpleNamespace(slot=lambda i: words))
    spec = types.SimpleNamespace(name="g", num_ranks=16, num_experts=32, hidden=8,
                                 num_topk=2, x_dtype=WIRE_BF16,
                                 x_numpy_dtype=np.dtype(np.uint16))
    member = types.SimpleNamespace(comm=_RefusingComm(), spec=spec, counter_slot=0, rank=0,
                                   pending=None, dispatch_sequence=5, stream_seq=9,
                                   dispatches=0, combines=0, bytes_sent=0)
    return session, member


def _desc(offset: int, shape: list[int], dtype: int) -> epd_pb2.TensorDesc:
    return epd_pb2.TensorDesc(region_id="r", offset_bytes=offset, shape=shape, dtype=dtype)


@pytest.mark.parametrize("call", ["layout", "dispatch", "combine"])
def test_stream_call_refused_by_the_backend_takes_no_sequence(call: str) -> None:
    session, member = _stream_setup()
    e = _Engine()
    with pytest.raises(FailedPrecondition, match="at most 8 ranks"):
        if call == "layout":
            req = epd_pb2.GetDispatchLayoutRequest(
                num_tokens_per_rank_out=_desc(0, [16], epd_pb2.INT32),
                num_tokens_per_expert_out=_desc(64, [32], epd_pb2.INT32),
                is_token_in_rank_out=_desc(256, [4, 16], epd_pb2.BOOL), stream_ordered=True)
            e.layout_stream(session, member, req, np.zeros((4, 2), np.int64), "grpc")
        elif call == "dispatch":
            req = epd_pb2.DispatchRequest(stream_ordered=True)
            e.dispatch_stream(session, member, req, object(), None, 1.0, "grpc")
        else:
            req = epd_pb2.CombineRequest(out=_desc(512, [4, 8], WIRE_BF16), stream_ordered=True)
            info = types.SimpleNamespace(num_tokens=4, num_recv_tokens=3)
            args = types.SimpleNamespace(topk_weights=None)
            e.combine_stream(session, member, req, info, args, 1.0, "grpc")
    assert (member.dispatch_sequence, member.stream_seq) == (5, 9)
    assert (member.dispatches, member.combines, member.bytes_sent) == (0, 0, 0)
