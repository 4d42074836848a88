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
the CPU backend; the handle is an opaque object rather than a tuple of tensors.

The daemon group behind a Buffer is formed lazily at the first call, from the call's shapes
(hidden, top-k, dtype, number of experts), so one Buffer serves several layer shapes.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from epd.client import tensors as T
from epd.client.session import Group, Handle, Session
from epd.proto import dtypes


class EventOverlap:
    """DeepEP's event wrapper. Calls here return when their results are ready, so waiting is a
    no-op; the object exists so that code using it runs unchanged."""

    def __init__(self, event: Any = None) -> None:
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


class Buffer:
    num_sms: int = 20

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, *, rank: int | None = None,
                 num_ranks: int | None = None, endpoint: str | None = None,
                 socket_dir: str | None = None, engine: int | None = None,
                 group_name: str = "deep_ep", max_tokens_per_rank: int = 4096,
                 timeout: float | None = None, session: Session | None = None) -> None:
        if low_latency_mode:
            raise NotImplementedError("low-latency mode is not available yet in EPD; use the "
                                      "normal-mode dispatch/combine")
        if group is not None:
            rank, num_ranks = group.rank(), group.size()
        if rank is None or num_ranks is None:
            raise ValueError("Buffer needs a torch.distributed group, or rank= and num_ranks=")
        self.rank, self.group_size = int(rank), int(num_ranks)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
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
        self._groups: dict[tuple, Group] = {}
        self._num_experts: int | None = None

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

    # -- groups ------------------------------------------------------------------------------
    def _group(self, hidden: int, num_topk: int, dtype: np.dtype, num_experts: int) -> Group:
        key = (hidden, num_topk, dtype.str, num_experts)
        g = self._groups.get(key)
        if g is None:
            name = f"{self.group_name}/h{hidden}-k{num_topk}-{dtype.name}-e{num_experts}"
            g = self.session.join(name, rank=self.rank, num_ranks=self.group_size,
                                  num_experts=num_experts, hidden=hidden,
                                  max_tokens_per_rank=self.max_tokens_per_rank,
                                  num_topk=num_topk, dtype=dtypes.name(dtypes.from_numpy(dtype)),
                                  timeout=self.timeout)
            self._groups[key] = g
        return g

    # -- the DeepEP API ----------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: Any, num_experts: int,
                            previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank, num_tokens_per_rdma_rank=None, num_tokens_per_expert,
        is_token_in_rank, event)."""
        self._num_experts = num_experts
        idx_shape, _ = T.meta(topk_idx, "topk_idx")
        # Layout needs a group only for the engine round trip; any hidden size will do, so use
        # the one of the last dispatch group with this routing shape, or a small layout group.
        g = next((g for (h, k, d, e), g in self._groups.items()
                  if k == idx_shape[1] and e == num_experts), None)
        if g is None:
            g = self._group(128, idx_shape[1], dtypes.BFLOAT16, num_experts)
        per_rank, per_expert, in_rank = g.get_dispatch_layout(topk_idx)
        return per_rank, None, per_expert, in_rank, EventOverlap()

    def dispatch(self, x: Any, handle: BufferHandle | None = None,
                 num_tokens_per_rank: Any = None, num_tokens_per_rdma_rank: Any = None,
                 is_token_in_rank: Any = None, num_tokens_per_expert: Any = None,
                 topk_idx: Any = None, topk_weights: Any = None, expert_alignment: int = 1,
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
                raise ValueError("cached dispatch (handle given) takes no topk_idx/topk_weights")
            g = handle.handle.group
            out = g.dispatch(x, x_scales=x_scales, handle=handle.handle,
                             expert_alignment=expert_alignment,
                             num_worst_tokens=num_worst_tokens)
            recv = (out.recv_x, out.recv_x_scales) if x_scales is not None else out.recv_x
            return recv, None, None, None, None, EventOverlap()
        if topk_idx is None or topk_weights is None:
            raise ValueError("dispatch needs topk_idx and topk_weights (or a cached handle)")
        num_experts = (len(num_tokens_per_expert) if num_tokens_per_expert is not None
                       else self._num_experts)
        if num_experts is None:
            raise ValueError("pass num_tokens_per_expert (from get_dispatch_layout) so the "
                             "number of experts is known")
        idx_shape, _ = T.meta(topk_idx, "topk_idx")
        combine_dtype = dtypes.BFLOAT16 if x_scales is not None else x_dtype
        g = self._group(x_shape[1], idx_shape[1], combine_dtype, int(num_experts))
        out = g.dispatch(x, topk_idx, topk_weights, x_scales=x_scales,
                         expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
        recv = (out.recv_x, out.recv_x_scales) if x_scales is not None else out.recv_x
        counts = [] if num_worst_tokens else out.num_recv_tokens_per_expert
        return (recv, out.recv_topk_idx, out.recv_topk_weights, counts,
                BufferHandle(out.handle, int(num_experts)), EventOverlap())

    def combine(self, x: Any, handle: BufferHandle, topk_weights: Any = None,
                bias: Any = None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """(combined_x, combined_topk_weights, event)."""
        if bias is None:
            bias_0 = bias_1 = None
        elif isinstance(bias, tuple):
            if len(bias) > 2:
                raise ValueError("bias takes at most two tensors")
            bias_0, bias_1 = (*bias, None, None)[:2]
        else:
            bias_0, bias_1 = bias, None
        g = handle.handle.group
        cx, cw = g.combine(x, handle.handle, topk_weights=topk_weights, bias_0=bias_0,
                           bias_1=bias_1)
        return cx, cw, EventOverlap()

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
