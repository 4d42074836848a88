"""DeepEP V2's `ElasticBuffer` and `EPHandle` over an EPD daemon.

DeepEP 2.x (deep_ep 2.1.0; read at deepseek-ai/DeepEP@dd758ca, deep_ep/buffers/elastic.py and
tests/elastic/test_ep.py) folds normal and low-latency expert parallelism into one buffer:
`dispatch` returns `(recv_x, recv_topk_idx, recv_topk_weights, handle, event)` and `combine`
`(combined_x, combined_topk_weights, event)`, with a handle that carries the layout (prefix
sums per source rank and per local expert, each received row's global source index) and an
optional "expanded" layout (one row per token and local expert, grouped by expert and padded
to `expert_alignment`: the next grouped GEMM's input).

EPD's V1 facade (`client/buffer.py`) already runs the collective part: layout, dispatch with
exact or worst-case rows (`num_worst_tokens`), cached dispatch, combine with biases. This
module is the V2 shape over it: each V2 call is one V1 call plus tensor work on the same
stream (no torch synchronisation unless `do_cpu_sync`), so V2 callers get the daemon's
kernels and the V1 facade's stream semantics. Without `do_cpu_sync` the dispatch is V1's
worst-case one, which on the CUDA engine does not wait on the host for the receive count
either (its failure raises at a later call: client/stream_calls.py). It is still not
capturable in a CUDA graph (the engine launches a normal-mode call's kernels per call, not
per replay): a V2 caller that captures `do_cpu_sync=False` dispatches (DeepGEMM's mega-MoE
baseline) is refused with FAILED_PRECONDITION.

Rows arrive ordered by source rank, then source token (DeepEP's `deterministic=True` order,
which EPD gives always: its kernels place rows by prefix, not by atomics); the expanded layout
orders each expert's rows the same way.

What V2 has that this does not: Engram, pipeline-parallel send/recv, all-gather
reduce-scatter and CPU buffer bytes raise `Unsupported`; `num_qps`, `sl_idx`,
`previous_event_before_epilogue` and the hybrid-mode switches are accepted and change
nothing (the daemon chooses its transports). Combine's sum over ranks runs in EPD's order
(bias, then ranks ascending, in float32), where DeepEP V2 adds the ranks in the order of each
token's top-k slots: the same bf16 result unless a partial sum is inexact in float32. With
`allow_multiple_reduction=False` DeepEP sums an expanded combine's slots across ranks in
float32 and rounds once; here each rank's slots are rounded to bf16 before the ranks' sum
(the V1 combine carries bf16). `recv_topk_weights` are 0 where the expert is another rank's
(V1's), where V2 copies every weight. FP8 scales are one float32 (or packed UE8M0 int32) per
128 channels, V1's layouts, where V2 takes any number of packs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..proto.errors import FailedPrecondition, InvalidArgument
from . import deep_ep_compat as C
from . import elastic_expand, elastic_layout
from .buffer import Buffer
from .deep_ep_compat import Config, EventOverlap, Unsupported
from .frameworks import torch_if_loaded

Array = Any
BUFFER_ALIGNMENT = 2 << 20  # DeepEP V2's buffer sizes are multiples of 2 MiB
TMA_SF_ALIGNMENT = 4  # rows of a column-major scale tensor, padded to 16 bytes of float32


def _not_provided(feature: str) -> Any:
    """A method (of the class or an instance) that raises Unsupported naming `feature`."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise Unsupported(f"{feature}: DeepEP V2's experimental {feature} is not part of EPD "
                          f"(expert-parallel dispatch and combine only)")
    return staticmethod(refuse)


@dataclass(eq=False, kw_only=True)
class EPHandle:
    """What `ElasticBuffer.dispatch` returns for `combine` and for a cached dispatch; DeepEP
    V2's attributes (see its docstring), plus the V1 handle EPD's calls run on (`v1`).

    `recv_src_metadata` is `[num_recv_tokens, 2 + num_topk]` int32: column 0 the row's global
    source index (`src_rank * num_max_tokens_per_rank + src_token`), column 1
    `src_rank * num_topk + k` for the last top-k slot of the row that is local (DeepEP's
    master lane), columns 2... in expanded mode each slot's row in the expanded tensors (-1:
    not local), else -1. `dst_buffer_slot_idx` is `[num_tokens, num_topk]` int32, as DeepEP
    writes it: on the last slot of each destination rank, `this_rank * num_max_tokens_per_rank
    + i` where the token is the i-th this rank sends there; -1 on the other slots.
    `recv_topk_idx` is the handle's own copy of the received top-k ids: combine masks the
    weights with it, and a cached dispatch returns a copy (the caller may write the one it was
    given). A dataclass, so that run_on_streams records its tensors on the streams using them."""

    v1: Any
    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: Array
    num_recv_tokens: int  # exact with do_cpu_sync, else the worst case
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: list[int]
    psum_num_recv_tokens_per_scaleup_rank: Array
    psum_num_recv_tokens_per_expert: Array
    num_unaligned_recv_tokens_per_expert: Array
    recv_src_metadata: Array
    dst_buffer_slot_idx: Array
    recv_topk_idx: Array
    token_metadata_at_forward: Array = None  # (DeepEP's hybrid mode only)
    channel_linked_list: Array = None
    cached_recv_src_metadata_before_sort: Array = None

    @property
    def worst_rows(self) -> int:
        """The dispatch's num_worst_tokens: 0 when its rows were counted on the host (the CPU
        sync, whose per-expert list is never empty), else its worst case's rows."""
        return 0 if self.num_recv_tokens_per_expert_list else self.num_recv_tokens


