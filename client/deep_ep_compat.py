"""DeepEP V1's small public types, for the `Buffer` facade (client/buffer.py) and the opt-in
`deep_ep` shim (client/deep_ep_shim/).

Written from DeepEP's public API at commit 567632dd59810d77b3cc05553df953cc0f779799
(`deep_ep/buffer.py`, `deep_ep/utils.py`, `csrc/config.hpp`, `csrc/deep_ep.cpp`'s bindings):
the same names, argument order, defaults and meanings; the numbers of the size hints follow
V1's formulas, so a caller sizing `num_nvl_bytes` / `num_rdma_bytes` from them gets what it
would get from DeepEP.

Events: with torch CUDA available, `EventHandle` is a real `torch.cuda.Event` recorded on the
current stream (or a given one) and `current_stream_wait()` makes the current stream wait for
it. Without CUDA (the CPU backend: every call has finished when it returns) the handle records
nothing and waiting on it returns at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from ..proto.errors import EpdError, InvalidArgument
from .frameworks import torch_if_loaded

DEEPEP_V1_COMMIT = "567632dd59810d77b3cc05553df953cc0f779799"

# DeepEP's compile-time constants (csrc/kernels/configs.cuh) that its size hints use.
NUM_MAX_NVL_PEERS = 8
NUM_BUFFER_ALIGNMENT_BYTES = 128
_TOPK_IDX_BYTES = 8          # topk_idx_t is int64 (TOPK_IDX_BITS defaults to 64)
_SOURCE_META_BYTES = 8       # internode SourceMeta: two ints
_INT4_BYTES = 16
_MAX_TOPK = 128              # kNumMaxTopK
_MAX_SCALES = 128            # kNumMaxScales


class Unsupported(EpdError, NotImplementedError):
    """A DeepEP feature EPD does not provide (gRPC code UNIMPLEMENTED); the message says why."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNIMPLEMENTED, message)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)


def _align_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


# -- events ------------------------------------------------------------------------------------
def _cuda_torch() -> Any:
    """torch when it is loaded and has a usable CUDA device, else None."""
    torch = torch_if_loaded()
    if torch is None or not torch.cuda.is_available():
        return None
    return torch


class EventHandle:
    """DeepEP's `deep_ep_cpp.EventHandle`: an event recorded at construction on the current
    stream (`stream=`: on that one instead). Without CUDA it records nothing (`event` is None)
    and `current_stream_wait()` returns at once: every host call has finished already."""

    def __init__(self, stream: Any = None) -> None:
        torch = _cuda_torch()
        self.event = None
        if torch is not None:
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch_if_loaded().cuda.current_stream().wait_event(self.event)

    def stream_wait(self, stream: Any) -> None:
        """Make `stream` (a torch CUDA stream) wait for this event."""
        if self.event is not None:
            stream.wait_event(self.event)


class EventOverlap:
    """DeepEP's event wrapper (`deep_ep.EventOverlap`): `event` is an `EventHandle` (or None),
    `extra_tensors` tensors kept alive until the event is waited on (DeepEP's CUDA-graph-safe
    substitute for `record_stream`). `current_stream_wait()` makes the current stream wait for
    the event; as a context manager, the stream waits on exit. An EventOverlap without an event
    (a call made without `async_finish`, whose work the current stream is ordered after
    already) waits for nothing, where DeepEP asserts."""

    def __init__(self, event: EventHandle | None = None,
                 extra_tensors: tuple[Any, ...] | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Callable[[], Any] | None = None  # (DeepEP V2's)
        self._release_handle_by_call = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """The current stream waits for the event; then the hook registered (V2), once; with
        `release_handle` (V2) the event is dropped."""
        if self.event is not None:
            self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """DeepEP V2's: `hook_after_wait()` runs after the next `current_stream_wait()`."""
        if self.hook_after_wait is not None:
            raise InvalidArgument("a hook is already registered on this EventOverlap")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        """DeepEP V2's `with event(release_handle=True):`."""
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: object) -> None:
        release, self._release_handle_by_call = self._release_handle_by_call, False
        self.current_stream_wait(release)


class HostStream:
    """What `Buffer.get_comm_stream()` returns without CUDA: DeepEP's comm-stream methods,
    all immediate (the CPU backend's calls have finished when they return)."""

    device_type = "cpu"

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> EventHandle:
        return EventHandle()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HostStream)

    def __hash__(self) -> int:
        return hash(HostStream)


def _tensors(obj: Any) -> Iterator[Any]:
    torch = torch_if_loaded()
    if torch is None:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # a call's results
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))


