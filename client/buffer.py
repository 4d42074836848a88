"""A DeepEP-compatible `Buffer` over an EPD daemon.

Code written for `deep_ep.Buffer` (normal mode) runs with an import change:

    from epd.client import buffer as deep_ep       # instead of: import deep_ep
    buf = deep_ep.Buffer(group, num_nvl_bytes)       # torch.distributed group: rank/size from it
    n_rank, n_rdma, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=n_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    combined_x, combined_w, _ = buf.combine(expert_out, handle, topk_weights=recv_w)

Differences, all documented in the README: the layout tensors passed to `dispatch` are
recomputed by the daemon from `topk_idx` (they are accepted for compatibility); `config`,
`previous_event`, `async_finish` and `allocate_on_comm_stream` are accepted and have no effect on
the CPU backend; the handle is an opaque object rather than a tuple of tensors. Bad arguments
raise `EpdError` with INVALID_ARGUMENT, as every EPD call does.

Low-latency mode (`Buffer(..., low_latency_mode=True)`):

    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
        x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True)
    combined_x, event, hook = buf.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

On the cpu backend calls return when their data has arrived, so `return_recv_hook=True` returns
a hook that does nothing and `async_finish` has no effect. On the cuda backend, a call made
while the current stream captures a CUDA graph, or with `return_recv_hook=True`, is
stream-ordered (client/stream_ops.py): it is armed once per set of tensors, triggered from the
stream with stream memory operations, and the hook enqueues the wait for its data. FP8
scales are float32 `[L, R*num_max, H/128]` in row-major order; `use_ue8m0` gives power-of-two
float32 scales (it implies `round_scale`) rather than DeepEP's packed int32 UE8M0 words.
`use_logfmt`, `zero_copy`, `dispatch_wait_recv_cost_stats` and `combine_wait_recv_cost_stats`
are accepted and ignored: combine always carries exact bf16.

The daemon group behind a Buffer is formed lazily at the first call, from the call's shapes
(hidden, top-k, dtype, number of experts), so one Buffer serves several layer shapes.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..proto import dtypes
from ..proto.errors import InvalidArgument
from . import tensors as T
from .session import Group, Handle, LowLatencyHandle, Session
from .stream_ops import StreamOp
from .tensors import Array

LAYOUT_GROUP_HIDDEN = 128  # hidden size of a group formed only to compute layouts


@dataclass(frozen=True)
class _GroupKey:
    """The shape a daemon group is formed for (a Buffer forms one per shape, lazily)."""

    hidden: int
    num_topk: int
    dtype: str  # numpy dtype.str of the combine dtype
    num_experts: int
    low_latency_tokens: int  # num_max_dispatch_tokens_per_rank of a low-latency group, else 0


class EventOverlap:
    """DeepEP's event wrapper. Calls here return when their results are ready, so waiting is a
    no-op; the object exists so that code using it runs unchanged."""

    def __init__(self, event: object = None) -> None:
        self.event = event

    def current_stream_wait(self) -> None:
        return None

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@dataclass
class Config:
    """Accepted for compatibility with deep_ep.Config; the daemon picks its own tuning."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256


@dataclass
class BufferHandle:
    """The handle `dispatch` returns; pass it to `combine` or to a cached `dispatch`."""

    handle: Handle
    num_experts: int


@dataclass
class LowLatencyBufferHandle:
    """The handle `low_latency_dispatch` returns; pass it to `low_latency_combine`."""

    handle: LowLatencyHandle | StreamOp
    template: Array = None  # the dispatch's x: combine buffers come back as its array type

    @property
    def num_max_dispatch_tokens_per_rank(self) -> int:
        return self.handle.num_max_dispatch_tokens_per_rank

    @property
    def hidden(self) -> int:
        return self.handle.hidden

    @property
    def num_experts(self) -> int:
        return self.handle.num_experts


def _ptr(a: Array) -> int:
    """Device address of a tensor (0 for None): armed ops read their tensors by address."""
    if a is None:
        return 0
    from . import cuda_ipc
    return cuda_ipc.describe_device(a, "tensor").ptr


def _no_op_hook() -> None:
    """The receive hook: the call it came from has already received its data."""
    return None