class ElasticBuffer:
    """DeepEP V2's `deep_ep.ElasticBuffer` over an EPD daemon (see the module docstring).

    Constructor arguments are DeepEP's, in its order; `num_max_tokens_per_rank` is the
    capacity the daemon's groups start with (they grow beyond it, as the V1 facade's do).
    EPD's keyword-only arguments (`rank`, `num_ranks`, `endpoint`, `socket_dir`, `engine`,
    `group_name`, `timeout`, `session`, `service_class`) are the V1 `Buffer`'s."""

    def __init__(self, group: Any = None, num_bytes: int | None = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300,
                 num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False,
                 **epd: Any) -> None:
        if num_cpu_bytes:
            raise Unsupported("num_cpu_bytes: CPU buffer bytes are for DeepEP's Engram "
                              "storage, which EPD does not provide")
        if num_max_tokens_per_rank < 0:
            raise InvalidArgument(f"num_max_tokens_per_rank must be >= 0, got "
                                  f"{num_max_tokens_per_rank}")
        epd.setdefault("timeout", float(num_cpu_timeout_secs))
        # (DeepEP's C++ runtime: here the V1 facade, None after destroy, as there)
        self.runtime: Buffer | None = Buffer(
            group, int(num_bytes or 0), 0, explicitly_destroy=explicitly_destroy,
            max_tokens_per_rank=num_max_tokens_per_rank or None, **epd)
        b = self.runtime
        if b.session.memory.supports_stream_ops:  # (CUDA tensors: the V2 kernels' calls)
            # The V2 kernels loaded now: loading waits for the context's running work, which
            # must not happen inside a call (cuda_driver.load_function).
            elastic_layout.load(b.session.device_ordinal)
            elastic_expand.load(b.session.device_ordinal)
        self.group = group
        self.rank_idx, self.num_ranks = b.rank, b.group_size
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic  # (EPD's order is DeepEP's deterministic one)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_bytes = int(num_bytes) if num_bytes is not None else _size_hint(
            self.num_ranks, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch)
        self.num_allocated_qps = num_allocated_qps or 17
        self.sl_idx = sl_idx
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        self.explicitly_destroy = explicitly_destroy
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank_idx
        self.num_rdma_ranks, self.num_nvlink_ranks = 1, self.num_ranks

    # -- DeepEP V2's helpers -----------------------------------------------------------------
    def destroy(self) -> None:
        """Leave the daemon's groups and close the session (idempotent)."""
        if self.runtime is not None:
            self.runtime.destroy()
            self.runtime = None

    @staticmethod
    def get_buffer_size_hint(group: Any, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False,
                             allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """A 2 MiB-aligned byte count for these settings: the bytes a rank's receive side
        holds at most. EPD's daemon owns and sizes its buffers, so this only answers callers
        that compare it with `num_bytes` to decide whether to rebuild their buffer."""
        return _size_hint(group.size(), num_max_tokens_per_rank, hidden, num_topk,
                          use_fp8_dispatch)

    @staticmethod
    def capture() -> C.EventHandle:
        """An event on the current stream, for `previous_event` (V2 returns the EventHandle;
        an EventOverlap is taken too)."""
        return Buffer.capture().event

    def get_comm_stream(self) -> Any:
        return self._live().get_comm_stream()

    def get_physical_domain_size(self) -> tuple[int, int]:
        """(RDMA ranks, NVLink ranks): one NVLink domain of every rank."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        """(scale-out ranks, scale-up ranks): one scale-up domain of every rank."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, *args: Any,
                                **kwargs: Any) -> int:
        """The SM count EPD's kernels are asked for by default (`Buffer.num_sms`); the daemon
        bounds every request by its own policy."""
        return int(Buffer.num_sms)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        return min(num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 9),
                   self.num_allocated_qps)

    def _live(self) -> Buffer:
        if self.runtime is None:
            raise FailedPrecondition("this ElasticBuffer was destroyed")
        return self.runtime

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False,
                sequential: bool = True) -> None:
        """Every rank reaches this point: a collective through the torch.distributed group."""
        if self.group is None:
            raise Unsupported("barrier needs the torch.distributed group the buffer was built "
                              "with")
        self.group.barrier()

    # DeepEP V2's experimental features beside EP: refused, naming the feature.
    engram_write = engram_fetch = get_engram_storage_size_hint = _not_provided("Engram")
    pp_set_config = pp_send = pp_recv = get_pp_buffer_size_hint = _not_provided(
        "pipeline-parallel send/recv")
    all_gather = create_agrs_session = destroy_agrs_session = agrs_new_session = \
        agrs_set_config = agrs_get_inplace_tensor = get_agrs_num_max_session_bytes = \
        get_agrs_buffer_size_hint = _not_provided("all-gather reduce-scatter")

    # -- dispatch and combine ----------------------------------------------------------------
    def dispatch(self, x: Array, topk_idx: Array = None, topk_weights: Array = None,
                 cumulative_local_expert_recv_stats: Array = None,
                 num_experts: int | None = None, num_max_tokens_per_rank: int | None = None,
                 expert_alignment: int | None = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: EventOverlap | None = None,
                 previous_event_before_epilogue: EventOverlap | None = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: EPHandle | None = None, do_handle_copy: bool = True,
                 do_cpu_sync: bool | None = None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """(recv_x, recv_topk_idx, recv_topk_weights, handle, event), as DeepEP V2's. recv_x is
        an (e4m3 x, scales) pair when x is. Without `do_cpu_sync` (and always with a handle)
        the outputs have the worst case's rows (`num_ranks * num_max_tokens_per_rank`, or the
        expanded worst case) and `handle.psum_num_recv_tokens_per_scaleup_rank[-1]` (on the
        device) says how many are received. In expanded mode recv_topk_idx is None and
        recv_topk_weights is `[rows]`."""
        b = self._live()
        previous_event = _overlap(previous_event)
        t = torch_if_loaded()
        if t is None:
            raise InvalidArgument("ElasticBuffer takes torch tensors (DeepEP V2's API)")
        cached = handle is not None
        if cached:
            if not isinstance(handle, EPHandle):
                raise InvalidArgument(f"handle must be an EPHandle a dispatch returned, got "
                                      f"{type(handle).__name__}")
            if topk_idx is not None:
                raise InvalidArgument("a cached dispatch (handle given) takes no topk_idx: it "
                                      "routes as the handle's dispatch did")
            if do_cpu_sync:
                raise InvalidArgument("a cached dispatch cannot do a CPU sync (do_cpu_sync)")
            given = (num_experts, expert_alignment, num_max_tokens_per_rank)
            own = (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
            if any(g is not None and g != o for g, o in zip(given, own, strict=True)):
                raise InvalidArgument(f"(num_experts, expert_alignment, "
                                      f"num_max_tokens_per_rank) {given} differ from the "
                                      f"handle's {own}")
            if do_expand != handle.do_expand:
                raise InvalidArgument(f"do_expand={do_expand}: the handle was made with "
                                      f"do_expand={handle.do_expand}")
            num_experts, expert_alignment = handle.num_experts, handle.expert_alignment
            num_max_tokens_per_rank = handle.num_max_tokens_per_rank
            topk_idx, do_cpu_sync = handle.topk_idx, False
        else:
            if topk_idx is None:
                raise InvalidArgument("dispatch needs topk_idx (or a cached handle)")
            if num_experts is None:
                raise InvalidArgument("dispatch needs num_experts (or a cached handle)")
            if num_max_tokens_per_rank is None:
                num_max_tokens_per_rank = self.num_max_tokens_per_rank
            expert_alignment = 1 if expert_alignment is None else int(expert_alignment)
            do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        num_experts, max_tokens = int(num_experts), int(num_max_tokens_per_rank)
        if expert_alignment < 1:
            raise InvalidArgument(f"expert_alignment must be >= 1, got {expert_alignment}")
        if num_experts <= 0 or num_experts % self.num_ranks:
            raise InvalidArgument(f"num_experts={num_experts} must be a positive multiple of "
                                  f"the {self.num_ranks} ranks")
        template = x[0] if isinstance(x, tuple) else x
        x_rows = int(template.shape[0])
        if max_tokens <= 0 or x_rows > max_tokens:
            raise InvalidArgument(f"num_max_tokens_per_rank={max_tokens} must be positive and "
                                  f"at least this rank's {x_rows} tokens (it numbers the "
                                  f"source rows: src_rank * num_max_tokens_per_rank + token)")
        if do_zero_padding and not do_expand:
            raise InvalidArgument("do_zero_padding is for the expanded layout (do_expand)")
        num_sms = int(num_sms) or self.get_theoretical_num_sms(num_experts, topk_idx.shape[1])
        config = Config(num_sms)
        worst = 0 if do_cpu_sync else self.num_ranks * max_tokens

        def call():
            # (inside run_on_streams: the V1 calls run on the stream current here, in order)
            if cached and topk_weights is None:
                recv_x, *_ = b.dispatch(x, handle=handle.v1,
                                        num_worst_tokens=handle.worst_rows, config=config)
                recv_idx, recv_w, v1, counts = handle.recv_topk_idx.clone(), None, handle.v1, None
            else:
                per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(topk_idx,
                                                                           num_experts)
                # (V1 dispatches weights with the ids; V2's are optional: zeros, not returned)
                weights = topk_weights if topk_weights is not None else t.zeros(
                    topk_idx.shape, dtype=t.float32, device=topk_idx.device)
                recv_x, recv_idx, recv_w, counts, v1, _ = b.dispatch(
                    x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                    num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                    topk_weights=weights, expert_alignment=expert_alignment,
                    num_worst_tokens=handle.worst_rows if cached else worst,
                    config=config)
                if topk_weights is None:
                    recv_w = None
                if cached:  # (weights given: dispatched anew, routed as the handle's call)
                    recv_idx, v1 = handle.recv_topk_idx.clone(), handle.v1
            if cached:
                h = handle
            else:
                h = self._handle(t, v1, recv_idx, counts, topk_idx, in_rank, num_experts,
                                 expert_alignment, max_tokens, num_sms, do_expand, do_cpu_sync,
                                 do_handle_copy)
                stats = cumulative_local_expert_recv_stats
                if stats is not None:  # (in place: the caller's running counts)
                    stats.add_(h.num_unaligned_recv_tokens_per_expert.to(stats.dtype))
            if do_expand:
                recv_x, recv_w = elastic_expand.spread(t, h.recv_src_metadata,
                                                        h.num_expanded_tokens, recv_x, recv_w)
                recv_idx = None
            recv_x = _with_scales_layout(t, recv_x, use_tma_aligned_col_major_sf)
            return recv_x, recv_idx, recv_w, h

        (recv_x, recv_idx, recv_w, h), event = C.run_on_streams(
            b.get_comm_stream, template, call, previous_event, async_with_compute_stream,
            _on_comm(previous_event, async_with_compute_stream, allocate_on_comm_stream),
            (x, topk_idx, topk_weights))
        return recv_x, recv_idx, recv_w, h, event

    def combine(self, x: Array, handle: EPHandle, topk_weights: Array = None,
                bias: Any = None, num_sms: int = 0, num_qps: int = 0,
                previous_event: EventOverlap | None = None,
                previous_event_before_epilogue: EventOverlap | None = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """(combined_x, combined_topk_weights, event), as DeepEP V2's: each token's rows summed
        over the ranks it went to, plus the bias(es); the top-k weights come back with each
        slot's weight from the rank that holds its expert (0 for a slot of -1). In expanded
        mode x has a row per expanded slot (summed per token here, in top-k order, before
        the ranks' sum) and topk_weights is `[rows]`."""
        b = self._live()
        if not isinstance(handle, EPHandle):
            raise InvalidArgument(f"handle must be an EPHandle a dispatch returned, got "
                                  f"{type(handle).__name__}")
        previous_event = _overlap(previous_event)
        t = torch_if_loaded()
        config = Config(int(num_sms) or handle.num_sms)

        def call():
            if handle.do_expand:
                y, w = elastic_expand.fold(t, handle.recv_src_metadata,
                                          handle.num_expanded_tokens, x, topk_weights)
            else:
                y, w = x, topk_weights
                if w is not None:  # (each slot's weight once: from the rank of its expert)
                    w = elastic_expand.local_weights(t, handle.recv_topk_idx, w)
            cx, cw, _ = b.combine(y, handle.v1, topk_weights=w, bias=bias, config=config)
            return cx, cw

        (cx, cw), event = C.run_on_streams(
            b.get_comm_stream, x, call, previous_event, async_with_compute_stream,
            _on_comm(previous_event, async_with_compute_stream, allocate_on_comm_stream),
            (x, topk_weights, bias))
        return cx, cw, event

    def _handle(self, t: Any, v1: Any, recv_idx: Array, counts: list[int] | None,
                topk_idx: Array, in_rank: Array, num_experts: int, alignment: int,
                max_tokens: int, num_sms: int, do_expand: bool, do_cpu_sync: bool,
                do_handle_copy: bool) -> EPHandle:
        """The V2 handle of a (non-cached) dispatch, computed on the device from the V1
        handle and the received top-k ids: no host synchronisation unless do_cpu_sync."""
        me, ranks = self.rank_idx, self.num_ranks
        local = num_experts // ranks
        rows, topk = int(recv_idx.shape[0]), int(recv_idx.shape[1])
        lay = elastic_layout.compute(t, v1.rank_prefix_matrix, v1.recv_src_idx, recv_idx,
                                     topk_idx, in_rank, me, ranks, num_experts, alignment,
                                     max_tokens, do_expand, do_handle_copy)
        if do_cpu_sync:  # (V1's list: the aligned counts, read on the host already)
            counts_list = list(counts)
            expanded = sum(counts_list)
        else:
            counts_list = []
            expanded = C._align_up(
                ranks * max_tokens * min(topk, local) + (alignment - 1) * local, alignment)
        return EPHandle(v1=v1, do_expand=do_expand, num_experts=num_experts,
                     expert_alignment=alignment, num_max_tokens_per_rank=max_tokens,
                     num_sms=num_sms, topk_idx=lay.topk_idx,
                     num_recv_tokens=rows, num_expanded_tokens=expanded,
                     num_recv_tokens_per_expert_list=counts_list,
                     psum_num_recv_tokens_per_scaleup_rank=lay.psum_ranks,
                     psum_num_recv_tokens_per_expert=lay.psum_experts,
                     num_unaligned_recv_tokens_per_expert=lay.unaligned,
                     recv_src_metadata=lay.meta, dst_buffer_slot_idx=lay.dst_slot,
                     recv_topk_idx=lay.recv_idx)


def _overlap(event: Any) -> EventOverlap | None:
    """A `previous_event` as V1's calls take it: V2 passes the EventHandle `capture()` gives."""
    return EventOverlap(event) if isinstance(event, C.EventHandle) else event


def _on_comm(previous_event: Any, async_: bool, allocate_on_comm_stream: bool) -> bool:
    """V2's stream rule: `previous_event` comes with `allocate_on_comm_stream`, with or
    without `async_with_compute_stream` (V1 asks for async_finish too); a call that is not
    async runs on the current stream, where allocating on the comm stream means nothing."""
    if previous_event is not None and not allocate_on_comm_stream:
        raise InvalidArgument("previous_event needs allocate_on_comm_stream=True (as in "
                              "DeepEP V2)")
    # (V1's run_on_streams asks for previous_event with it; V2 does not: the flag only
    # names where the outputs are allocated, the comm stream, which an async call uses anyway)
    return allocate_on_comm_stream and async_ and previous_event is not None


def _size_hint(ranks: int, max_tokens: int, hidden: int, topk: int, fp8: bool) -> int:
    """Receive-side bytes at most: every rank's tokens, each row with its scales, top-k ids
    and weights and its metadata."""
    row = hidden * (1 if fp8 else 2) + (math.ceil(hidden / 128) * 4 if fp8 else 0) \
        + topk * (8 + 4 + 4) + 8
    return C._align_up(max(ranks * max_tokens * row, 1), BUFFER_ALIGNMENT)


def _with_scales_layout(t: Any, recv_x: Any, col_major: bool) -> Any:
    """(x, scales) with the scales column-major, rows padded to 4 (DeepEP's TMA-aligned
    layout for the next GEMM) when asked for."""
    if not col_major or not isinstance(recv_x, tuple):
        return recv_x
    data, sf = recv_x
    n, packs = sf.shape
    out = t.empty_strided((n, packs), (1, C._align_up(max(n, 1), TMA_SF_ALIGNMENT)),
                          dtype=sf.dtype, device=sf.device)
    out.copy_(sf)
    return data, out


def get_physical_domain_size(group: Any) -> tuple[int, int]:
    """DeepEP V2's `deep_ep.get_physical_domain_size`: (RDMA ranks, NVLink ranks), one
    domain of every rank (the daemon moves rows between its engines)."""
    return 1, int(group.size())


def get_logical_domain_size(group: Any, allow_hybrid_mode: bool = True) -> tuple[int, int]:
    """DeepEP V2's `deep_ep.get_logical_domain_size`: (scale-out ranks, scale-up ranks)."""
    return 1, int(group.size())