def check_stream_args(previous_event: EventOverlap | None, async_finish: bool,
                      allocate_on_comm_stream: bool) -> None:
    """DeepEP's rule for the stream arguments (a call checks it before anything changes)."""
    if allocate_on_comm_stream:
        _require(previous_event is not None and async_finish,
                 "allocate_on_comm_stream=True needs previous_event and async_finish=True "
                 "(as in DeepEP)")


def run_on_streams(get_comm_stream: Callable[[], Any], template: Any, call: Callable[[], Any],
                   previous_event: EventOverlap | None, async_finish: bool,
                   allocate_on_comm_stream: bool, inputs: tuple[Any, ...] = ()
                   ) -> tuple[Any, EventOverlap]:
    """Run one facade call with DeepEP V1's stream semantics; returns (result, event).

    With torch CUDA tensors and `async_finish`: the comm stream waits for `previous_event`
    (else for the current stream), the call runs with the comm stream current (the engine is
    ordered after it through the call's ready event, and the outputs are produced on it), and
    the returned event is recorded on the comm stream after the call's work; the current
    stream does not wait. Without `async_finish` the call runs on the current stream (after
    `previous_event`), which is what DeepEP's "the current stream waits for the comm stream"
    amounts to. Without CUDA every call has finished when it returns: the event is an
    `EventOverlap` of an `EventHandle` that waits for nothing (async), or of None.
    `allocate_on_comm_stream` needs `previous_event` and `async_finish`, as in DeepEP."""
    check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
    torch = torch_if_loaded()
    cuda = (torch is not None and isinstance(template, torch.Tensor)
            and template.device.type == "cuda")
    prev = previous_event.event if previous_event is not None else None
    if not cuda:
        result = call()
        return result, EventOverlap(EventHandle() if async_finish else None)
    if not async_finish:
        if prev is not None:
            prev.current_stream_wait()
        return call(), EventOverlap()
    compute = torch.cuda.current_stream()
    comm = get_comm_stream()
    if prev is not None:
        prev.stream_wait(comm)
    else:
        comm.wait_stream(compute)
    with torch.cuda.stream(comm):
        result = call()
    for t in _tensors(inputs):  # read on the comm stream: not reused before it passes
        with contextlib.suppress(RuntimeError):
            t.record_stream(comm)
    # The outputs were made on the comm stream and are used on the compute stream: freed, the
    # allocator must not give their memory to the next comm-stream call before the compute
    # stream's work queued by then passed (DeepEP records the compute stream alike).
    seen: set[int] = set()  # (a call's outputs are views of one allocation: once each)
    for t in _tensors(result):
        with contextlib.suppress(RuntimeError):
            base = t.untyped_storage().data_ptr()
            if base not in seen:
                seen.add(base)
                t.record_stream(compute)
    return result, EventOverlap(EventHandle(stream=comm))