class Buffer:
    num_sms: int = 20

    def __init__(self, group: Any = None,  # a torch.distributed ProcessGroup
                 num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, *, rank: int | None = None,
                 num_ranks: int | None = None, endpoint: str | None = None,
                 socket_dir: str | None = None, engine: int | None = None,
                 group_name: str = "deep_ep", max_tokens_per_rank: int = 4096,
                 timeout: float | None = None, session: Session | None = None) -> None:
        if group is not None:
            rank, num_ranks = group.rank(), group.size()
        if rank is None or num_ranks is None:
            raise InvalidArgument("Buffer needs a torch.distributed group, or rank= and "
                                  "num_ranks=")
        self.rank, self.group_size = int(rank), int(num_ranks)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.group_name = group_name
        self.max_tokens_per_rank = max_tokens_per_rank
        self.timeout = timeout
        if session is None:
            if engine is None:
                engine = int(os.environ.get("EPD_ENGINE", os.environ.get("LOCAL_RANK", "0")))
            session = Session(endpoint, socket_dir=socket_dir, engine=engine,
                              client_name=f"{group_name}-rank{rank}")
            self._owns_session = True
        else:
            self._owns_session = False
        self.session = session
        self._groups: dict[_GroupKey, Group] = {}
        self._num_experts: int | None = None
        self._combine_buffers: dict[tuple[str, tuple[int, ...], bool], Array] = {}
        self._stream_ops: dict[tuple, StreamOp] = {}  # armed stream-ordered calls, by inputs

    # -- DeepEP's static helpers -------------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Accepted for compatibility (num_rdma_bytes is not used here): the bytes of one
        rank's low-latency receive buffers, bf16 payload plus FP8 scales."""
        rows = num_experts * num_max_dispatch_tokens_per_rank
        return rows * (hidden * 2 + hidden // 128 * 4 + 8)

    # -- groups ------------------------------------------------------------------------------
    def _group(self, hidden: int, num_topk: int, dtype: np.dtype, num_experts: int,
               low_latency_tokens: int = 0) -> Group:
        """The daemon group of one shape. Low-latency calls get their own group whose buffers
        are sized by num_max_dispatch_tokens_per_rank (as DeepEP sizes its RDMA buffer)."""
        key = _GroupKey(hidden, num_topk, dtype.str, num_experts, low_latency_tokens)
        g = self._groups.get(key)
        if g is None:
            name = f"{self.group_name}/h{hidden}-k{num_topk}-{dtype.name}-e{num_experts}"
            if low_latency_tokens:
                name += f"-ll{low_latency_tokens}"
            g = self.session.join(name, rank=self.rank, num_ranks=self.group_size,
                                  num_experts=num_experts, hidden=hidden,
                                  max_tokens_per_rank=low_latency_tokens or
                                  self.max_tokens_per_rank,
                                  num_topk=num_topk, dtype=dtypes.name(dtypes.from_numpy(dtype)),
                                  low_latency_mode=bool(low_latency_tokens),
                                  timeout=self.timeout)
            self._groups[key] = g
        return g

    # -- the DeepEP API ----------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: Array, num_experts: int,
                            previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank, num_tokens_per_rdma_rank=None, num_tokens_per_expert,
        is_token_in_rank, event)."""
        self._num_experts = num_experts
        idx_shape, _ = T.meta(topk_idx, "topk_idx")
        if len(idx_shape) != 2:
            raise InvalidArgument(f"topk_idx must be 2-D, got shape {list(idx_shape)}")
        # Layout needs a group only for the engine round trip; any hidden size will do, so use
        # the first normal-mode group with this routing shape, or a small layout group. Every
        # rank makes the same calls, so every rank picks the same group.
        g = next((g for key, g in self._groups.items()
                  if key.num_topk == idx_shape[1] and key.num_experts == num_experts
                  and not key.low_latency_tokens), None)
        if g is None:
            g = self._group(LAYOUT_GROUP_HIDDEN, idx_shape[1], dtypes.BFLOAT16, num_experts)
        per_rank, per_expert, in_rank = g.get_dispatch_layout(topk_idx)
        return per_rank, None, per_expert, in_rank, EventOverlap()

    def dispatch(self, x: Array, handle: BufferHandle | None = None,
                 num_tokens_per_rank: Array = None, num_tokens_per_rdma_rank: Array = None,
                 is_token_in_rank: Array = None, num_tokens_per_expert: Array = None,
                 topk_idx: Array = None, topk_weights: Array = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event); recv_x is a (fp8, scales) tuple when x was. Cached mode (handle given) returns
        (recv_x, None, None, None, None, event), as DeepEP does."""
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        x_shape, x_dtype = T.meta(x, "x")
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise InvalidArgument("cached dispatch (handle given) takes no "
                                      "topk_idx/topk_weights")
            g = handle.handle.group
            out = g.dispatch(x, x_scales=x_scales, handle=handle.handle,
                             expert_alignment=expert_alignment,
                             num_worst_tokens=num_worst_tokens)
            recv = (out.recv_x, out.recv_x_scales) if x_scales is not None else out.recv_x
            return recv, None, None, None, None, EventOverlap()
        if topk_idx is None or topk_weights is None:
            raise InvalidArgument("dispatch needs topk_idx and topk_weights (or a cached "
                                  "handle)")
        num_experts = (len(num_tokens_per_expert) if num_tokens_per_expert is not None
                       else self._num_experts)
        if num_experts is None:
            raise InvalidArgument("pass num_tokens_per_expert (from get_dispatch_layout) so the "
                             "number of experts is known")
        idx_shape, _ = T.meta(topk_idx, "topk_idx")
        if len(x_shape) != 2 or len(idx_shape) != 2:
            raise InvalidArgument(f"x and topk_idx must be 2-D, got shapes {list(x_shape)} and "
                                  f"{list(idx_shape)}")
        combine_dtype = dtypes.BFLOAT16 if x_scales is not None else x_dtype
        g = self._group(x_shape[1], idx_shape[1], combine_dtype, int(num_experts))
        out = g.dispatch(x, topk_idx, topk_weights, x_scales=x_scales,
                         expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
        recv = (out.recv_x, out.recv_x_scales) if x_scales is not None else out.recv_x
        counts = [] if num_worst_tokens else out.num_recv_tokens_per_expert
        return (recv, out.recv_topk_idx, out.recv_topk_weights, counts,
                BufferHandle(out.handle, int(num_experts)), EventOverlap())

    def combine(self, x: Array, handle: BufferHandle, topk_weights: Array = None,
                bias: Array = None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """(combined_x, combined_topk_weights, event)."""
        if bias is None:
            bias_0 = bias_1 = None
        elif isinstance(bias, tuple):
            if len(bias) > 2:
                raise InvalidArgument("bias takes at most two tensors")
            bias_0, bias_1 = (*bias, None, None)[:2]
        else:
            bias_0, bias_1 = bias, None
        g = handle.handle.group
        cx, cw = g.combine(x, handle.handle, topk_weights=topk_weights, bias_0=bias_0,
                           bias_1=bias_1)
        return cx, cw, EventOverlap()

    # -- low-latency mode --------------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Nothing to clean: the daemon's low-latency buffers need no zeroing between modes."""
        return None

    def low_latency_dispatch(self, x: Array, topk_idx: Array, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Array = None,
                             dispatch_wait_recv_cost_stats: Array = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """(recv_x, recv_count, handle, event, hook). recv_x is
        `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` (bf16), or
        with use_fp8 a tuple (e4m3 x, float32 scales `[..., hidden // 128]`); recv_count is
        int32 `[num_local_experts]`. With return_recv_hook, hook is the receive half: on the
        cuda backend calling it makes the current stream wait for the data (stream-ordered
        path); on the cpu backend the data has arrived already and it does nothing. Else None."""
        x_shape, x_dtype = T.meta(x, "x")
        idx_shape, _ = T.meta(topk_idx, "topk_idx")
        if len(x_shape) != 2 or len(idx_shape) != 2:
            raise InvalidArgument(f"x and topk_idx must be 2-D, got shapes {list(x_shape)} and "
                                  f"{list(idx_shape)}")
        g = self._group(x_shape[1], idx_shape[1], x_dtype, int(num_experts),
                        low_latency_tokens=int(num_max_dispatch_tokens_per_rank))
        if self._stream_ordered(x, return_recv_hook):
            key = ("dispatch", g.group_id, _ptr(x), x_shape, _ptr(topk_idx), idx_shape,
                   int(num_max_dispatch_tokens_per_rank), use_fp8, round_scale, use_ue8m0,
                   _ptr(cumulative_local_expert_recv_stats))
            op = self._stream_ops.get(key)
            if op is None:
                op = self._stream_ops[key] = g.arm_low_latency_dispatch(
                    x, topk_idx, int(num_max_dispatch_tokens_per_rank), use_fp8=use_fp8,
                    round_scale=round_scale, use_ue8m0=use_ue8m0,
                    cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                    timeout=self.timeout)
            hook = self._trigger(op, return_recv_hook)
            res = op.result
            recv = (res.recv_x, res.recv_x_scales) if use_fp8 else res.recv_x
            return recv, res.recv_count, LowLatencyBufferHandle(op, x), EventOverlap(), hook
        out = g.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts=int(num_experts),
            use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
            timeout=self.timeout)
        recv = (out.recv_x, out.recv_x_scales) if use_fp8 else out.recv_x
        hook = _no_op_hook if return_recv_hook else None
        return (recv, out.recv_count, LowLatencyBufferHandle(out.handle, x), EventOverlap(),
                hook)

    def low_latency_combine(self, x: Array, topk_idx: Array, topk_weights: Array,
                            handle: LowLatencyBufferHandle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Array = None,
                            combine_wait_recv_cost_stats: Array = None):
        """(combined_x, event, hook): combined_x `[num_tokens, hidden]` bf16, the weighted sum
        of each token's expert outputs; written into `out` (and returned) when given."""
        g = handle.handle.group
        if isinstance(handle.handle, StreamOp):  # a stream-ordered dispatch: so is its combine
            key = ("combine", handle.handle.op_id, _ptr(x), _ptr(topk_idx), _ptr(topk_weights),
                   _ptr(out))
            op = self._stream_ops.get(key)
            if op is None:
                op = self._stream_ops[key] = g.arm_low_latency_combine(
                    x, topk_idx, topk_weights, handle.handle, out=out, timeout=self.timeout)
            hook = self._trigger(op, return_recv_hook)
            return op.result, EventOverlap(), hook
        cx = g.low_latency_combine(x, topk_idx, topk_weights, handle.handle, out=out,
                                   timeout=self.timeout)
        return cx, EventOverlap(), _no_op_hook if return_recv_hook else None

    # -- stream-ordered low-latency calls (cuda backend) -------------------------------------
    def _stream_ordered(self, x: Array, return_recv_hook: bool) -> bool:
        """CUDA graphs being captured, or a receive hook asked for, take the stream-ordered
        path (client/stream_ops.py) where the session's memory has one (cuda): nothing waits
        on the host, the hook is the wait."""
        mem = self.session.memory
        return mem.supports_stream_ops and (return_recv_hook or mem.is_capturing(x))

    @staticmethod
    def _trigger(op: StreamOp, return_recv_hook: bool):
        op.signal()
        if return_recv_hook:
            return op.wait  # the receive half, on the stream current when it is called
        op.wait()
        return None

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyBufferHandle) -> Array:
        """A `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` buffer
        to write expert outputs into; it lives in a region the daemon already maps, so passing
        it to `low_latency_combine` costs no staging copy. One buffer per shape, reused."""
        h = handle.handle
        spec = h.group.spec
        shape = (spec.num_experts // spec.num_ranks,
                 spec.num_ranks * h.num_max_dispatch_tokens_per_rank, spec.hidden)
        key = (h.group.group_id, shape, T.is_torch(handle.template))
        buf = self._combine_buffers.get(key)
        if buf is None:
            buf = self._combine_buffers[key] = self.session.empty(
                shape, dtypes.to_numpy(spec.x_dtype), like=handle.template)
        return buf

    def destroy(self) -> None:
        """Leave every group and close the session (idempotent)."""
        for g in self._groups.values():
            if not g._left:
                g.leave()
        self._groups.clear()
        if self._owns_session:
            self.session.close()

    def __del__(self) -> None:
        if not getattr(self, "explicitly_destroy", True):
            with contextlib.suppress(Exception):
                self.destroy()
