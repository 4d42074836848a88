"""The client API: a `Session` with one engine, and the `Group`s it joins.

    with Session(socket_dir="/run/epd", engine=0) as s:
        g = s.join("moe-layer", rank=0, num_ranks=2, num_experts=8, hidden=256,
                   max_tokens_per_rank=128, num_topk=2)
        out = g.dispatch(x, topk_idx, topk_weights)
        y = expert(out.recv_x, out.recv_topk_idx)
        combined, weights = g.combine(y, out.handle, topk_weights=out.recv_topk_weights)

The session's gRPC stream is its lease: when this process exits, the engine frees everything
the session held and aborts the groups it belonged to.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from ..proto import counter_page, dtypes
from ..proto.errors import EpdError
from ..proto.v1 import epd_pb2
from . import tensors as T
from .transport import FastPathTransport, GrpcTransport, Transport

DEFAULT_SOCKET_DIR = "/run/epd"
MAX_DEVICE_REGIONS = 1024  # cached CUDA IPC registrations per session (oldest dropped)
RPC_MARGIN = 5.0  # the engine's own deadline fires first and names the missing rank
CONTROL_TIMEOUT = 30.0  # calls that wait for no peer (open, register, leave, stats)


def engine_socket(socket_dir: str | None = None, engine: int = 0) -> str:
    folder = socket_dir or os.environ.get("EPD_SOCKET_DIR", DEFAULT_SOCKET_DIR)
    return os.path.join(folder, f"gpu{engine}.sock")


@dataclass
class Handle:
    """What a dispatch leaves for combine and cached dispatch (state stays in the engine)."""

    group: Group
    handle_id: int
    num_tokens: int
    num_recv_tokens: int
    rows: int  # rows of recv_x (num_worst_tokens when set)


@dataclass
class DispatchResult:
    recv_x: np.ndarray
    recv_x_scales: np.ndarray | None
    recv_topk_idx: np.ndarray | None
    recv_topk_weights: np.ndarray | None
    num_recv_tokens_per_expert: list[int]
    handle: Handle
    recv_src_idx: np.ndarray
    rank_prefix_matrix: np.ndarray
    num_recv_tokens: int


@dataclass
class LowLatencyHandle:
    """What a low-latency dispatch leaves for low-latency combine (state stays in the engine)."""

    group: Group
    handle_id: int
    num_tokens: int
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    hidden: int


@dataclass
class LowLatencyDispatchResult:
    recv_x: Any  # [L, R*num_max, H]: bf16, or e4m3 with use_fp8 (rows beyond recv_count:
    # zero on the cpu backend, unspecified on cuda)
    recv_x_scales: Any | None  # [L, R*num_max, H/128] float32 with use_fp8
    recv_count: Any  # [L] int32: valid rows per local expert
    handle: LowLatencyHandle
    recv_src_rank: Any  # [L, R*num_max] int32: source rank of each row (-1 beyond the count)
    recv_src_idx: Any  # [L, R*num_max] int32: source token of each row (-1 beyond the count)


class PendingDispatch:
    """A dispatch in flight. `counts()` returns as soon as the engine's notify step has published
    the receive counts in the counter page, before the data has arrived."""

    def __init__(self, group: Group, future: Any, sequence: int, copy: bool, x_template: Any):
        self._group, self._future, self._sequence = group, future, sequence
        self._copy, self._template = copy, x_template

    def counts(self, timeout: float = 10.0) -> tuple[int, list[int]]:
        words = self._group._counter
        got = counter_page.wait(words, self._sequence, timeout)
        if got is None:
            raise EpdError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"receive counts not published within {timeout} s")
        if int(words[counter_page.STATUS]):
            raise EpdError(grpc.StatusCode.ABORTED, "the dispatch failed before its counts "
                           "were known; result() has the reason")
        return got

    def result(self) -> DispatchResult:
        try:
            resp = self._future.result()
        finally:
            self._group._session._busy = False
        return self._group._dispatch_result(resp, self._copy, self._template)


class Session:
    def __init__(self, endpoint: str | None = None, *, socket_dir: str | None = None,
                 engine: int = 0, client_name: str = "", timeout: float | None = None,
                 fast_path: bool | None = None, transport: Transport | None = None) -> None:
        """`timeout`: deadline of joins and collectives in seconds; None takes the daemon's
        (`--timeout-seconds`). Calls may pass their own. `fast_path`: use the same-host
        shared-memory ring for data-plane calls when the engine offers it (default: yes, unless
        EPD_FAST_PATH=0); otherwise, or if it is unavailable, gRPC."""
        self.endpoint = endpoint or engine_socket(socket_dir, engine)
        self.timeout = timeout
        self._transport = transport or GrpcTransport(self.endpoint)
        self._stream = self._transport.open_stream(epd_pb2.OpenSessionRequest(
            client_name=client_name or f"pid{os.getpid()}", pid=os.getpid()))
        self._opened: epd_pb2.SessionOpened | None = None
        self._lost: str | None = None
        self._ready = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="epd-session", daemon=True)
        self._watcher.start()
        if not self._ready.wait(CONTROL_TIMEOUT) or self._opened is None:
            self._stream.cancel()
            raise EpdError(grpc.StatusCode.UNAVAILABLE,
                           f"could not open a session on {self.endpoint}: "
                           f"{self._lost or 'no answer'}")
        o = self._opened
        self.session_id = o.session_id
        self.backend = "cuda" if o.backend == epd_pb2.CUDA else "cpu"
        self.engine_index = o.engine_index
        self.device_ordinal = o.device_ordinal
        self.server_version = o.version
        self.default_timeout = o.default_timeout_seconds or 10.0
        self._counter_file = T.ShmFile.open(o.counter_page_path, o.counter_page_bytes)
        self.fast_path_error = ""
        if fast_path is None:
            fast_path = os.environ.get("EPD_FAST_PATH", "1") != "0"
        if fast_path and isinstance(self._transport, GrpcTransport):
            try:
                fp = self._transport.call("OpenFastPath", epd_pb2.OpenFastPathRequest(
                    session_id=self.session_id), CONTROL_TIMEOUT)
                self._transport = FastPathTransport(self._transport, fp.ring_path, fp.slots,
                                                    fp.slot_bytes, fp.spin_seconds)
            except (EpdError, OSError, ValueError) as e:
                self.fast_path_error = str(e)  # stay on gRPC, which carries everything
        self._staging = T.Staging()
        self._staged: dict[str, np.ndarray] = {}  # the last call's staged copies, by name
        self._user_regions: list[T.ShmFile] = []
        # cuda backend: device allocations registered by IPC handle, the ready event, the heap
        self._device_regions: OrderedDict[bytes, str] = OrderedDict()
        self._ready_event: Any = None
        self._heaps: dict[bytes, Any] = {}
        self._groups: dict[str, Group] = {}
        self._busy = False
        self._closed = False
        self._page_mapping: Any = None  # cuda: the counter page in this CUDA context
        self._stream_ops: dict[int, Any] = {}  # armed stream-ordered calls (stream_ops.py)

    # -- lease -------------------------------------------------------------------------------
    def _watch(self) -> None:
        try:
            for event in self._stream:
                if event.HasField("opened"):
                    self._opened = event.opened
                    self._ready.set()
            self._lost = "the engine ended the session"
        except grpc.RpcError as e:
            self._lost = f"{e.code().name}: {e.details()}"
        finally:
            self._ready.set()
            for op in list(self._stream_ops.values()):  # no stream may wait forever on them
                op.release()

    @property
    def alive(self) -> bool:
        return self._lost is None and not self._closed

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        if self._closed:
            raise EpdError(grpc.StatusCode.FAILED_PRECONDITION, "the session is closed")
        if self._lost is not None:
            raise EpdError(grpc.StatusCode.UNAVAILABLE, f"session lost: {self._lost}")
        return self._transport.call(method, request, timeout or CONTROL_TIMEOUT)

    # -- memory ------------------------------------------------------------------------------
    def empty(self, shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
        """An array in a registered shared-memory region: passed to calls without a copy."""
        dt = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = max(int(np.prod(shape)) * dt.itemsize, 1)
        f = T.ShmFile.create(nbytes)
        f.region_id = self._register(f)
        self._user_regions.append(f)
        return f.view(0, shape, dt)

    def _register(self, f: T.ShmFile) -> str:
        try:
            resp = self._call("RegisterRegion", epd_pb2.RegisterRegionRequest(
                session_id=self.session_id, shm_path=f.path, size_bytes=f.size))
        finally:
            # Both sides have it mapped now (or registration failed): the name can go, so no
            # file outlives this process however it ends.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f.path)
        return resp.region_id

    def _grow_staging(self, nbytes: int) -> None:
        old = self._staging.file
        size = max(1 << 20, 1 << (2 * nbytes - 1).bit_length())
        f = T.ShmFile.create(size)
        f.region_id = self._register(f)
        self._staging.file = f
        self._staging.used = 0
        if old is not None:
            self._call("UnregisterRegion", epd_pb2.UnregisterRegionRequest(
                session_id=self.session_id, region_id=old.region_id))
            old.close(unlink=True)

    def _device_descs(self, arrays: dict[str, Any], event: bool = True) -> dict[str, Any]:
        """cuda backend: device tensors by CUDA IPC region + offset, and the ready event."""
        from . import cuda_ipc

        out: dict[str, Any] = {}
        template = None
        for name, a in arrays.items():
            if a is None:
                continue
            if not cuda_ipc.is_device_array(a):
                raise TypeError(f"{name}: the engine runs the cuda backend and takes CUDA "
                                f"tensors (torch on 'cuda' or CuPy); got {type(a).__name__}")
            v = cuda_ipc.describe_device(a, name)
            template = template if template is not None else a
            heap = next((h for h in self._heaps.values() if h.ptr <= v.ptr < h.ptr + h.size),
                        None)
            if heap is not None:  # an output of ours passed back in (combine(recv_x))
                out[name] = epd_pb2.TensorDesc(region_id=heap.region_id,
                                               offset_bytes=v.ptr - heap.ptr,
                                               shape=list(v.shape), dtype=v.dtype,
                                               strides=list(v.strides))
                continue
            if not (v.ptr and all(v.shape)):  # empty: no allocation; any region, offset 0
                rid = next(iter(self._device_regions.values()), None) or next(
                    (h.region_id for h in self._heaps.values()), None)
                if rid is None:
                    raise EpdError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"{name}: an empty tensor before any group was joined")
                out[name] = epd_pb2.TensorDesc(region_id=rid, offset_bytes=0,
                                               shape=list(v.shape), dtype=v.dtype,
                                               strides=list(v.strides))
                continue
            base, size = cuda_ipc.allocation_of(v.ptr)
            handle = cuda_ipc.ipc_handle(base, v.device)
            rid = self._device_regions.get(handle)
            if rid is None:
                rid = self._call("RegisterRegion", epd_pb2.RegisterRegionRequest(
                    session_id=self.session_id, cuda_ipc_handle=handle, size_bytes=size,
                    device_ordinal=v.device)).region_id
                self._device_regions[handle] = rid
                if len(self._device_regions) > MAX_DEVICE_REGIONS:
                    _, old = self._device_regions.popitem(last=False)
                    self._call("UnregisterRegion", epd_pb2.UnregisterRegionRequest(
                        session_id=self.session_id, region_id=old))
            out[name] = epd_pb2.TensorDesc(region_id=rid, offset_bytes=v.ptr - base,
                                           shape=list(v.shape), dtype=v.dtype,
                                           strides=list(v.strides))
        if template is not None and event:
            if self._ready_event is None:
                self._ready_event = cuda_ipc.ReadyEvent(
                    cuda_ipc.describe_device(template, "").device)
            out["ready_event"] = self._ready_event.record(template)
        return out

    def _heap(self, handle: bytes, size: int, device: int) -> Any:
        from . import cuda_ipc

        heap = self._heaps.get(handle)
        if heap is None:
            heap = self._heaps[handle] = cuda_ipc.MappedHeap(handle, size, device)
        return heap

    def _descs(self, arrays: dict[str, Any]) -> dict[str, Any]:
        """Descriptors for a call's inputs: registered arrays as they are, others staged."""
        self._staged = {}
        if self.backend == "cuda":
            return self._device_descs(arrays)
        out: dict[str, epd_pb2.TensorDesc] = {}
        staged: dict[str, np.ndarray] = {}
        for name, a in arrays.items():
            if a is None:
                continue
            arr = T.to_numpy(a, name)
            dtypes.from_numpy(arr.dtype)  # raises on an element type EPD does not carry
            region = self._region_of(arr)
            if region is not None:
                out[name] = T.desc(region.region_id, arr.ctypes.data - region.base, arr)
            else:
                staged[name] = np.ascontiguousarray(arr)
        total = sum(a.nbytes + 256 for a in staged.values())
        self._staging.reset()
        if staged and self._staging.need(total):
            self._grow_staging(total)
        for name, arr in staged.items():
            off, dst = self._staging.put(arr)
            out[name] = T.desc(self._staging.file.region_id, off, dst)
            self._staged[name] = dst
        return out

    def _write_back(self, name: str, user: Any) -> None:
        """An input the engine updates in place (out=, cumulative stats): when it travelled as
        a staged copy, copy the engine's result back into the caller's array."""
        dst = self._staged.get(name)
        if dst is not None:
            T.to_numpy(user, name)[...] = dst

    def _region_of(self, arr: np.ndarray) -> T.ShmFile | None:
        if arr.size == 0:
            return None
        lo = arr.ctypes.data
        for f in self._user_regions:
            if f.base <= lo < f.base + f.size:
                return f
        return None

    # -- groups ------------------------------------------------------------------------------
    def join(self, name: str, *, rank: int, num_ranks: int, num_experts: int, hidden: int,
             max_tokens_per_rank: int, num_topk: int, dtype: str = "bfloat16",
             low_latency_mode: bool = False, timeout: float | None = None) -> Group:
        """Join (and with the other ranks, form) a group; blocks until all ranks arrived.
        `low_latency_mode` reserves the low-latency buffers (sized by max_tokens_per_rank),
        which the cuda backend needs for `low_latency_dispatch`."""
        spec = epd_pb2.GroupSpec(name=name, num_ranks=num_ranks, num_experts=num_experts,
                                 hidden=hidden, max_tokens_per_rank=max_tokens_per_rank,
                                 num_topk=num_topk, x_dtype=dtypes.from_name(dtype),
                                 low_latency_mode=low_latency_mode)
        wait = self._deadline(timeout)
        resp = self._call("JoinGroup", epd_pb2.JoinGroupRequest(
            session_id=self.session_id, spec=spec, rank=rank, timeout_seconds=wait),
            wait + RPC_MARGIN)
        g = Group(self, spec, resp)
        self._groups[g.group_id] = g
        return g

    def _deadline(self, timeout: float | None) -> float:
        """A call's deadline: its own, else the session's, else the daemon's default."""
        for t in (timeout, self.timeout):
            if t is not None:
                return t
        return self.default_timeout

    @property
    def transport(self) -> str:
        """'fastpath' or 'grpc': how data-plane calls travel now."""
        t = self._transport
        return "grpc" if getattr(t, "broken", None) else t.name

    def ping(self) -> None:
        """The empty operation: one round trip to the engine (measures the transport)."""
        self._call("Ping", epd_pb2.PingRequest())

    def stats(self) -> epd_pb2.GetStatsResponse:
        return self._call("GetStats", epd_pb2.GetStatsRequest(session_id=self.session_id))

    def close(self) -> None:
        """End the lease: the engine leaves every group of this session and frees its memory."""
        if self._closed:
            return
        self._closed = True
        for op in list(self._stream_ops.values()):
            op.release()
        self._stream_ops.clear()
        for g in list(self._groups.values()):
            g._release()
        self._stream.cancel()
        self._watcher.join(timeout=5)
        self._transport.close()
        for heap in self._heaps.values():
            heap.close()
        for f in [*self._user_regions, self._staging.file]:
            if f is not None:
                f.close(unlink=True)
        if self._page_mapping is not None:
            self._page_mapping.close()  # before the unmap, never after
        self._counter_file.close(unlink=False)

    def _mapped_page(self) -> Any:
        from . import cuda_ipc

        if self._page_mapping is None:
            self._page_mapping = cuda_ipc.MappedPage(self._counter_file.base,
                                                     self._counter_file.size,
                                                     self.device_ordinal)
        return self._page_mapping

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Group:
    """This process's rank of one group. Outputs are views into the engine's output region for
    this rank unless copy=True (the default): a view stays valid until the next call of the
    same kind (dispatch, combine, layout) on this group."""

    def __init__(self, session: Session, spec: epd_pb2.GroupSpec,
                 resp: epd_pb2.JoinGroupResponse) -> None:
        self._session = session
        self.spec = spec
        self.name = spec.name
        self.group_id = resp.group_id
        self.rank = resp.rank
        self.num_ranks = spec.num_ranks
        self._out_region_id = resp.output_region_id
        if session.backend == "cuda":
            self._out = None
            self._heap = session._heap(resp.output_region_ipc, resp.output_region_bytes,
                                       session.device_ordinal)
            self._heap.region_id = resp.output_region_id
        else:
            self._out = T.ShmFile.open(resp.output_region_path, resp.output_region_bytes)
            self._out.region_id = resp.output_region_id
        self._counter = counter_page.slot_words(session._counter_file.mm, resp.counter_slot)
        self._left = False

    def _view(self, d: epd_pb2.TensorDesc, copy: bool, template: Any = None) -> Any:
        """An output as the caller's array type (NumPy/torch CPU, or CuPy/torch CUDA)."""
        if d.region_id != self._out_region_id:
            raise EpdError(grpc.StatusCode.INTERNAL, f"output in unknown region {d.region_id}")
        if self._out is None:
            return self._heap.view(d, copy, template)
        arr = self._out.view(d.offset_bytes, tuple(d.shape), dtypes.to_numpy(d.dtype),
                             tuple(d.strides))
        return T.like(arr.copy() if copy else arr, template)

    def _timeout(self, timeout: float | None) -> float:
        return self._session._deadline(timeout)

    def get_dispatch_layout(self, topk_idx: Any, *, copy: bool = True):
        """(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool), as the caller's array type."""
        d = self._session._descs({"topk_idx": topk_idx})
        resp = self._session._call("GetDispatchLayout", epd_pb2.GetDispatchLayoutRequest(
            session_id=self._session.session_id, group_id=self.group_id, **d))
        return tuple(self._view(x, copy, topk_idx) for x in
                     (resp.num_tokens_per_rank, resp.num_tokens_per_expert,
                      resp.is_token_in_rank))

    def _dispatch_request(self, x, topk_idx, topk_weights, x_scales, expert_alignment,
                          num_worst_tokens, handle, timeout):
        if handle is not None and handle.group is not self:
            raise EpdError(grpc.StatusCode.INVALID_ARGUMENT,
                           "the handle belongs to another group")
        d = self._session._descs({"x": x, "x_scales": x_scales, "topk_idx": topk_idx,
                                  "topk_weights": topk_weights})
        t = self._timeout(timeout)
        req = epd_pb2.DispatchRequest(
            session_id=self._session.session_id, group_id=self.group_id,
            expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
            cached_handle=handle.handle_id if handle is not None else 0, timeout_seconds=t,
            **d)
        return req, t + RPC_MARGIN

    def dispatch(self, x: Any, topk_idx: Any = None, topk_weights: Any = None, *,
                 x_scales: Any = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 handle: Handle | None = None, timeout: float | None = None,
                 copy: bool = True) -> DispatchResult:
        """Send each token to the ranks holding its experts (DESIGN.md §6). With `handle`, the
        cached mode: the routing of that earlier dispatch is reused and no counts travel."""
        req, rpc_timeout = self._dispatch_request(x, topk_idx, topk_weights, x_scales,
                                                  expert_alignment, num_worst_tokens, handle,
                                                  timeout)
        resp = self._session._call("Dispatch", req, rpc_timeout)
        return self._dispatch_result(resp, copy, x)

    def dispatch_async(self, x: Any, topk_idx: Any = None, topk_weights: Any = None, *,
                       x_scales: Any = None, expert_alignment: int = 1,
                       num_worst_tokens: int = 0, handle: Handle | None = None,
                       timeout: float | None = None, copy: bool = True) -> PendingDispatch:
        """Start a dispatch; read the receive counts with `.counts()` while it runs."""
        s = self._session
        if s._busy:
            raise EpdError(grpc.StatusCode.FAILED_PRECONDITION,
                           "a dispatch of this session is still in flight")
        req, rpc_timeout = self._dispatch_request(x, topk_idx, topk_weights, x_scales,
                                                  expert_alignment, num_worst_tokens, handle,
                                                  timeout)
        # One dispatch in flight per session, and the engine publishes every dispatch it runs
        # (failures too, with a status): ours is the first sequence after the current one.
        expected = int(self._counter[counter_page.SEQ]) + 1
        s._busy = True
        fut = s._transport.call_async("Dispatch", req, rpc_timeout)
        return PendingDispatch(self, fut, expected, copy, x)

    def _dispatch_result(self, resp: epd_pb2.DispatchResponse, copy: bool,
                         template: Any) -> DispatchResult:
        v = self._view

        def opt(d):
            return v(d, copy, template) if d.region_id else None
        recv_x = v(resp.recv_x, copy, template)
        rows = recv_x.shape[0]
        h = Handle(self, resp.handle, 0, resp.num_recv_tokens, rows)
        return DispatchResult(
            recv_x=recv_x, recv_x_scales=opt(resp.recv_x_scales),
            recv_topk_idx=opt(resp.recv_topk_idx), recv_topk_weights=opt(resp.recv_topk_weights),
            num_recv_tokens_per_expert=list(resp.num_recv_tokens_per_expert), handle=h,
            recv_src_idx=v(resp.recv_src_idx, copy, template),
            rank_prefix_matrix=v(resp.rank_prefix_matrix, copy, template),
            num_recv_tokens=resp.num_recv_tokens)

    def combine(self, x: Any, handle: Handle, topk_weights: Any = None, bias_0: Any = None,
                bias_1: Any = None, *, timeout: float | None = None,
                copy: bool = True) -> tuple[Any, Any]:
        """Bring expert outputs back to their tokens and sum them in fp32 (DESIGN.md §6).
        Returns (combined_x, combined_topk_weights or None)."""
        if handle.group is not self:
            raise EpdError(grpc.StatusCode.INVALID_ARGUMENT, "the handle belongs to another group")
        d = self._session._descs({"x": x, "topk_weights": topk_weights, "bias_0": bias_0,
                                  "bias_1": bias_1})
        t = self._timeout(timeout)
        resp = self._session._call("Combine", epd_pb2.CombineRequest(
            session_id=self._session.session_id, group_id=self.group_id,
            handle=handle.handle_id, timeout_seconds=t, **d), t + RPC_MARGIN)
        cx = self._view(resp.combined_x, copy, x)
        cw = (self._view(resp.combined_topk_weights, copy, x)
              if resp.combined_topk_weights.region_id else None)
        return cx, cw

    # -- low-latency mode (DeepEP low_latency_dispatch / low_latency_combine) ------------------
    def low_latency_dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: int,
                             *, num_experts: int | None = None, use_fp8: bool = False,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             cumulative_local_expert_recv_stats: Any = None,
                             timeout: float | None = None,
                             copy: bool = True) -> LowLatencyDispatchResult:
        """Send each (token, expert) pair to the rank of that expert; every rank receives
        `[local experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` plus the counts
        (DESIGN.md §6). `num_max_dispatch_tokens_per_rank` must be the same on every rank and
        at most the group's max_tokens_per_rank; `num_experts` defaults to the group's.
        With use_fp8 the tokens are quantised on the source (e4m3 + float32 scales per 128
        channels); round_scale / use_ue8m0 make the scales powers of two (float32 here).
        `cumulative_local_expert_recv_stats` (int32 [local experts]) gets recv_count added in
        place. Views (copy=False) stay valid until the next low-latency dispatch."""
        s = self._session
        stats = cumulative_local_expert_recv_stats
        d = s._descs({"x": x, "topk_idx": topk_idx,
                      "cumulative_local_expert_recv_stats": stats})
        t = self._timeout(timeout)
        resp = s._call("LowLatencyDispatch", epd_pb2.LowLatencyDispatchRequest(
            session_id=s.session_id, group_id=self.group_id,
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
            num_experts=self.spec.num_experts if num_experts is None else num_experts,
            use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, timeout_seconds=t,
            **d), t + RPC_MARGIN)
        if stats is not None:
            s._write_back("cumulative_local_expert_recv_stats", stats)
        v = self._view
        shape, _ = T.meta(x, "x")
        handle = LowLatencyHandle(self, resp.handle, shape[0], num_max_dispatch_tokens_per_rank,
                                  self.spec.num_experts, self.spec.hidden)
        return LowLatencyDispatchResult(
            recv_x=v(resp.recv_x, copy, x),
            recv_x_scales=v(resp.recv_x_scales, copy, x) if resp.recv_x_scales.region_id
            else None,
            recv_count=v(resp.recv_count, copy, x), handle=handle,
            recv_src_rank=v(resp.recv_src_rank, copy, x),
            recv_src_idx=v(resp.recv_src_idx, copy, x))

    def low_latency_combine(self, x: Any, topk_idx: Any, topk_weights: Any,
                            handle: LowLatencyHandle, *, out: Any = None,
                            timeout: float | None = None, copy: bool = True) -> Any:
        """Bring the expert outputs `x` ([local experts, num_ranks * num_max, hidden], rows as
        dispatched) back and reduce them with the weights:
        out[t] = sum_k w[t, k] * y[e_k][row of t], in fp32, k order, skipping -1. Returns
        [T, hidden]; with `out=` the result is written into that array, which is returned."""
        if not isinstance(handle, LowLatencyHandle) or handle.group is not self:
            raise EpdError(grpc.StatusCode.INVALID_ARGUMENT,
                           "the handle is not a low-latency handle of this group")
        s = self._session
        d = s._descs({"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights, "out": out})
        t = self._timeout(timeout)
        resp = s._call("LowLatencyCombine", epd_pb2.LowLatencyCombineRequest(
            session_id=s.session_id, group_id=self.group_id, handle=handle.handle_id,
            timeout_seconds=t, **d), t + RPC_MARGIN)
        if out is not None:
            s._write_back("out", out)
            return out
        return self._view(resp.combined_x, copy, x)

    # -- stream-ordered (CUDA-graph capturable) low-latency calls: client/stream_ops.py ------
    def _require_cuda(self) -> None:
        if self._session.backend != "cuda":
            raise EpdError(grpc.StatusCode.FAILED_PRECONDITION,
                           "stream-ordered calls need the cuda backend")

    def arm_low_latency_dispatch(self, x: Any, topk_idx: Any,
                                 num_max_dispatch_tokens_per_rank: int, *,
                                 use_fp8: bool = False, round_scale: bool = False,
                                 use_ue8m0: bool = False,
                                 cumulative_local_expert_recv_stats: Any = None,
                                 timeout: float | None = None) -> Any:
        """Arm a low-latency dispatch that reads `x` and `topk_idx` (fixed tensors) each time
        it is launched from a CUDA stream; `op.result` holds the fixed output views
        (recv_count etc. are valid after the stream passes `op.launch()`)."""
        from .stream_ops import StreamOp

        self._require_cuda()
        s = self._session
        d = s._device_descs({"x": x, "topk_idx": topk_idx,
                             "cumulative_local_expert_recv_stats":
                                 cumulative_local_expert_recv_stats}, event=False)
        inner = epd_pb2.LowLatencyDispatchRequest(
            session_id=s.session_id, group_id=self.group_id,
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
            num_experts=self.spec.num_experts, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0, timeout_seconds=self._timeout(timeout), **d)
        resp = s._call("ArmStreamOp", epd_pb2.ArmStreamOpRequest(
            session_id=s.session_id, group_id=self.group_id, low_latency_dispatch=inner))
        r = resp.low_latency_dispatch
        result = LowLatencyDispatchResult(
            recv_x=self._view(r.recv_x, False, x),
            recv_x_scales=self._view(r.recv_x_scales, False, x) if r.recv_x_scales.region_id
            else None,
            recv_count=self._view(r.recv_count, False, x), handle=None,
            recv_src_rank=self._view(r.recv_src_rank, False, x),
            recv_src_idx=self._view(r.recv_src_idx, False, x))
        op = StreamOp(self, resp.op_id, resp.counter_slot, "dispatch", result, x)
        result.handle = op
        s._stream_ops[op.op_id] = op
        return op

    def arm_low_latency_combine(self, x: Any, topk_idx: Any, topk_weights: Any,
                                dispatch_op: Any, *, out: Any = None,
                                timeout: float | None = None) -> Any:
        """Arm the combine of an armed dispatch: each launch brings back the expert outputs
        in `x` for the dispatch's latest launch; `op.result` is `out` (or a fixed view)."""
        from .stream_ops import StreamOp

        self._require_cuda()
        s = self._session
        d = s._device_descs({"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights,
                             "out": out}, event=False)
        inner = epd_pb2.LowLatencyCombineRequest(
            session_id=s.session_id, group_id=self.group_id,
            timeout_seconds=self._timeout(timeout), **d)
        resp = s._call("ArmStreamOp", epd_pb2.ArmStreamOpRequest(
            session_id=s.session_id, group_id=self.group_id, low_latency_combine=inner,
            dispatch_op=dispatch_op.op_id))
        result = out if out is not None else self._view(resp.combined_x, False, x)
        op = StreamOp(self, resp.op_id, resp.counter_slot, "combine", result, x)
        s._stream_ops[op.op_id] = op
        return op

    def leave(self) -> None:
        """Leave the group. Its other ranks' later collectives fail with ABORTED."""
        if self._left:
            return
        self._session._call("LeaveGroup", epd_pb2.LeaveGroupRequest(
            session_id=self._session.session_id, group_id=self.group_id))
        self._release()

    def _release(self) -> None:
        self._left = True
        self._session._groups.pop(self.group_id, None)
        if self._out is not None:
            self._out.close(unlink=False)