# -- Config ------------------------------------------------------------------------------------
class Config:
    """DeepEP's `deep_ep.Config` (csrc/config.hpp): the tuning of the normal-mode kernels and
    what their buffers need. Validated as DeepEP validates it (the RDMA receive chunk is rounded
    up to a multiple of the send chunk). EPD's daemon does its own tuning; a Config given to
    dispatch/combine is checked and does not change results."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        _require(num_sms >= 0, f"Config: num_sms must be >= 0, got {num_sms}")
        _require(num_max_nvl_chunked_send_tokens > 0 and num_max_nvl_chunked_recv_tokens > 0,
                 "Config: NVL chunk sizes must be > 0")
        _require(num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens,
                 "Config: num_max_nvl_chunked_send_tokens must be < "
                 "num_max_nvl_chunked_recv_tokens")
        _require(num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0,
                 "Config: RDMA chunk sizes must be > 0")
        rdma_recv = _align_up(num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens)
        _require(num_max_rdma_chunked_send_tokens < rdma_recv,
                 "Config: num_max_rdma_chunked_send_tokens must be < "
                 "num_max_rdma_chunked_recv_tokens")
        _require(num_max_rdma_chunked_send_tokens <= rdma_recv // 2,
                 "Config: num_max_rdma_chunked_send_tokens must be at most half of "
                 "num_max_rdma_chunked_recv_tokens")
        self.num_sms = int(num_sms)
        self.num_max_nvl_chunked_send_tokens = int(num_max_nvl_chunked_send_tokens)
        self.num_max_nvl_chunked_recv_tokens = int(num_max_nvl_chunked_recv_tokens)
        self.num_max_rdma_chunked_send_tokens = int(num_max_rdma_chunked_send_tokens)
        self.num_max_rdma_chunked_recv_tokens = int(rdma_recv)

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, "
                f"num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and vars(self) == vars(other)

    def __hash__(self) -> int:
        # DeepEP's Config is a pybind11 class and so hashable (a caller may key a dict or an
        # lru_cache by it); defining __eq__ alone would make this one unhashable. Hash what
        # __eq__ compares, so that equal configs hash alike.
        return hash(tuple(sorted(vars(self).items())))

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the intranode (NVLink) buffer this config needs for tokens of
        `hidden_bytes` across `num_ranks` ranks (DeepEP's formula)."""
        _require(num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0,
                 f"num_ranks {num_ranks} must be < {NUM_MAX_NVL_PEERS} or a multiple of it")
        _require(num_ranks <= NUM_MAX_NVL_PEERS or self.num_sms % 2 == 0,
                 "num_sms must be even beyond one node")
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = (self.num_sms // 2) * nvl_ranks  # channels x NVL peers
        tokens = slots * self.num_max_nvl_chunked_recv_tokens
        n = slots * (2 * rdma_ranks + 3) * 4
        n += tokens * (hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * _TOPK_IDX_BYTES
                       + _MAX_TOPK * 4 + _MAX_SCALES * 4)
        return _align_up(n, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the internode (RDMA) buffer this config needs: 0 within one node, as in
        DeepEP (DeepEP's formula beyond)."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        _require(num_ranks % NUM_MAX_NVL_PEERS == 0,
                 f"num_ranks {num_ranks} must be a multiple of {NUM_MAX_NVL_PEERS}")
        _require(self.num_sms % 2 == 0, "num_sms must be even beyond one node")
        slots = (self.num_sms // 2) * (num_ranks // NUM_MAX_NVL_PEERS)
        tokens = slots * self.num_max_rdma_chunked_recv_tokens
        n = slots * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        n += tokens * 2 * (hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * _TOPK_IDX_BYTES
                           + _MAX_TOPK * 4 + _MAX_SCALES * 4 + _INT4_BYTES)
        return _align_up(n, 128)


def low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                               num_ranks: int, num_experts: int) -> int:
    """DeepEP's low-latency RDMA buffer size: two (odd/even) send, receive and signalling
    buffers for bf16 or FP8 messages (csrc/config.hpp's LowLatencyLayout)."""
    scales = hidden // 128
    _require(scales * 4 <= hidden, f"hidden {hidden} too small for its FP8 scales")
    t = num_max_dispatch_tokens_per_rank
    dispatch_msg = _INT4_BYTES + max(hidden * 2, hidden + scales * 4)
    combine_msg = scales * 4 + hidden * 2
    send = max(t * dispatch_msg, num_experts * t * combine_msg)
    recv = max(num_experts * t * dispatch_msg, num_experts * t * combine_msg)
    signal = _align_up(num_experts * 4, 128)
    total = 2 * (send + recv + signal)
    # DeepEP rounds with (n + A) // A * A: one alignment unit more when already aligned.
    return (total + NUM_BUFFER_ALIGNMENT_BYTES) // NUM_BUFFER_ALIGNMENT_BYTES \
        * NUM_BUFFER_ALIGNMENT_BYTES


# DeepEP's recommended configs per number of ranks: (NVL send chunk, NVL recv chunk, RDMA send
# chunk, RDMA recv chunk); num_sms is Buffer.num_sms at the time of the call.
DISPATCH_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    **dict.fromkeys((24, 32, 48, 64), (32, 288, 8, 128)), 96: (20, 480, 12, 128),
    128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
COMBINE_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    **dict.fromkeys((24, 32, 48, 64), (1, 288, 8, 128)), 96: (1, 480, 8, 128),
    128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def recommended_config(table: dict[int, tuple[int, int, int, int]], num_sms: int,
                       num_ranks: int) -> Config:
    if num_ranks not in table:
        raise InvalidArgument(f"Unsupported number of EP ranks: {num_ranks} (DeepEP's configs "
                              f"cover {sorted(table)})")
    return Config(num_sms, *table[num_ranks])


# -- the engine a Buffer talks to --------------------------------------------------------------
def default_engine() -> int:
    """`EPD_ENGINE` when set; else, with torch CUDA available, the caller's current CUDA device
    (`torch.cuda.current_device()`, mapped through a numeric `CUDA_VISIBLE_DEVICES` to the
    physical GPU, which is the engine's number); else `LOCAL_RANK`, else 0 (the CPU backend)."""
    env = os.environ.get("EPD_ENGINE")
    if env not in (None, ""):
        return int(env)
    torch = _cuda_torch()
    if torch is not None:
        dev = int(torch.cuda.current_device())
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip().strip(",")
        ids = [v.strip() for v in visible.split(",")] if visible else []
        if ids and all(v.isdigit() for v in ids) and dev < len(ids):
            return int(ids[dev])
        return dev
    return int(os.environ.get("LOCAL_RANK", "0"))


# -- helpers on arrays of either kind (NumPy, torch) -------------------------------------------
def is_token_in_rank_of(topk_idx: Any, num_experts: int, num_ranks: int) -> Any:
    """`[T, R]` bool: whether a token has an expert on rank r (DeepEP's layout output)."""
    torch = torch_if_loaded()
    local = num_experts // num_ranks
    if torch is not None and isinstance(topk_idx, torch.Tensor):
        owner = torch.where(topk_idx >= 0, topk_idx // local, -1)
        ranks = torch.arange(num_ranks, device=topk_idx.device)
        return (owner.unsqueeze(-1) == ranks).any(dim=1)
    xp = _array_module(topk_idx)
    idx = xp.asarray(topk_idx)
    owner = xp.where(idx >= 0, idx // local, -1)
    return (owner[:, :, None] == xp.arange(num_ranks)).any(axis=1)


def layout_of(topk_idx: Any, num_experts: int, num_ranks: int) -> tuple[Any, Any, Any]:
    """DeepEP's get_dispatch_layout computed in the caller's process, on the current stream
    for a CUDA tensor: (num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E],
    is_token_in_rank bool [T, R]), of the caller's array kind. An expert id outside [-1, E)
    raises InvalidArgument (which reads the ids back: a synchronisation)."""
    torch = torch_if_loaded()
    if torch is not None and isinstance(topk_idx, torch.Tensor):
        xp, i32 = torch, torch.int32
        bad = ((topk_idx < -1) | (topk_idx >= num_experts)).any().item()
    else:
        xp = _array_module(topk_idx)
        i32 = np.int32
        bad = bool(((topk_idx < -1) | (topk_idx >= num_experts)).any())
    if bad:
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        raise InvalidArgument(f"topk_idx holds expert ids in [{lo}, {hi}]; valid ids are -1 "
                              f"(none) and [0, {num_experts})")
    in_rank = is_token_in_rank_of(topk_idx, num_experts, num_ranks)
    valid = topk_idx[topk_idx >= 0].reshape(-1)
    if xp is torch:
        per_expert = torch.bincount(valid, minlength=num_experts).to(i32)
        per_rank = in_rank.sum(dim=0, dtype=i32)
    else:
        per_expert = xp.bincount(valid, minlength=num_experts).astype(i32)
        per_rank = in_rank.sum(axis=0, dtype=i32)
    return per_rank, per_expert, in_rank


_NODE_COLUMNS: dict[tuple[tuple[int, ...], str], list[Any]] = {}  # placement -> index tensors


def tokens_per_node(in_rank: Any, rank_nodes: tuple[int, ...]) -> Any:
    """DeepEP's num_tokens_per_rdma_rank: tokens with a destination rank on each node
    (ascending node order), int32, computed where `is_token_in_rank` lives (a CUDA tensor on
    the caller's current stream, after the layout that wrote it; never a host copy)."""
    nodes = sorted(set(rank_nodes))
    cols = [[r for r, n in enumerate(rank_nodes) if n == node] for node in nodes]
    torch = torch_if_loaded()
    if torch is not None and isinstance(in_rank, torch.Tensor):
        key = (tuple(rank_nodes), str(in_rank.device))
        index = _NODE_COLUMNS.get(key)
        if index is None:  # (made once: a host-to-device copy per layout call would cost more)
            index = _NODE_COLUMNS[key] = [torch.tensor(c, device=in_rank.device) for c in cols]
        return torch.stack([in_rank[:, i].any(dim=1).sum() for i in index]).to(torch.int32)
    xp = _array_module(in_rank)
    return xp.stack([in_rank[:, c].any(axis=1).sum() for c in cols]).astype(np.int32)


def _array_module(x: Any) -> Any:
    """NumPy, or CuPy for a CuPy array (imported only then)."""
    if hasattr(x, "__cuda_array_interface__"):
        import cupy
        return cupy
    return np


def layout_range_of(src_rank: Any, num_ranks: int) -> Any:
    """DeepEP's low-latency `layout_range` `[L, R]` int64 from the source rank of every row:
    `(begin << 32) | count` of the rows each source rank sent to each local expert. Exists only
    when each source's rows are contiguous (both engines order them by source, then token)."""
    torch = torch_if_loaded()
    if torch is not None and isinstance(src_rank, torch.Tensor):
        src = src_rank.to(torch.int64)
        ranks = torch.arange(num_ranks, device=src.device).view(1, -1, 1)
        hit = src.unsqueeze(1) == ranks  # [L, R, S]
        count = hit.sum(-1)
        rows = torch.arange(src.shape[-1], device=src.device)
        begin = torch.where(hit, rows, src.shape[-1]).amin(-1)
        end = torch.where(hit, rows, -1).amax(-1) + 1
        contiguous = bool(((count == 0) | (end - begin == count)).all())
        begin = torch.where(count > 0, begin, 0)
        out = (begin << 32) | count
    else:
        src = np.asarray(src_rank).astype(np.int64)
        hit = src[:, None, :] == np.arange(num_ranks)[None, :, None]
        count = hit.sum(-1)
        rows = np.arange(src.shape[-1])
        begin = np.where(hit, rows, src.shape[-1]).min(-1) if src.shape[-1] else count * 0
        end = (np.where(hit, rows, -1).max(-1) + 1) if src.shape[-1] else count * 0
        contiguous = bool(((count == 0) | (end - begin == count)).all())
        begin = np.where(count > 0, begin, 0)
        out = (begin.astype(np.int64) << 32) | count.astype(np.int64)
    if not contiguous:
        raise Unsupported("layout_range (low-latency handle[1]) needs each source rank's rows "
                          "of an expert to be contiguous, and this engine's are not")
    return out


class LowLatencyScales:
    """DeepEP V1's layout of low-latency FP8 scales (csrc/deep_ep.cpp `low_latency_dispatch`,
    csrc/kernels/internode_ll.cu), from EPD's row-major float32 `[L, N, S]` (N = num_ranks *
    num_max tokens, S = hidden / 128): column-major in the last two dimensions (storage
    `[L, S, N]`, the TMA layout DeepGEMM reads); with `use_ue8m0`, each scale's exponent byte
    (`bits >> 23`; the scales are powers of two) packed four to an int32, byte k of word j
    holding scale 4j + k: int32 `[L, N, S/4]`, column-major too.

    `out` is allocated once per call, before the data has arrived (a receive hook returns it at
    once); `fill()` writes it on the current stream, after the data (the hook's wait)."""

    def __init__(self, scales: Any, use_ue8m0: bool, out: Any = None) -> None:
        """`out`: made by `allocator(scales, use_ue8m0)` for these scales and this format
        (the checks were done then; nothing here checks it again)."""
        self.src, self.use_ue8m0 = scales, use_ue8m0
        self.out = out if out is not None else LowLatencyScales.allocator(scales, use_ue8m0)()

    @staticmethod
    def allocator(scales: Any, use_ue8m0: bool) -> Callable[[], Any]:
        """A function that allocates `out` for `scales` (on the current stream): `__init__`'s,
        and that of a caller that makes one per call for the same source (a plain dispatch's
        copy-out: the checks and the layout once)."""
        lx, n, s = scales.shape
        if use_ue8m0 and s % 4:
            raise InvalidArgument(f"use_ue8m0 packs 4 scales per int32: hidden must be a "
                                  f"multiple of 512, got {s * 128}")
        cols = s // 4 if use_ue8m0 else s
        torch = torch_if_loaded()
        if torch is not None and isinstance(scales, torch.Tensor):
            # ([lx, cols, n] transposed in its last two dimensions, in one allocation call)
            return functools.partial(torch.empty_strided, (lx, n, cols), (cols * n, 1, n),
                                     dtype=torch.int32 if use_ue8m0 else torch.float32,
                                     device=scales.device)
        dtype = np.int32 if use_ue8m0 else np.float32
        return lambda: np.empty((lx, cols, n), dtype=dtype).transpose(0, 2, 1)

    def fill(self) -> Any:
        src = self.src
        torch = torch_if_loaded()
        is_torch = torch is not None and isinstance(src, torch.Tensor)
        if self.use_ue8m0:
            bits = src.view(torch.int32) if is_torch else np.asarray(src).view(np.int32)
            e = (bits >> 23) & 0xFF
            src = e[..., 0::4] | (e[..., 1::4] << 8) | (e[..., 2::4] << 16) | (e[..., 3::4] << 24)
        if is_torch:
            self.out.copy_(src)
        else:
            self.out[...] = src
        return self.out
