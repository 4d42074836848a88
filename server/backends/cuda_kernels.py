"""Compile and launch EPD's intranode CUDA kernels (cuda/epd_intranode.cu) on CuPy arrays.

The engine-facing contract is small:

* `RankBufferLayout` says how many bytes of symmetric heap one group-rank's kernel buffers need
  and at which offset each sub-buffer lives (identical on every rank, so a peer's sub-buffer is
  `peer_base + offset`); `cuda_plan.membership_layout(spec)` is the one place it is built;
* `Kernels` compiles the module once per process (NVRTC through `cupy.RawModule`; CuPy's disk
  cache, `CUPY_CACHE_DIR`, makes a warm start skip the compile) and exposes one launch method
  per kernel taking CuPy arrays, raw device pointers and a stream;
* `DispatchHandle` holds the per-dispatch device state that combine and cached dispatch reuse.

Kernels address peers through a device table of R buffer base pointers (`peers`), so several
ranks on one GPU (different offsets of one heap) and one rank per GPU (NVSHMEM peer pointers)
look the same to them. docs/GPU_NOTES.md describes the design.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...proto import cuda_driver, kernel_sources
from ...proto.abi import (  # noqa: F401  (re-exported: the driver's names for the ABI)
    ALIGN,
    CTRL_ABORT,
    CTRL_ERR_CODE,
    CTRL_ERR_PHASE,
    CTRL_ERR_RANK,
    CTRL_ERR_SEQ,
    CTRL_PAYLOAD_BYTES,
    DATA_THREADS,
    DEFAULT_NUM_SMS,
    ERR_ABORTED,
    ERR_BAD_INPUT,
    ERR_CAPACITY,
    ERR_DEADLINE,
    ERR_REFUSED,
    ERR_WORST_OVERFLOW,
    ERROR_NAMES,
    FP8_BLOCK,
    LL_HIST_VERDICT,
    LL_MAX_EXPERTS,
    LL_MAX_LOCAL_EXPERTS,
    LL_MAX_RANKS,
    LL_RING_HEAD,
    LL_RING_TAIL,
    LL_THREADS,
    LL_TOPK_HEADER,
    MAX_RANKS,
    MAX_TOPK,
    NOTIFY_HEAD,
    NOTIFY_THREADS,
    PHASE_NAMES,
    WIDE_PAYLOAD_BYTES,
)

try:  # CuPy is optional: the CPU-only install imports this module for the layout helper.
    import cupy as cp
except ImportError:  # pragma: no cover - exercised on machines without CuPy
    cp = None


def _align(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class RankBufferLayout:
    """Byte offsets of the sub-buffers of one group-rank's buffer (the same on every rank)."""

    num_ranks: int
    num_local_experts: int
    hidden: int
    num_topk: int
    max_recv: int        # rows a rank can receive: R * max_tokens_per_rank
    x_itemsize: int      # dispatched payload element size
    y_itemsize: int      # combine element size (bf16 when the payload is fp8)
    with_scales: bool
    offsets: dict[str, int] = field(default_factory=dict)
    total_bytes: int = 0
    notify_only: bool = False  # the control block alone (build)

    @classmethod
    def build(cls, *, num_ranks: int, num_experts: int, hidden: int, num_topk: int,
              max_tokens_per_rank: int, x_itemsize: int, y_itemsize: int,
              with_scales: bool, low_latency_only: bool = False,
              remote: bool = False, notify_only: bool = False) -> RankBufferLayout:
        """`low_latency_only`: a low-latency group of more ranks than the normal-mode kernels
        take (up to LL_MAX_RANKS): the control block alone, no normal-mode buffers. `remote`:
        with `net_send`, the staging of puts to ranks on other nodes (a dispatch's rows and
        scales, or a combine's rows and weights: the same stream, so one region).
        `notify_only`: the control block (notify's payload) alone, `max_recv` kept for notify's
        capacity check: a two-stage hierarchical group's whole-group notify (its rows move in
        the stage groups' buffers, cuda_stages.py)."""
        # (a notify-only slot of more ranks: epd_wide_notify, a two-stage group's notify)
        limit = LL_MAX_RANKS if low_latency_only or notify_only else MAX_RANKS
        if not 1 <= num_ranks <= limit:
            raise ValueError(f"num_ranks must lie in [1, {limit}] for "
                             f"{'low-latency' if low_latency_only else 'intranode'} kernels")
        if num_experts % num_ranks:
            raise ValueError("num_experts must be a multiple of num_ranks")
        if not 1 <= num_topk <= MAX_TOPK:
            raise ValueError(f"num_topk must lie in [1, {MAX_TOPK}]")
        local = num_experts // num_ranks
        max_recv = num_ranks * max_tokens_per_rank
        scale_cols = hidden // FP8_BLOCK if with_scales else 0
        if low_latency_only:
            max_recv = scale_cols = 0
        rows = 0 if notify_only else max_recv  # rows of the data buffers
        if low_latency_only:
            ctrl = CTRL_PAYLOAD_BYTES
        elif num_ranks > MAX_RANKS:  # (notify_only) epd_wide_notify's flags and payloads
            ctrl = WIDE_PAYLOAD_BYTES + num_ranks * (num_ranks + 4 + local) * 4
        else:
            ctrl = CTRL_PAYLOAD_BYTES + MAX_RANKS * (NOTIFY_HEAD + local) * 4
        sizes = [
            ("ctrl", ctrl),
            ("recv_x", rows * hidden * x_itemsize),
            ("recv_x_scales", rows * scale_cols * 4),
            ("recv_topk_idx", rows * num_topk * 8),
            ("recv_topk_weights", rows * num_topk * 4),
            ("recv_src_idx", rows * 4),
            ("recv_src_rank", rows * 4),
            ("stage_y", rows * hidden * y_itemsize),
            ("stage_w", rows * num_topk * 4),
        ]
        if remote and not low_latency_only and not notify_only:
            x_row, y_row = hidden * x_itemsize, hidden * y_itemsize
            sizes.append(("net_send", 16 + max(
                max_tokens_per_rank * (x_row + scale_cols * 4),
                max_recv * (y_row + num_topk * 4))))
        offsets: dict[str, int] = {}
        cur = 0
        for name, size in sizes:
            offsets[name] = cur
            cur += _align(max(size, 16))
        return cls(num_ranks, local, hidden, num_topk, max_recv, x_itemsize, y_itemsize,
                   with_scales, offsets, cur, notify_only)

    def views(self, base_ptr: int, owner: Any, device_id: int, x_dtype: Any,
              y_dtype: Any) -> dict[str, Any]:
        """CuPy views of this rank's own sub-buffers (full capacity; slice to the counts)."""
        def view(name: str, shape: tuple[int, ...], dtype: Any) -> Any:
            dt = np.dtype(dtype)
            n = int(np.prod(shape)) * dt.itemsize
            mem = cp.cuda.UnownedMemory(base_ptr + self.offsets[name], max(n, 1), owner,
                                        device_id)
            return cp.ndarray(shape, dt, memptr=cp.cuda.MemoryPointer(mem, 0))

        n, k, h = self.max_recv, self.num_topk, self.hidden
        ctrl = view("ctrl", (CTRL_PAYLOAD_BYTES // 8,), np.uint64)
        if self.notify_only:
            return {"ctrl": ctrl}
        out = {
            "ctrl": ctrl,
            "recv_x": view("recv_x", (n, h), x_dtype),
            "recv_topk_idx": view("recv_topk_idx", (n, k), np.int64),
            "recv_topk_weights": view("recv_topk_weights", (n, k), np.float32),
            "recv_src_idx": view("recv_src_idx", (n,), np.int32),
            "recv_src_rank": view("recv_src_rank", (n,), np.int32),
            "stage_y": view("stage_y", (n, h), y_dtype),
        }
        if self.with_scales:
            out["recv_x_scales"] = view("recv_x_scales", (n, h // FP8_BLOCK), np.float32)
        return out


@dataclass(frozen=True)
class LowLatencyLayout:
    """Low-latency buffers of one group-rank (cuda/epd_low_latency.cu), at byte offsets from
    the rank's buffer base, placed from `start`. Sized for `max_tokens` rows per source.
    `remote`: the group has ranks on other nodes, reached through NVSHMEM puts, whose sources
    are staging areas of this buffer (send_x, send_scales: a dispatch row per token; send_y:
    a combine row per received row), as big again as one receive buffer.

    Two receive buffers (DeepEP's double buffer), so that two micro-batches can be in flight
    (D0 D1 C0 C1): what a dispatch fills and its combine reads back (`PER_BUFFER`) exists twice,
    `buffer_stride` bytes apart; the sources' histograms and the combine's
    landing rows (combines run one after the other) are shared. The kernels take every offset
    as an argument, so a launch picks its buffer by the offsets it is given (`offset`)."""

    PER_BUFFER = ("recv_x", "scales", "src_rank", "src_idx", "src_k", "recv_count", "topk")

    num_ranks: int
    num_local_experts: int
    hidden: int
    num_topk: int
    max_tokens: int
    itemsize: int
    offsets: dict[str, int] = field(default_factory=dict)  # buffer 0's, and the shared ones
    end: int = 0
    buffer_stride: int = 0

    @classmethod
    def build(cls, start: int, *, num_ranks: int, num_local_experts: int, hidden: int,
              num_topk: int, max_tokens: int, itemsize: int,
              remote: bool = False) -> LowLatencyLayout:
        r, lx, h, k, m = num_ranks, num_local_experts, hidden, num_topk, max_tokens
        if lx > LL_MAX_LOCAL_EXPERTS:
            raise ValueError(f"low-latency mode supports at most {LL_MAX_LOCAL_EXPERTS} local "
                             f"experts per rank")
        if r > LL_MAX_RANKS or lx * r > LL_MAX_EXPERTS:
            raise ValueError(f"low-latency mode supports at most {LL_MAX_RANKS} ranks and "
                             f"{LL_MAX_EXPERTS} experts per group (LL_MAX_RANKS, "
                             f"LL_MAX_EXPERTS)")
        rows = lx * r * m
        per_buffer = {"recv_x": rows * h * itemsize,  # FP8 calls use its first rows * h bytes
                      "scales": rows * max(h // FP8_BLOCK, 1) * 4,
                      "src_rank": rows * 4, "src_idx": rows * 4, "src_k": rows * 4,
                      "recv_count": lx * 4, "topk": LL_TOPK_HEADER + m * k * 8}
        offsets, cur = {}, _align(start)
        # [R][L*R + LL_HIST_VERDICT] int32: every source's rows per expert, and its verdict
        offsets["hist"] = cur
        cur += _align(r * (r * lx + LL_HIST_VERDICT) * 4)
        first = cur
        for name in cls.PER_BUFFER:
            offsets[name] = cur
            cur += _align(max(per_buffer[name], 16))
        stride = cur - first
        cur += stride  # buffer 1
        shared = [("comb", m * k * h * itemsize), ("combined_x", m * h * itemsize)]
        if remote:
            shared += [("send_x", m * h * itemsize),
                       ("send_scales", m * max(h // FP8_BLOCK, 1) * 4),
                       ("send_y", rows * h * itemsize)]
        for name, size in shared:
            offsets[name] = cur
            cur += _align(max(size, 16))
        return cls(r, lx, h, k, m, itemsize, offsets, cur, stride)

    def offset(self, name: str, buffer: int = 0) -> int:
        """Byte offset of a buffer; the receive buffers exist twice (0 and 1)."""
        if buffer and name in self.PER_BUFFER:
            return self.offsets[name] + buffer * self.buffer_stride
        return self.offsets[name]


@dataclass
class DispatchHandle:
    """Device state of one dispatch, reused by combine and by cached dispatch."""

    num_tokens: int
    token_mask: Any      # [T] uint8, bit d: token goes to rank d
    pos: Any             # [T, R] int32 row within the (this rank -> d) block, -1 if not sent
    count_matrix: Any    # [R, R] int32 tokens s -> d
    rank_prefix: Any     # [R, R] int32 rows from sources <= s on d (DeepEP rank_prefix_matrix)
    recv_info: Any       # [4 + L] int32: num_recv, status, missing rank, 0, per-expert counts
    # Hierarchical normal mode (num_nodes > 1: a group over nodes placed node-major; the top
    # of cuda/epd_intranode.cu): rows on every destination in the order (local index, node),
    # recv_src_idx the forwarder's rail row, a rounded partial sum per node in combine.
    num_nodes: int = 1
    node_pos: Any = None   # [T, N] int32 my tokens before t with an expert on node b, or -1
    node_base: Any = None  # [R] int32 the rail rows before source s's at its forwarder here

    @staticmethod
    def nbytes_for(num_tokens: int, num_ranks: int, num_local_experts: int,
                   num_nodes: int = 1) -> int:
        """The device bytes `allocate` takes for these sizes (the engine's handle budget),
        each array rounded up as CuPy's memory pool rounds an allocation (512 bytes)."""
        r, t = num_ranks, max(num_tokens, 1)
        sizes = [t, 4 * t * r, 4 * r * r, 4 * r * r, 4 * (4 + num_local_experts)]
        if num_nodes > 1:
            sizes += [4 * t * num_nodes, 4 * r]
        return sum(-(-n // 512) * 512 for n in sizes)

    @classmethod
    def allocate(cls, num_tokens: int, num_ranks: int, num_local_experts: int,
                 num_nodes: int = 1) -> DispatchHandle:
        r, t = num_ranks, max(num_tokens, 1)
        hier = num_nodes > 1
        return cls(num_tokens, cp.empty(t, cp.uint8), cp.empty((t, r), cp.int32),
                   cp.empty((r, r), cp.int32), cp.empty((r, r), cp.int32),
                   cp.empty(4 + num_local_experts, cp.int32), max(num_nodes, 1),
                   cp.empty((t, num_nodes), cp.int32) if hier else None,
                   cp.empty(r, cp.int32) if hier else None)


KERNEL_FILES = ("epd_layout.cu", "epd_intranode.cu", "epd_low_latency.cu")


def _source(files: tuple[str, ...] = KERNEL_FILES) -> str:
    """The kernel sources with their header inlined once (proto/kernel_sources.py)."""
    return kernel_sources.source(files)


def _stream_ptr(stream: Any) -> Any:
    return stream if stream is not None else cp.cuda.get_current_stream()


def _addr(a: Any) -> int:
    """A device address for a packed argument: an array's, an int as given, None as 0."""
    if a is None:
        return 0
    if isinstance(a, int | np.integer):
        return int(a)
    return int(a.data.ptr)


def _handle_of(stream: Any) -> int:
    return int(stream.ptr if stream is not None else cp.cuda.get_current_stream().ptr)


def _function_of(fn: Any) -> int:
    """The driver function of a kernel: a CuPy RawKernel's loaded `kernel`, or a linked
    kernel's handle (cuda_remote.LinkedKernel)."""
    return int(fn.kernel.ptr if hasattr(fn, "kernel") else fn.ptr)


class Packed:
    """A kernel launch whose arguments are packed by one `struct.pack_into` into a fixed
    buffer the driver reads through a fixed `void*` array (the driver copies the values at the
    launch, so the buffer is reused at once). The normal-mode launches take new addresses and
    sizes every call, so unlike `Launch` nothing is kept between calls but the layout: CuPy's
    conversion costs ~1 µs per argument (a dispatch has 31), this a few µs per launch, and
    less of it with the GIL held (the engine's threads share it). Not thread-safe: one per
    thread (`Kernels._packed`). `fmt`: struct codes in the kernel's parameter order."""

    def __init__(self, fn: Any, fmt: str) -> None:
        self._fn = _function_of(fn)
        self._args = cuda_driver.PackedArguments(fmt)

    def __call__(self, grid: int, block: int, shared: int, stream: int, *values: int) -> None:
        cp.cuda.driver.launchKernel(self._fn, grid, 1, 1, block, 1, 1, shared, stream,
                                    self._args.pack(*values), 0)


# Parameter codes of the normal-mode kernels (cuda/epd_intranode.cu): Q a pointer or u64,
# q i64, i int. tests/test_kernel_layouts.py checks them against the kernels' signatures.
LAYOUT_ARGS = kernel_sources.LAYOUT_ARGS
NOTIFY_ARGS = "QiiiiiQQqiiQQQQQQQQQQQQiQQiiQi"
WIDE_NOTIFY_ARGS = "QiiiiiQQqiiQQQQQi"
STAGE_ERRORS_ARGS = "QiQQi"
DISPATCH_ARGS = "QqqQqqQQiiiiiQQQQQqqqqqqiiiiQqqQiQQ"
COMBINE_PUSH_ARGS = "QqqQqiiiQQQQqqiQqqi"
COMBINE_REDUCE_ARGS = "QqQqQqQqQQqiiiiiQQQQQqqQqiQ"
COMBINE_REFUSED_ARGS = "QiiQqQ"


def _trait_for(dtype: Any) -> str:
    dt = np.dtype(dtype)
    if dt.itemsize == 4 and dt.kind == "f":
        return "F32"
    if dt == np.float16:
        return "F16"
    if dt.itemsize == 2:
        return "Bf16"
    raise ValueError(f"combine supports bf16, fp16 and fp32, got {dt}")


class Kernels:
    """The compiled module for the current device; one instance per process is enough."""

    FILES = KERNEL_FILES
    NAMES = ("epd_layout", "epd_notify", "epd_wide_notify", "epd_dispatch", "epd_combine_push",
             "epd_abort", "epd_stage_errors", "epd_mask_rank", "epd_live_mask", "epd_unmask_rank",
             "epd_ll_dispatch", "epd_ll_combine_push", "epd_stream_done", "epd_call_done",
             "epd_combine_refused",
             "epd_ll_exec", "epd_ll_exec_fetch", "epd_ll_exec_dispatch", "epd_ll_exec_push",
             "epd_ll_exec_reduce", "epd_ll_exec_reduce_Bf16",
             "epd_ll_exec_reduce_F16", "epd_ll_exec_reduce_F32", "epd_ll_exec_finish",
             "epd_ll_gate")
    TEMPLATES = ("epd_combine_reduce<Bf16>", "epd_combine_reduce<F16>",
                 "epd_combine_reduce<F32>", "epd_ll_combine_reduce<Bf16>",
                 "epd_ll_combine_reduce<F16>", "epd_ll_combine_reduce<F32>")

    def __init__(self, extra_options: tuple[str, ...] = ()) -> None:
        if cp is None:
            raise RuntimeError("CuPy is not installed; the CUDA kernels need cupy-cuda13x")
        self.module = cp.RawModule(code=_source(self.FILES), options=("-std=c++17", *extra_options),
                                   name_expressions=self.TEMPLATES)
        self._fn: dict[str, Any] = {}
        self._tls = threading.local()  # this thread's Packed launches, by kernel name

    def fn(self, name: str) -> Any:
        f = self._fn.get(name)
        if f is None:
            f = self.module.get_function(name)
            cuda_driver.load_function(_function_of(f), name)
            self._fn[name] = f
        return f

    def _packed(self, name: str, fmt: str) -> Packed:
        cache = self._tls.__dict__
        p = cache.get(name)
        if p is None:
            p = cache[name] = Packed(self.fn(name), fmt)
        return p

    def compile_all(self) -> None:
        """Compile the module and load every kernel into the current context now (`fn`
        loads: see `cuda_driver.load_function`); also CuPy's int32 add, which an armed
        dispatch's statistics (`stats += counts`) launch from the poller: loaded lazily at
        that first launch, it could wait behind a rank's kernel spinning for its peer."""
        for n in (*self.NAMES, *self.TEMPLATES):
            self.fn(n)
        a = cp.zeros(1, cp.int32)
        a += a
        cp.cuda.Device().synchronize()

    # -- layout ----------------------------------------------------------------------------
    def layout(self, topk_idx: Any, num_experts: int, num_ranks: int, *,
               stream: Any = None, out: tuple[Any, Any, Any] | None = None,
               call_err: int = 0) -> tuple[Any, Any, Any]:
        """`out`: (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank) to write (the
        caller's tensors); `call_err`: the rank's control block, where a bad id is reported
        (it is skipped) instead of being read out of bounds."""
        t, k = topk_idx.shape
        sp = _handle_of(stream)
        if out is None:
            with _stream_ptr(stream):  # the zeroing runs on the same stream as the kernel
                ntpr = cp.zeros(num_ranks, cp.int32)
                ntpe = cp.zeros(num_experts, cp.int32)
                itr = cp.empty((t, num_ranks), cp.bool_)
        else:
            ntpr, ntpe, itr = out  # contiguous int32 / int32 / bool (checked by the caller)
            cp.cuda.runtime.memsetAsync(ntpr.data.ptr, 0, ntpr.nbytes, sp)
            cp.cuda.runtime.memsetAsync(ntpe.data.ptr, 0, ntpe.nbytes, sp)
        if t:
            self._packed("epd_layout", LAYOUT_ARGS)(
                (t + 255) // 256, 256, 4 * num_experts, sp,
                _addr(topk_idx), t, k, num_experts, num_ranks, _addr(ntpr), _addr(ntpe),
                _addr(itr), int(call_err))
        return ntpr, ntpe, itr

    # -- notify ----------------------------------------------------------------------------
    def notify(self, topk_idx: Any | None, num_experts: int, num_ranks: int, rank: int,
               peers: Any, seq: int, handle: DispatchHandle, *, timeout_ns: int,
               alignment: int = 1, counter_slot_ptr: int = 0,
               layout_out: tuple[Any, Any, Any] | None = None, stream: Any = None,
               counter_seq: int | None = None,
               routing: tuple[Any, Any] | None = None, max_tokens: int = 1 << 30,
               num_worst: int = 0, bad_alike: bool = False, fail_from: Any = None,
               refused: int = 0) -> None:
        """`counter_seq` is the value published in the counter slot's sequence word (the
        engine's dispatch sequence); it defaults to the notify sequence `seq`. A source with
        more than `max_tokens` tokens fails the call on every rank (ERR_CAPACITY), as does a
        destination receiving more than `num_worst` rows (> 0; ERR_WORST_OVERFLOW), and with
        `bad_alike` a source's bad expert id or count (ERR_BAD_INPUT / ERR_BAD_COUNT, the rank
        in ERR_RANK, the value in NUM_RECV; else reported in this rank's control block alone,
        for the call's last kernel). `fail_from`: a two-stage group's stage, the recv_info
        of its whole group's notify: a call that one failed alike (bad input, capacity) is
        skipped by every stage alike, no flag raised. `refused` (ERR_REFUSED, with
        `bad_alike` and no tokens): this rank's engine refused its part, and every rank fails
        the call naming it. Without top-k
        (`topk_idx` None), `routing` is (is_token_in_rank bool [T, R], num_tokens_per_expert
        int32 [E]): tokens go where the first says, the receive counts per expert are the
        sources' declared ones."""
        if topk_idx is None:
            if routing is None:
                raise ValueError("notify needs topk_idx or the routing without top-k")
            in_rank, per_expert = routing
            t, k = int(in_rank.shape[0]), 0
        else:
            t, k = topk_idx.shape
            in_rank = per_expert = None
        ntpr, ntpe, itr = layout_out if layout_out is not None else (None, None, None)
        self._packed("epd_notify", NOTIFY_ARGS)(
            1, NOTIFY_THREADS, 4 * num_experts, _handle_of(stream),
            _addr(topk_idx), t, k, num_experts, num_ranks, rank, _addr(peers), seq,
            timeout_ns, alignment, max_tokens, counter_slot_ptr,
            seq if counter_seq is None else counter_seq, _addr(handle.recv_info),
            _addr(handle.count_matrix), _addr(handle.rank_prefix), _addr(handle.token_mask),
            _addr(handle.pos), _addr(ntpr), _addr(ntpe), _addr(itr), _addr(in_rank),
            _addr(per_expert), handle.num_nodes, _addr(handle.node_base),
            _addr(handle.node_pos), num_worst, int(bad_alike), _addr(fail_from), refused)

    def wide_notify(self, topk_idx: Any, num_experts: int, num_ranks: int, rank: int,
                    peers: Any, seq: int, handle: DispatchHandle, *, timeout_ns: int,
                    alignment: int = 1, counter_slot_ptr: int = 0, stream: Any = None,
                    counter_seq: int | None = None, max_tokens: int = 1 << 30,
                    refused: int = 0) -> None:
        """The whole-group notify of a two-stage group of more than MAX_RANKS ranks (a
        notify-only slot; cuda/epd_intranode.cu, epd_wide_notify): `handle`'s recv_info,
        count and prefix matrices and the counter slot as `notify` writes them, no positions
        (the stages have their own); a source's bad expert id fails the call on every rank
        alike, as notify's `bad_alike`, and so does `refused` (notify's). Top-k ids only (a
        two-stage group refuses routing without them)."""
        t, k = topk_idx.shape
        self._packed("epd_wide_notify", WIDE_NOTIFY_ARGS)(
            1, NOTIFY_THREADS, 4 * num_experts, _handle_of(stream),
            _addr(topk_idx), t, k, num_experts, num_ranks, rank, _addr(peers), seq,
            timeout_ns, alignment, max_tokens, counter_slot_ptr,
            seq if counter_seq is None else counter_seq, _addr(handle.recv_info),
            _addr(handle.count_matrix), _addr(handle.rank_prefix), refused)

    # -- dispatch --------------------------------------------------------------------------
    def dispatch(self, x: Any, x_scales: Any | None, topk_idx: Any | None,
                 topk_weights: Any | None, layout: RankBufferLayout, rank: int, peers: Any,
                 handle: DispatchHandle, seq: int, *, timeout_ns: int,
                 num_sms: int = DEFAULT_NUM_SMS, num_worst_tokens: int = 0,
                 barrier: bool = False, stream: Any = None) -> None:
        t = handle.num_tokens
        row_bytes = x.shape[1] * x.itemsize
        sc_row = 0 if x_scales is None else x_scales.shape[1] * x_scales.itemsize
        o = layout.offsets
        k = layout.num_topk
        self._packed("epd_dispatch", DISPATCH_ARGS)(
            num_sms, DATA_THREADS, 0, _handle_of(stream),
            _addr(x), row_bytes, x.strides[0], _addr(x_scales), sc_row,
            0 if x_scales is None else x_scales.strides[0], _addr(topk_idx),
            _addr(topk_weights), t, k, layout.num_local_experts, layout.num_ranks, rank,
            _addr(handle.token_mask), _addr(handle.pos), _addr(handle.rank_prefix),
            _addr(handle.recv_info), _addr(peers), o["recv_x"], o["recv_x_scales"],
            o["recv_topk_idx"], o["recv_topk_weights"], o["recv_src_idx"], o["recv_src_rank"],
            num_worst_tokens, int(topk_idx is not None), int(x_scales is not None),
            1 if barrier else 0, seq, timeout_ns, o.get("net_send", 0),
            _addr(handle.count_matrix), handle.num_nodes, _addr(handle.node_pos),
            _addr(handle.node_base))

    # -- combine ---------------------------------------------------------------------------
    def combine(self, y: Any, recv_topk_weights: Any | None, out: Any, out_weights: Any | None,
                layout: RankBufferLayout, rank: int, peers: Any, own_base: int,
                handle: DispatchHandle, seq: int, *, timeout_ns: int, bias_0: Any = None,
                bias_1: Any = None, num_sms: int = DEFAULT_NUM_SMS, barrier: bool = True,
                stream: Any = None) -> None:
        """Push (expert side) then reduce (token side), both on `stream`."""
        del own_base  # the kernels find their own buffer as peers[rank]
        o = layout.offsets
        k = layout.num_topk
        h = y.shape[1]
        r = layout.num_ranks
        if (h * y.itemsize) % 16:
            raise ValueError("combine needs hidden * itemsize to be a multiple of 16 bytes")
        w_stride = 0 if recv_topk_weights is None else recv_topk_weights.strides[0] // 4
        sp = _handle_of(stream)
        self._packed("epd_combine_push", COMBINE_PUSH_ARGS)(
            num_sms, DATA_THREADS, 0, sp,
            _addr(y), h * y.itemsize, y.strides[0], _addr(recv_topk_weights), w_stride, k, r,
            rank, _addr(handle.recv_info), _addr(handle.count_matrix),
            _addr(handle.rank_prefix), _addr(peers), o["stage_y"], o["stage_w"],
            1 if barrier else 0, seq, timeout_ns, o.get("net_send", 0), handle.num_nodes)
        isz = y.itemsize
        self._packed(f"epd_combine_reduce<{_trait_for(y.dtype)}>", COMBINE_REDUCE_ARGS)(
            num_sms, DATA_THREADS, 0, sp,
            _addr(out), out.strides[0] // isz, _addr(y), y.strides[0] // isz, _addr(bias_0),
            0 if bias_0 is None else bias_0.strides[0] // isz, _addr(bias_1),
            0 if bias_1 is None else bias_1.strides[0] // isz, _addr(out_weights),
            _addr(recv_topk_weights), w_stride, handle.num_tokens, h, k, r, rank,
            _addr(handle.token_mask), _addr(handle.pos), _addr(handle.count_matrix),
            _addr(handle.rank_prefix), _addr(peers), o["stage_y"], o["stage_w"], seq,
            timeout_ns, handle.num_nodes, _addr(handle.recv_info))

    def combine_refused(self, peers: Any, num_ranks: int, rank: int, seq: int, *,
                        timeout_ns: int, recv_info: Any = None, stream: Any = None) -> None:
        """This rank's part of combine `seq`, which its engine refused: it enters the combine
        and tells every peer so, whose reduce then fails the call naming this rank
        (ERR_REFUSED) instead of waiting for pushes that never come. `recv_info`: the
        handle's, when known (the combine of a dispatch that failed alike is skipped)."""
        self._packed("epd_combine_refused", COMBINE_REFUSED_ARGS)(
            1, 32, 0, _handle_of(stream), _addr(peers), num_ranks, rank, seq, timeout_ns,
            _addr(recv_info))

    # -- low-latency mode: packed launches (see `Launch`) ------------------------------------
    def ll_dispatch_launch(self, x: Any, topk_idx: Any, lay: LowLatencyLayout, rank: int,
                           peers: Any, m: int, *, fp8: bool, round_scale: bool,
                           timeout_ns: int, num_sms: int) -> Launch:
        """x [T, H] rows contiguous (bf16 bits for FP8), topk_idx [T, K] int64 contiguous.
        The sequence argument is `Launch.set(LL_DISPATCH_SEQ, seq)` before each launch."""
        t, k = topk_idx.shape
        o = lay.offsets
        row_bytes = x.shape[1] * x.itemsize
        # (strides of an empty array are whatever CuPy says: only a non-empty one is checked)
        if row_bytes % 16 or (x.size and x.strides[1] != x.itemsize) or (
                topk_idx.size and not topk_idx.flags.c_contiguous):
            raise ValueError("low-latency dispatch needs contiguous rows of 16-byte multiples "
                             "and a contiguous topk_idx")
        return Launch(self.fn("epd_ll_dispatch"), num_sms, LL_THREADS, [
            (_P, x.data.ptr), (_I64, x.strides[0]), (_I64, row_bytes), (_P, topk_idx.data.ptr),
            (_I32, t), (_I32, k), (_I32, lay.num_local_experts), (_I32, lay.num_ranks),
            (_I32, rank), (_I32, lay.hidden), (_I32, m), (_I32, int(fp8)),
            (_I32, int(round_scale)), (_P, peers.data.ptr), (_I64, o["recv_x"]),
            (_I64, o["scales"]), (_I64, o["src_rank"]), (_I64, o["src_idx"]),
            (_I64, o["src_k"]), (_I64, o["hist"]), (_I64, o["recv_count"]),
            (_I64, o["topk"]), (_U64, 0), (_I64, timeout_ns), (_I64, o.get("send_x", 0)),
            (_I64, o.get("send_scales", 0))])

    def ll_combine_launches(self, y: Any, topk_idx: Any, weights: Any, out: Any,
                            lay: LowLatencyLayout, rank: int, peers: Any, m: int, *,
                            timeout_ns: int, num_sms: int) -> tuple[Launch, Launch]:
        """(push, reduce): y [L, R*m, H] in the group dtype, out [T, H] (any row stride);
        set LL_PUSH_SEQ / LL_REDUCE_SEQ before each launch."""
        o = lay.offsets
        t, k = topk_idx.shape
        h = y.shape[2]
        row_bytes = h * y.itemsize
        isz = y.itemsize
        if (row_bytes % 16 or (y.size and y.strides[2] != isz)
                or (out.size and out.strides[1] != isz)
                or (topk_idx.size and not topk_idx.flags.c_contiguous)
                or (weights.size and weights.strides[1] != 4)):
            raise ValueError("low-latency combine needs contiguous rows of 16-byte multiples, "
                             "a contiguous topk_idx and float32 weights with unit inner stride")
        push = Launch(self.fn("epd_ll_combine_push"), num_sms, LL_THREADS, [
            (_P, y.data.ptr), (_I64, y.strides[1]), (_I64, y.strides[0]), (_I64, row_bytes),
            (_I32, lay.num_local_experts), (_I32, lay.num_ranks), (_I32, rank), (_I32, m),
            (_I32, k), (_P, peers.data.ptr), (_I64, o["src_rank"]), (_I64, o["src_idx"]),
            (_I64, o["src_k"]), (_I64, o["recv_count"]), (_I64, o["comb"]), (_U64, 0),
            (_I64, timeout_ns), (_I64, o.get("send_y", 0))])
        reduce = Launch(self.fn(f"epd_ll_combine_reduce<{_trait_for(y.dtype)}>"), num_sms,
                        LL_THREADS, [
            (_P, out.data.ptr), (_I64, out.strides[0] // isz), (_P, topk_idx.data.ptr),
            (_P, weights.data.ptr), (_I64, weights.strides[0] // 4), (_I32, t), (_I32, k),
            (_I32, h), (_I32, lay.num_ranks), (_I32, rank), (_P, peers.data.ptr),
            (_I64, o["comb"]), (_I64, o["topk"]), (_U64, 0), (_I64, timeout_ns),
            (_I32, lay.num_local_experts)])
        return push, reduce

    def chain_launches(self, ring_ptr: int, table: Any, state: Any, num_sms: int,
                       trait: str | None = None, split: bool = False,
                       entry_copy: Any = None) -> list[tuple[str, Launch]]:
        """One instance of a member's low-latency chain (cuda_chain.py), by segment name: exec
        (a dispatch or a combine's push), the combine's reduce, finish. Set CHAIN_K to k before
        each launch. `trait` ("Bf16", "F16", "F32"): the reduce for that combine type only;
        None: the reduce that takes any of them (more registers and shared memory per block).
        `split`: exec as two kernels, one per kind (the other kind's returns at once);
        `entry_copy` (uint32 [LL_RING] on the device): a first one-thread kernel copies the
        entry there and the others read it from device memory, not from the ring's host page.
        (Every launch spelled out: tests/test_abi.py checks each against its kernel.)"""
        head = ring_ptr + 4 * LL_RING_HEAD
        out: list[tuple[str, Launch]] = []
        if entry_copy is not None:
            out.append(("fetch", Launch(self.fn("epd_ll_exec_fetch"), 1, 32, [
                (_P, ring_ptr), (_U64, 0), (_P, entry_copy.data.ptr)])))
            ring_ptr = entry_copy.data.ptr
        t, s, g, b = table.data.ptr, state.data.ptr, num_sms, LL_THREADS
        if split:
            out.append(("exec_dispatch", Launch(self.fn("epd_ll_exec_dispatch"), g, b, [
                (_P, ring_ptr), (_U64, 0), (_P, t), (_P, s)])))
            out.append(("exec_push", Launch(self.fn("epd_ll_exec_push"), g, b, [
                (_P, ring_ptr), (_U64, 0), (_P, t), (_P, s)])))
        else:
            out.append(("exec", Launch(self.fn("epd_ll_exec"), g, b, [
                (_P, ring_ptr), (_U64, 0), (_P, t), (_P, s)])))
        if trait == "Bf16":
            reduce = Launch(self.fn("epd_ll_exec_reduce_Bf16"), g, b, [
                (_P, ring_ptr), (_U64, 0), (_P, t), (_P, s)])
        elif trait == "F16":
            reduce = Launch(self.fn("epd_ll_exec_reduce_F16"), g, b, [
                (_P, ring_ptr), (_U64, 0), (_P, t), (_P, s)])
        elif trait == "F32":
            reduce = Launch(self.fn("epd_ll_exec_reduce_F32"), g, b, [
                (_P, ring_ptr), (_U64, 0), (_P, t), (_P, s)])
        else:
            reduce = Launch(self.fn("epd_ll_exec_reduce"), g, b, [
                (_P, ring_ptr), (_U64, 0), (_P, t), (_P, s)])
        out.append(("reduce", reduce))
        out.append(("finish", Launch(self.fn("epd_ll_exec_finish"), 1, 256, [
            (_P, ring_ptr), (_U64, 0), (_P, t), (_P, s), (_P, head)])))
        return out

    def chain_gate(self, ring_ptr: int) -> Launch:
        """A one-thread kernel that returns once the ring's tail reaches the value at argument
        CHAIN_K (the chain's alternative to a stream wait)."""
        return Launch(self.fn("epd_ll_gate"), 1, 32,
                      [(_P, ring_ptr + 4 * LL_RING_TAIL), (_U32, 0)])

    def stream_done_launch(self, peers: Any, rank: int, done_ptr: int, verdict_ptr: int = 0,
                           combine: bool = False) -> Launch:
        """Write a stream op's done word (1 ok, 2 | code << 8 failed) after the work before it;
        `verdict_ptr`: a low-latency call's verdict words, which fail it too: a dispatch's
        receive-buffer header (a source's bad ids), or with `combine` the header's combine words
        (a bad entry of this rank's own top-k; read once, cleared)."""
        return Launch(self.fn("epd_stream_done"), 1, 32,
                      [(_P, peers.data.ptr), (_I32, rank), (_P, done_ptr), (_P, verdict_ptr),
                       (_I32, int(combine))])

    def call_done_launch(self, peers: Any, rank: int, slot_ptr: int) -> Launch:
        """The last kernel of a stream-ordered normal-mode call: failure words, then DONE = seq
        (argument CALL_DONE_SEQ, set per call)."""
        return Launch(self.fn("epd_call_done"), 1, 32,
                      [(_P, peers.data.ptr), (_I32, rank), (_P, slot_ptr), (_U32, 0)])

    # -- control ---------------------------------------------------------------------------
    def abort(self, peers: Any, num_ranks: int, code: int = ERR_ABORTED, *,
              stream: Any = None) -> None:
        with _stream_ptr(stream):
            self.fn("epd_abort")((1,), (64,), (peers, np.int32(num_ranks), np.uint64(code)))

    def stage_errors(self, peers: Any, rank: int, rail_ctrl: Any, node_ctrl: Any,
                     per_node: int, *, stream: Any = None) -> None:
        """A two-stage group's stream-ordered call: its stages' first failure recorded in the
        rank's whole-group control block, where epd_call_done reads it (group ranks)."""
        self._packed("epd_stage_errors", STAGE_ERRORS_ARGS)(  # (every such call: packed)
            1, 32, 0, _handle_of(stream), _addr(peers), rank, _addr(rail_ctrl),
            _addr(node_ctrl), per_node)

    def live_mask(self, peers: Any, num_ranks: int, rank: int, masked: bool, *,
                  stream: Any = None) -> None:
        """Set (or clear) rank `rank`'s bit in every rank's CTRL_LIVE_MASK: a live rank masked by
        a call (its peers still wait for its flags; each dispatch agrees on who is left out)."""
        with _stream_ptr(stream):
            self.fn("epd_live_mask")((1,), (64,), (peers, np.int32(num_ranks), np.int32(rank),
                                                   np.int32(1 if masked else 0)))

    def unmask_rank(self, ctrl_ptr: int, rank: int, *, stream: Any = None) -> None:
        """Clear rank `rank`'s bit in one control block's CTRL_MASK (a replacement rejoined)."""
        with _stream_ptr(stream):
            self.fn("epd_unmask_rank")((1,), (32,), (np.uint64(ctrl_ptr), np.int32(rank)))

    def mask_rank(self, peers: Any, num_ranks: int, gone: int, *, stream: Any = None) -> None:
        """Set rank `gone`'s bit in every rank's CTRL_MASK (a shrink group goes on without it)."""
        with _stream_ptr(stream):
            self.fn("epd_mask_rank")((1,), (64,), (peers, np.int32(num_ranks), np.int32(gone)))


_P, _I64, _I32, _U64 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_uint64
_U32 = ctypes.c_uint32
LL_DISPATCH_SEQ, LL_PUSH_SEQ, LL_REDUCE_SEQ = 22, 15, 13  # argument index of `seq`
# argument index -> LowLatencyLayout.PER_BUFFER name, of the offsets that pick a receive buffer
LL_DISPATCH_BUFFER_ARGS = {14: "recv_x", 15: "scales", 16: "src_rank", 17: "src_idx",
                           18: "src_k", 20: "recv_count", 21: "topk"}
LL_PUSH_BUFFER_ARGS = {10: "src_rank", 11: "src_idx", 12: "src_k", 13: "recv_count"}
LL_REDUCE_BUFFER_ARGS = {12: "topk"}
CALL_DONE_SEQ = 3
CHAIN_K = 1  # argument index of k in the chain's three kernels


class Launch:
    """One kernel launch with its arguments packed once: ctypes values plus the `void*` array
    the driver reads. Repeating it changes a value in place (`set`) and costs one driver call,
    where CuPy converts every argument on every call (~1 µs each; a low-latency launch has ~25).
    The caller keeps the arrays whose addresses are packed alive."""

    def __init__(self, fn: Any, grid: int, block: int, args: list[tuple[Any, int]]) -> None:
        self._fn = _function_of(fn)
        self.grid, self.block = int(grid), int(block)
        self._vals = [ctype(int(v)) for ctype, v in args]
        self._argv = (ctypes.c_void_p * len(args))(*(ctypes.addressof(v) for v in self._vals))

    def set(self, index: int, value: int) -> None:
        self._vals[index].value = value

    def values(self) -> list[int]:
        """The packed arguments as 64-bit words, in the kernel's parameter order (a chain
        descriptor holds them; negative values in two's complement)."""
        return [int(v.value) & 0xFFFFFFFFFFFFFFFF for v in self._vals]

    def set_buffer(self, args: dict[int, str], layout: LowLatencyLayout, buffer: int) -> None:
        """Point a low-latency launch at receive buffer 0 or 1 (LL_*_BUFFER_ARGS)."""
        for index, name in args.items():
            self._vals[index].value = layout.offset(name, buffer)

    def __call__(self, stream: Any = None) -> None:
        ptr = stream.ptr if stream is not None else cp.cuda.get_current_stream().ptr
        cp.cuda.driver.launchKernel(self._fn, self.grid, 1, 1, self.block, 1, 1, 0, ptr,
                                    ctypes.addressof(self._argv), 0)


def read_error(ctrl_view: Any) -> tuple[int, int, str, int] | None:
    """(code, missing rank, phase name, seq) from a rank's control block, or None if clean."""
    words = cp.asnumpy(ctrl_view[:8]).astype(np.int64)
    code = int(words[CTRL_ERR_CODE])
    if code == 0:
        return None
    return (code, int(words[CTRL_ERR_RANK]), PHASE_NAMES.get(int(words[CTRL_ERR_PHASE]), "?"),
            int(words[CTRL_ERR_SEQ]))


@functools.cache
def kernels_for_device(device_id: int) -> Kernels:
    """Process-wide compiled module, every kernel loaded (`cuda_driver.load_function`); CuPy
    caches the compiled module on disk."""
    os.environ.setdefault("CUPY_CACHE_DIR", str(Path.home() / ".cache" / "epd" / "cupy"))
    with cp.cuda.Device(device_id):
        kernels = Kernels()
        kernels.compile_all()
        return kernels
