"""The engine's dispatch answer (server/engine/ops.py dispatch_response): a stream-ordered
dispatch's descriptors are made once per set of output views and copied into each answer;
these tests hold that a copied answer says what describing the views anew says, carries its
own call's numbers, and never outlives the views it was made from."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from epd.proto.v1 import epd_pb2
from epd.server.backends.base import DispatchOutputs, Region
from epd.server.engine.ops import dispatch_response


class _HostRegion(Region):
    """An engine output region in host memory (offsets from its base buffer)."""

    def __init__(self, size: int) -> None:
        super().__init__("out-region", size)
        self.buf = np.zeros(size, np.uint8)

    def view(self, offset, shape, dtype, strides):  # (not used here)
        raise NotImplementedError

    def offset_of(self, array) -> int:
        return array.ctypes.data - self.buf.ctypes.data

    def close(self) -> None:
        pass

    def at(self, offset: int, shape: tuple[int, ...], dtype) -> np.ndarray:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.buf[offset:offset + n].view(dtype).reshape(shape)


def _outputs(region: _HostRegion, rows: int, topk: bool = True) -> DispatchOutputs:
    return DispatchOutputs(
        recv_x=region.at(0, (rows, 64), np.uint16),
        recv_x_scales=None,
        recv_topk_idx=region.at(1 << 16, (rows, 4), np.int64) if topk else None,
        recv_topk_weights=region.at(2 << 16, (rows, 4), np.float32) if topk else None,
        recv_src_idx=region.at(3 << 16, (rows,), np.int32),
        rank_prefix_matrix=region.at(4 << 16, (2, 2), np.int32),
        num_recv_tokens=-1, num_recv_tokens_per_expert=[], handle=None)


def _request() -> epd_pb2.DispatchRequest:
    return epd_pb2.DispatchRequest(x=epd_pb2.TensorDesc(dtype=epd_pb2.BFLOAT16))


def test_a_copied_answer_matches_a_fresh_one_and_carries_its_own_numbers() -> None:
    region = _HostRegion(5 << 16)
    member = SimpleNamespace(comm=SimpleNamespace(output_region=region), described={})
    out, req = _outputs(region, 96), _request()
    first = dispatch_response(member, req, out, handle_id=3, sequence=7, stream_seq=11)
    second = dispatch_response(member, req, out, handle_id=4, sequence=8, stream_seq=12)
    plain = dispatch_response(member, req, out, handle_id=4, sequence=8)  # (never cached)
    assert len(member.described) == 1
    for field in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src_idx",
                  "rank_prefix_matrix"):
        assert getattr(second, field) == getattr(plain, field) == getattr(first, field)
    assert second.recv_x.offset_bytes == 0 and list(second.recv_x.shape) == [96, 64]
    assert second.recv_x.dtype == epd_pb2.BFLOAT16  # the call's dtype, not the view's bits
    assert second.recv_topk_idx.offset_bytes == 1 << 16
    assert (first.handle, first.counter_sequence, first.stream_seq) == (3, 7, 11)
    assert (second.handle, second.counter_sequence, second.stream_seq) == (4, 8, 12)
    assert not second.HasField("recv_x_scales")
    second.recv_x.shape[0] = 1  # an answer is its own message: the next one is not changed
    third = dispatch_response(member, req, out, handle_id=5, sequence=9, stream_seq=13)
    assert list(third.recv_x.shape) == [96, 64]


def test_new_views_get_new_descriptors() -> None:
    """Other rows, or a call without top-k outputs, are other view objects: described anew,
    never answered with an earlier shape's descriptors."""
    region = _HostRegion(5 << 16)
    member = SimpleNamespace(comm=SimpleNamespace(output_region=region), described={})
    req = _request()
    a = dispatch_response(member, req, _outputs(region, 96), 1, 1, stream_seq=1)
    b = dispatch_response(member, req, _outputs(region, 40), 2, 2, stream_seq=2)
    c = dispatch_response(member, req, _outputs(region, 40, topk=False), 3, 3, stream_seq=3)
    assert list(a.recv_x.shape) == [96, 64] and list(b.recv_x.shape) == [40, 64]
    assert b.HasField("recv_topk_idx") and not c.HasField("recv_topk_idx")
    assert list(c.recv_src_idx.shape) == [40]


def test_the_remembered_layouts_are_bounded() -> None:
    from epd.server.engine import ops
    region = _HostRegion(5 << 16)
    member = SimpleNamespace(comm=SimpleNamespace(output_region=region), described={})
    req = _request()
    for rows in range(1, 3 * ops.MAX_DESCRIBED):
        resp = dispatch_response(member, req, _outputs(region, rows), rows, rows,
                                 stream_seq=rows)
        assert list(resp.recv_x.shape) == [rows, 64]
        assert len(member.described) <= ops.MAX_DESCRIBED
