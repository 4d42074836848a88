"""Per-rank driver of the intranode kernels: sequence numbers, handles, output views, errors.

`RankRunner` is what a CUDA `RankComm` wraps: it knows its rank's buffer base, the device
table of peer buffer bases, the sequence counters that every rank advances in the same order,
and it launches notify + dispatch and combine on its stream. (tests/gpu/local_group.py drives
all R ranks of a group from one process for the GPU tests and the benchmarks.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...proto import abi
from . import cuda_kernels as ck

cp = ck.cp

DEFAULT_TIMEOUT_NS = 10_000_000_000


def stream_priority_of(stream_ptr: int) -> int:
    """The priority CUDA gave a stream (a requested one is clamped to the device's range)."""
    from cuda.bindings import driver

    err, priority = driver.cuStreamGetPriority(driver.CUstream(stream_ptr))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuStreamGetPriority failed: {err}")
    return int(priority)


def peer_array(peer_bases: list[int], remote: dict[int, tuple[int, int]] | None) -> Any:
    """The kernels' device table of where each rank's buffer is (on the current device): its
    pointer; with ranks on other nodes (`remote`: rank -> (symmetric address, PE)) the NVSHMEM
    build's table, pointers (0: other node), then addresses, then PEs."""
    table = [int(b) for b in peer_bases]
    if remote:
        table = ([0 if r in remote else b for r, b in enumerate(table)]
                 + [remote.get(r, (0, 0))[0] for r in range(len(table))]
                 + [remote.get(r, (0, 0))[1] for r in range(len(table))])
    return cp.asarray(np.array(table, dtype=np.uint64))


def dense_rows(a: Any, stream: Any) -> Any:
    """`a` (2-D; rows may be strided, each row dense, as tensors.resolve allows) as a C-contiguous
    array. A strided one is copied on `stream`, the kernels' stream: a copy on CuPy's current
    stream (the legacy one) would not be ordered before them. The copy is one
    cudaMemcpy2DAsync, not CuPy's copy kernel, which is loaded at its first use
    (cuda_driver.load_function)."""
    if a.flags.c_contiguous:
        return a
    rows, cols = a.shape
    width = cols * a.itemsize
    with stream:
        out = cp.empty((rows, cols), a.dtype)
        if a.strides[1] != a.itemsize or a.strides[0] < width:  # (columns of one element)
            out[...] = a
            return out
    cp.cuda.runtime.memcpy2DAsync(out.data.ptr, width, a.data.ptr, a.strides[0], width, rows,
                                  cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
    return out


@dataclass
class DispatchResult:
    handle: ck.DispatchHandle
    num_worst_tokens: int
    with_meta: bool


class RankRunner:
    def __init__(self, kernels: ck.Kernels, layout: ck.RankBufferLayout, rank: int,
                 peer_bases: list[int], device_id: int, x_dtype: Any, y_dtype: Any,
                 owner: Any = None, ll_layout: ck.LowLatencyLayout | None = None,
                 stream_priority: int = 0,
                 remote: dict[int, tuple[int, int]] | None = None,
                 num_nodes: int = 1, streams: tuple[Any, Any] | None = None) -> None:
        """`remote`: the ranks on other nodes, rank -> (symmetric address of its buffer in
        this PE's heap, its PE); their `peer_bases` entries are ignored, and `kernels` must be
        the NVSHMEM build (cuda_remote.py). `num_nodes` > 1: the group is placed node-major
        over that many nodes and normal mode runs the hierarchical semantics (the top of
        cuda/epd_intranode.cu); 1: flat. `streams`: the (stream, side stream) to run on, another
        runner's (a two-stage group's stage runners share their rank's: cuda_stages.py)."""
        self.k = kernels
        self.num_nodes = num_nodes
        self.ll = ll_layout
        self.layout = layout
        self.rank = rank
        self.device_id = device_id
        self.x_dtype = np.dtype(x_dtype)
        self.y_dtype = np.dtype(y_dtype)
        with cp.cuda.Device(device_id):
            self.peers = peer_array(peer_bases, remote)
            # The rank's kernels run here, at its group's service-class priority (0: the
            # default, the least urgent); the side stream (abort writes) keeps the default.
            if streams is not None:
                self.stream, self.side_stream = streams
            else:
                self.stream = cp.cuda.Stream(non_blocking=True, priority=stream_priority)
                self.side_stream = cp.cuda.Stream(non_blocking=True)
            self.stream_priority = stream_priority_of(self.stream.ptr)
        self.base = int(peer_bases[rank])
        self.views = layout.views(self.base, owner, device_id, self.x_dtype, self.y_dtype)
        self.seq = {"notify": 0, "dispatch": 0, "combine": 0, "ll_dispatch": 0, "ll_combine": 0}
        # the low-latency dispatch sequence that last filled each receive buffer (0: none):
        # a combine brings back a dispatch only while its buffer still holds it
        self.ll_filled = [0] * abi.LL_BUFFERS
        self._keep: tuple = ()
        self._refused: tuple = ()  # a refused dispatch's notify handle and ids (refuse_dispatch)

    def reset_ctrl(self) -> None:
        with cp.cuda.Device(self.device_id):  # (the control block ends where recv_x starts)
            cp.cuda.runtime.memset(self.base, 0, self.layout.offsets["recv_x"])

    # -- collectives (asynchronous on self.stream) -----------------------------------------
    def dispatch(self, x: Any, x_scales: Any | None, topk_idx: Any | None,
                 topk_weights: Any | None, *, alignment: int = 1, num_worst_tokens: int = 0,
                 cached: DispatchResult | None = None, counter_slot_ptr: int = 0,
                 counter_seq: int | None = None,
                 timeout_ns: int = DEFAULT_TIMEOUT_NS, num_sms: int = ck.DEFAULT_NUM_SMS,
                 layout_out: tuple[Any, Any, Any] | None = None,
                 routing: tuple[Any, Any] | None = None,
                 result: DispatchResult | None = None,
                 whole_group: bool = False, fail_from: Any = None) -> DispatchResult:
        """`routing`: (is_token_in_rank, num_tokens_per_expert) of a dispatch without top-k;
        `result`: the one `dispatch_result` made for this call (else made here);
        `whole_group`: a whole group's dispatch (not a stage's): notify fails the call on every
        rank alike when a rank would receive more than num_worst_tokens or any rank passed a
        bad expert id or count (a stage pads its own rows, its data kernel's sticky error is
        what reaches the group, and its whole group's notify reports the bad ids);
        `fail_from`: a stage's, the whole group's notify's recv_info (kernels.notify)."""
        lay = self.layout
        if result is None:
            result = self.dispatch_result(int(x.shape[0]), cached, num_worst_tokens)
        with cp.cuda.Device(self.device_id):
            if cached is None:
                handle = result.handle
                self.notify(topk_idx, result, alignment=alignment,
                            counter_slot_ptr=counter_slot_ptr, counter_seq=counter_seq,
                            timeout_ns=timeout_ns, layout_out=layout_out, routing=routing,
                            num_worst=num_worst_tokens if whole_group else 0,
                            bad_alike=whole_group, fail_from=fail_from)
            else:
                handle = cached.handle
            self.seq["dispatch"] += 1
            self.k.dispatch(x, x_scales, topk_idx if cached is None else None,
                            topk_weights if cached is None else None, lay, self.rank,
                            self.peers, handle, self.seq["dispatch"], timeout_ns=timeout_ns,
                            num_sms=num_sms, num_worst_tokens=num_worst_tokens,
                            barrier=cached is not None, stream=self.stream)
        return result

    def notify(self, topk_idx: Any | None, result: DispatchResult, *, alignment: int = 1,
               counter_slot_ptr: int = 0, counter_seq: int | None = None,
               timeout_ns: int = DEFAULT_TIMEOUT_NS,
               layout_out: tuple[Any, Any, Any] | None = None,
               routing: tuple[Any, Any] | None = None, num_worst: int = 0,
               bad_alike: bool = False, fail_from: Any = None, refused: int = 0) -> None:
        """The layout exchange alone into `result`'s handle (counts, rank prefix matrix, the
        receive count published in the counter slot): a dispatch's first kernel, or a
        two-stage group's whole-group notify (cuda_stages.py). `num_worst` > 0: a rank
        receiving more rows fails the call on every rank, before any row moves; `bad_alike`:
        so does any rank's bad expert id or count (kernels.notify)."""
        lay = self.layout
        with cp.cuda.Device(self.device_id):
            self.seq["notify"] += 1
            if lay.num_ranks > ck.MAX_RANKS:  # a two-stage group's notify-only slot
                if topk_idx is None or layout_out is not None:
                    raise ValueError("a notify of more than MAX_RANKS ranks takes top-k ids "
                                     "and writes no layout outputs")
                self.k.wide_notify(topk_idx, lay.num_ranks * lay.num_local_experts,
                                   lay.num_ranks, self.rank, self.peers, self.seq["notify"],
                                   result.handle, timeout_ns=timeout_ns, alignment=alignment,
                                   counter_slot_ptr=counter_slot_ptr, stream=self.stream,
                                   counter_seq=counter_seq,
                                   max_tokens=lay.max_recv // lay.num_ranks, refused=refused)
                return
            self.k.notify(topk_idx, lay.num_ranks * lay.num_local_experts, lay.num_ranks,
                          self.rank, self.peers, self.seq["notify"], result.handle,
                          timeout_ns=timeout_ns, alignment=alignment,
                          counter_slot_ptr=counter_slot_ptr, layout_out=layout_out,
                          stream=self.stream, counter_seq=counter_seq, routing=routing,
                          max_tokens=lay.max_recv // lay.num_ranks, num_worst=num_worst,
                          bad_alike=bad_alike, fail_from=fail_from, refused=refused)

    def refuse_dispatch(self, num_topk: int, timeout_ns: int) -> None:
        """This rank's part of a dispatch its engine refused: a notify of no tokens whose
        payload says so (every rank then fails the call alike, its data kernels skipping it),
        and the data kernel's sequence, which the peers' skipping kernels take too."""
        with cp.cuda.Device(self.device_id):
            res = self.dispatch_result(0, None, 0)
            idx = cp.empty((0, num_topk), cp.int64)
            self.notify(idx, res, timeout_ns=timeout_ns, bad_alike=True,
                        refused=ck.ERR_REFUSED)
            self.seq["dispatch"] += 1
            self._refused = (res, idx)  # (they outlive the launch: kept until the next one)

    def refuse_combine(self, res: DispatchResult | None, timeout_ns: int) -> None:
        """This rank's part of a combine its engine refused: the combine's sequence, taken by
        a kernel that passes its entry barrier and tells every peer (their reduces fail the
        call naming this rank). `res`: the handle's result, when the engine knows it."""
        with cp.cuda.Device(self.device_id):
            self.seq["combine"] += 1
            self.k.combine_refused(self.peers, self.layout.num_ranks, self.rank,
                                   self.seq["combine"], timeout_ns=timeout_ns,
                                   recv_info=None if res is None else res.handle.recv_info,
                                   stream=self.stream)

    def dispatch_result(self, num_tokens: int, cached: DispatchResult | None,
                        num_worst_tokens: int, refill: DispatchResult | None = None
                        ) -> DispatchResult:
        """What a dispatch will fill, before it is launched: a new handle (the layout notify
        writes), a cached dispatch's, or `refill`'s arrays (a released handle of as many
        tokens: DispatchArgs.refill), which spares its allocations."""
        if cached is not None:
            return DispatchResult(cached.handle, num_worst_tokens, False)
        if refill is not None and refill.handle.num_tokens == num_tokens:
            return DispatchResult(refill.handle, num_worst_tokens, True)
        lay = self.layout
        with cp.cuda.Device(self.device_id), self.stream:
            handle = ck.DispatchHandle.allocate(num_tokens, lay.num_ranks,
                                                lay.num_local_experts, self.num_nodes)
        return DispatchResult(handle, num_worst_tokens, True)

    def combine(self, y: Any, res: DispatchResult, out: Any, *, recv_topk_weights: Any = None,
                out_weights: Any = None, bias_0: Any = None, bias_1: Any = None,
                timeout_ns: int = DEFAULT_TIMEOUT_NS, num_sms: int = ck.DEFAULT_NUM_SMS,
                barrier: bool = True) -> None:
        with cp.cuda.Device(self.device_id):
            self.seq["combine"] += 1
            self.k.combine(y, recv_topk_weights, out, out_weights, self.layout, self.rank,
                           self.peers, self.base, res.handle, self.seq["combine"],
                           timeout_ns=timeout_ns, bias_0=bias_0, bias_1=bias_1,
                           num_sms=num_sms, barrier=barrier, stream=self.stream)

    # -- low-latency mode (asynchronous on self.stream; outputs stay in the buffers) --------
    def ll_dispatch(self, x: Any, topk_idx: Any, m: int, *, fp8: bool = False,
                    round_scale: bool = False, timeout_ns: int = DEFAULT_TIMEOUT_NS,
                    num_sms: int = 64, buffer: int = 0) -> int:
        """Launch into receive buffer `buffer`; returns the sequence (the combine of this
        dispatch passes nothing back)."""
        with cp.cuda.Device(self.device_id):
            idx = dense_rows(topk_idx, self.stream)
            self._keep = (idx,)  # a copy must outlive the launch: kept until the next one
            launch = self.k.ll_dispatch_launch(
                x, idx, self.ll, self.rank, self.peers, m, fp8=fp8, round_scale=round_scale,
                timeout_ns=timeout_ns, num_sms=num_sms)
            return self.ll_dispatch_again(launch, buffer)

    def ll_dispatch_again(self, launch: Any, buffer: int = 0) -> int:
        """Launch a packed low-latency dispatch (ll_dispatch_launch) with the next sequence,
        into receive buffer `buffer`."""
        self.seq["ll_dispatch"] += 1
        seq = self.seq["ll_dispatch"]
        launch.set(ck.LL_DISPATCH_SEQ, seq)
        launch.set_buffer(ck.LL_DISPATCH_BUFFER_ARGS, self.ll, buffer)
        launch(self.stream)
        self.ll_filled[buffer] = seq
        return seq

    def ll_combine(self, y: Any, topk_idx: Any, weights: Any, out: Any, m: int, *,
                   timeout_ns: int = DEFAULT_TIMEOUT_NS, num_sms: int = 64,
                   buffer: int = 0) -> None:
        with cp.cuda.Device(self.device_id):
            idx, w = dense_rows(topk_idx, self.stream), dense_rows(weights, self.stream)
            self._keep = (idx, w)
            launches = self.k.ll_combine_launches(
                y, idx, w, out, self.ll, self.rank, self.peers, m, timeout_ns=timeout_ns,
                num_sms=num_sms)
            self.ll_combine_again(launches, buffer)

    def ll_combine_again(self, launches: tuple[Any, Any], buffer: int = 0) -> None:
        """Launch a packed low-latency combine (push, reduce) with the next sequence, bringing
        back the dispatch in receive buffer `buffer`."""
        self.seq["ll_combine"] += 1
        push, reduce = launches
        push.set(ck.LL_PUSH_SEQ, self.seq["ll_combine"])
        reduce.set(ck.LL_REDUCE_SEQ, self.seq["ll_combine"])
        push.set_buffer(ck.LL_PUSH_BUFFER_ARGS, self.ll, buffer)
        reduce.set_buffer(ck.LL_REDUCE_BUFFER_ARGS, self.ll, buffer)
        push(self.stream)
        reduce(self.stream)

    def ll_view(self, name: str, shape: tuple[int, ...], dtype: Any, buffer: int = 0) -> Any:
        """A view of one low-latency buffer of this rank (see LowLatencyLayout)."""
        dt = np.dtype(dtype)
        n = max(int(np.prod(shape)) * dt.itemsize, 1)
        mem = cp.cuda.UnownedMemory(self.base + self.ll.offset(name, buffer), n, self,
                                    self.device_id)
        return cp.ndarray(shape, dt, memptr=cp.cuda.MemoryPointer(mem, 0))

    def ll_outputs(self, m: int, fp8: bool, buffer: int = 0) -> dict[str, Any]:
        lay = self.ll
        lx, rows, h = lay.num_local_experts, lay.num_ranks * m, lay.hidden

        def view(name: str, shape: tuple[int, ...], dtype: Any) -> Any:
            return self.ll_view(name, shape, dtype, buffer)

        out = {"recv_x": view("recv_x", (lx, rows, h), np.uint8 if fp8 else self.x_dtype),
               "recv_count": view("recv_count", (lx,), np.int32),
               "recv_src_rank": view("src_rank", (lx, rows), np.int32),
               "recv_src_idx": view("src_idx", (lx, rows), np.int32)}
        if fp8:
            out["recv_x_scales"] = view("scales", (lx, rows, h // ck.FP8_BLOCK), np.float32)
        return out

    def abort(self, code: int = ck.ERR_ABORTED) -> None:
        with cp.cuda.Device(self.device_id):
            self.k.abort(self.peers, self.layout.num_ranks, code, stream=self.side_stream)

    def live_mask(self, rank: int, masked: bool) -> None:
        """Mask (or unmask) live rank `rank` in every rank's control block (shrink groups); on
        the side stream, done when this returns."""
        with cp.cuda.Device(self.device_id):
            self.k.live_mask(self.peers, self.layout.num_ranks, rank, masked,
                             stream=self.side_stream)
            self.side_stream.synchronize()

    def unmask_rank(self, rank: int) -> None:
        """This rank's waits include rank `rank` again (a replacement rejoined); done when this
        returns."""
        with cp.cuda.Device(self.device_id):
            self.k.unmask_rank(self.base, rank, stream=self.side_stream)
            self.side_stream.synchronize()

    def mask_rank(self, gone: int) -> None:
        """Every rank's waits skip rank `gone` from now on (shrink groups); on the side stream,
        not awaited (the engine's host control words already say so to its own ranks)."""
        with cp.cuda.Device(self.device_id):
            self.k.mask_rank(self.peers, self.layout.num_ranks, gone, stream=self.side_stream)

    # -- results (host reads; call after the stream) ---------------------------------------
    def recv_info(self, res: DispatchResult) -> tuple[int, list[int]]:
        info = cp.asnumpy(res.handle.recv_info)
        return int(info[0]), [int(v) for v in info[4:]]

    def outputs(self, res: DispatchResult) -> dict[str, Any]:
        n, per_expert = self.recv_info(res)
        rows = res.num_worst_tokens if res.num_worst_tokens > 0 else n
        return {"num_recv": n, "per_expert": per_expert, "rank_prefix": res.handle.rank_prefix,
                **self.output_views(res, rows)}

    def output_views(self, res: DispatchResult, rows: int) -> dict[str, Any]:
        """The dispatch outputs' first `rows` rows, without reading anything from the device
        (stream-ordered calls: the counts are not known on the host yet)."""
        v = self.views
        out = {"recv_x": v["recv_x"][:rows], "recv_src_idx": v["recv_src_idx"][:rows],
               "recv_src_rank": v["recv_src_rank"][:rows]}
        if res.with_meta:
            out["recv_topk_idx"] = v["recv_topk_idx"][:rows]
            out["recv_topk_weights"] = v["recv_topk_weights"][:rows]
        if "recv_x_scales" in v:
            out["recv_x_scales"] = v["recv_x_scales"][:rows]
        return out

    def error(self) -> tuple[int, int, str, int] | None:
        with cp.cuda.Device(self.device_id):
            return ck.read_error(self.views["ctrl"])
