"""Issue 12 on the CUDA engine: the same sealing and credential rules as the CPU backend. A
session's calls need its token (CUDA IPC registration included), another client cannot act as
it, the counter page (mapped pinned memory the notify kernel writes) is a sealed memfd that
nobody can truncate, host memfd regions are refused, and the victim's group keeps giving exact
results afterwards."""

from __future__ import annotations

import errno
import os

import grpc
import numpy as np
import pytest

from epd.server import reference as ref
from epd.server.demo import Workload

from .test_daemon import _bits, _to_torch

pytestmark = pytest.mark.gpu
DENIED = grpc.StatusCode.PERMISSION_DENIED


def _solo_round(s, wl: Workload, name: str):
    """A 1-rank group on this session's GPU: dispatch + combine, exact against the reference."""
    import torch

    x, idx, w = wl.inputs(0)
    dev = s.device_ordinal
    g = s.join(name, rank=0, num_ranks=1, num_experts=wl.num_experts, hidden=wl.hidden,
               max_tokens_per_rank=max(wl.tokens), num_topk=wl.num_topk)
    out = g.dispatch(_to_torch(x, dev), _to_torch(idx, dev), _to_torch(w, dev))
    cx, _ = g.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights)
    torch.cuda.synchronize(dev)
    d = ref.dispatch([x], [idx], [w], wl.num_experts)[0]
    c = ref.combine([d.recv_x], [d], wl.tokens, recv_topk_weights=[d.recv_topk_weights])[0]
    np.testing.assert_array_equal(_bits(out.recv_x), d.recv_x.view(np.uint16))
    np.testing.assert_array_equal(_bits(cx), c[0].view(np.uint16))
    return g


def test_cuda_sessions_are_sealed_and_authenticated(daemon) -> None:
    import torch

    from epd.client import EpdError, Session
    from epd.proto import fd_channel as fdc
    from epd.proto.v1 import epd_pb2, epd_pb2_grpc

    torch.cuda.set_device(0)
    wl = Workload(1, [96], 2048, 16, 4, seed=12)
    with Session(daemon.socket(0), timeout=30) as victim, \
            Session(daemon.socket(0), timeout=30) as thief:
        assert victim.backend == "cuda"
        g = _solo_round(victim, wl, "sec-cuda")
        # The counter page the notify kernel writes is a sealed memfd: no truncation.
        fd, size = victim._channel.fetch(fdc.COUNTERS)
        try:
            for bad in (0, size // 2):
                with pytest.raises(OSError) as ei:
                    os.ftruncate(fd, bad)
                assert ei.value.errno == errno.EPERM
        finally:
            os.close(fd)
        # Another client with the victim's session id: no token, or its own token, is refused.
        ch = grpc.insecure_channel(f"unix://{daemon.socket(0)}")
        stub = epd_pb2_grpc.EngineStub(ch)
        t = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda:0")
        from epd.client import cuda_ipc
        base, nbytes = cuda_ipc.allocation_of(t.data_ptr(), 0)
        handle = cuda_ipc.ipc_handle(base, 0)
        calls = [
            ("LeaveGroup", epd_pb2.LeaveGroupRequest(session_id=victim.session_id,
                                                     group_id=g.group_id)),
            ("GetStats", epd_pb2.GetStatsRequest(session_id=victim.session_id)),
            ("RegisterRegion", epd_pb2.RegisterRegionRequest(
                session_id=victim.session_id, cuda_ipc_handle=handle, size_bytes=nbytes,
                device_ordinal=0)),
        ]
        try:
            for md in ((), ((fdc.TOKEN_METADATA, thief._channel.token),)):
                for method, req in calls:
                    with pytest.raises(grpc.RpcError) as ei:
                        getattr(stub, method)(req, timeout=10, metadata=md)
                    assert ei.value.code() == DENIED, (method, ei.value.details())
                    assert victim.session_id in ei.value.details()
            # The thief's own stats show none of the victim's groups.
            assert [gs.group_id for gs in thief.stats().groups] == []
        finally:
            ch.close()
        # Host memory (a sealed memfd region) is refused by the CUDA engine.
        mfd = fdc.create_memfd("host-region", 1 << 16, fdc.ENGINE_SEALS)
        try:
            with pytest.raises(EpdError) as ei:
                victim._channel.register(mfd, 1 << 16)
        finally:
            os.close(mfd)
        assert ei.value.code in (grpc.StatusCode.FAILED_PRECONDITION,
                                 grpc.StatusCode.INVALID_ARGUMENT)
        # The victim's group is untouched: another exact round on the same group.
        x, idx, w = wl.inputs(0)
        out = g.dispatch(_to_torch(x, 0), _to_torch(idx, 0), _to_torch(w, 0))
        torch.cuda.synchronize(0)
        d = ref.dispatch([x], [idx], [w], wl.num_experts)[0]
        np.testing.assert_array_equal(_bits(out.recv_x), d.recv_x.view(np.uint16))
