"""Low-latency (decode) mode of the DeepEP facade: the `Buffer` methods of DeepEP V1's
low-latency API and the mask-buffer calls, as a mixin of `client/buffer.Buffer`.

On the cpu backend a call is synchronous (its data has arrived when it returns; hooks do
nothing). On the cuda backend every call goes through an armed op (client/stream_ops.py) kept
by the Buffer's cache (client/stream_op_cache.py): "plain" calls copy their outputs for the
caller on the stream, calls with `return_recv_hook=True` and calls captured into a CUDA graph
return the engine's views; a graph's op is pinned (it bakes in the op's counter slot), a
hook's is held until the hook ran and then kept as plain ones are. README
"Low-latency (decode) mode" and docs/DESIGN_NOTES.md "Plain low-latency calls" have the rest.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..proto import abi, dtypes
from ..proto.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from . import cuda_ipc, received_rows
from . import deep_ep_compat as C
from . import tensors as T
from .deep_ep_compat import EventOverlap
from .group import LowLatencyHandle
from .handles import LowLatencyBufferHandle
from .stream_op_cache import DEFAULT_LIMIT, Entry, StreamOpCache
from .stream_ops import StreamOp, on_stream, stream_place
from .tensors import Array

if TYPE_CHECKING:
    from .group import Group
    from .session import Session

PLAIN_OPS_ENV = "EPD_LL_PLAIN_OPS"  # armed plain low-latency calls kept per Buffer


def plain_op_limit() -> int:
    """The plain-op bound of a new Buffer's cache (EPD_LL_PLAIN_OPS, default 16)."""
    v = os.environ.get(PLAIN_OPS_ENV, "")
    try:
        n = int(v) if v else DEFAULT_LIMIT
    except ValueError:
        raise InvalidArgument(f"{PLAIN_OPS_ENV}={v!r} is not a number") from None
    if not 1 <= n <= 128:
        raise InvalidArgument(f"{PLAIN_OPS_ENV}={n}: between 1 and 128 (a group holds at most "
                              f"{abi.LL_CHAIN_OPS} armed calls, captured ones included)")
    return n


def _branch_feature(call: str, switch: str) -> C.Unsupported:
    """The error of a feature of DeepEP's branches that SGLang and vLLM switch on by keyword
    when they find such a build (hybrid-ep's NVFP4 dispatch, `use_nvfp4`; the
    single-batch-overlap combine of hybrid-ep and antgroup-opt, `overlap`), raised before
    anything changes (EPD's kernels have neither). Switched off, the call goes on and the
    feature's other keywords are ignored, as those builds ignore them then (SGLang passes its
    `packed_recv_count` with overlap off)."""
    what = ("NVFP4 dispatch" if call == "low_latency_dispatch" else
            "the overlapped combine of single-batch overlap")
    return C.Unsupported(f"{call}: {switch}=True asks for {what}, a feature of DeepEP's "
                         f"hybrid-ep / antgroup-opt branches that EPD does not have; call "
                         f"without it")


def _no_op_hook() -> None:
    """The receive hook: the call it came from has already received its data."""
    return None


class LowLatencyMixin:
    """Mixed into Buffer: needs its session, groups (`_group`), streams (`_run`), `timeout`,
    `enable_shrink`, `group_size` and the state `Buffer.__init__` makes (`_stream_ops`,
    `_buffer_keys`, `_combine_buffers`)."""

    session: Session
    timeout: float | None
    enable_shrink: bool
    group_size: int
    _stream_ops: StreamOpCache
    _buffer_keys: cuda_ipc.BufferKeys
    _combine_buffers: dict
    _groups: dict
    _ll_buffer: int  # the receive buffer of the next low-latency dispatch (0 or 1)
    _pending_masks: set[int]  # ranks masked by this Buffer's calls (applied to groups as they form)

    if TYPE_CHECKING:  # Buffer's, declared for the type checker
        def _group(self, hidden: int, num_topk: int, dtype: Any, num_experts: int,
                   low_latency_tokens: int = 0) -> Group: ...

        def _run(self, template: Array, call, previous_event: EventOverlap | None,
                 async_finish: bool, allocate_on_comm_stream: bool = False,
                 inputs: tuple = ()) -> tuple[Any, EventOverlap]: ...

        def _owner_of(self, handle: Any, cls: type, made_by: str) -> tuple[Any, Any]: ...

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Nothing to clean: the daemon's low-latency buffers need no zeroing between modes."""
        return None

    def low_latency_dispatch(self, x: Array, topk_idx: Array, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Array = None,
                             dispatch_wait_recv_cost_stats: Array = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False, *,
                             x_global_scale: Array = None, use_nvfp4: bool = False,
                             use_ue8m0_for_sf: bool = False):
        """(recv_x, recv_count, handle, event, hook). recv_x is
        `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` (bf16), or
        with use_fp8 a tuple (e4m3 x, float32 scales `[..., hidden // 128]`); recv_count is
        int32 `[num_local_experts]`. With return_recv_hook, hook is the receive half: on the
        cuda backend calling it makes the stream that was current at this call wait for the
        data (DeepEP's: whichever stream is current when the hook is called; stream-ordered
        path); on the cpu backend the data has arrived already and it does nothing. Else None.
        `x_global_scale`, `use_nvfp4`, `use_ue8m0_for_sf`: DeepEP hybrid-ep's NVFP4 keywords:
        with use_nvfp4 off the others are ignored (`_branch_feature`)."""
        if use_nvfp4:
            raise _branch_feature("low_latency_dispatch", "use_nvfp4")
        x_shape, x_dtype = T.meta(x, "x")
        idx_shape, _ = T.meta(topk_idx, "topk_idx")
        if len(x_shape) != 2 or len(idx_shape) != 2:
            raise InvalidArgument(f"x and topk_idx must be 2-D, got shapes {list(x_shape)} and "
                                  f"{list(idx_shape)}")
        num_max = int(num_max_dispatch_tokens_per_rank)
        # Checked before anything changes (a group joined, the receive buffer flipped, the
        # stats added to): DeepEP's own limits on the arguments.
        if not 0 < num_max <= 2**31 - 1:
            raise InvalidArgument(f"num_max_dispatch_tokens_per_rank must lie in "
                                  f"[1, {2**31 - 1}], got {num_max}")
        if use_fp8 and x_shape[1] % 128:
            raise InvalidArgument(f"use_fp8 quantises blocks of 128: hidden must be a multiple "
                                  f"of 128, got {x_shape[1]}")
        if use_fp8 and use_ue8m0 and x_shape[1] % 512:
            raise InvalidArgument(f"use_ue8m0 packs 4 scales per int32: hidden must be a "
                                  f"multiple of 512, got {x_shape[1]}")
        mode = self._stream_mode(x, return_recv_hook)
        with cuda_ipc.relaxed_capture(mode == "graph"):  # the first call may be in a capture
            g = self._group(x_shape[1], idx_shape[1], x_dtype, int(num_experts),
                            low_latency_tokens=num_max)

        # DeepEP's double buffer: each dispatch takes the other receive buffer than the last
        # (every rank makes the same calls, so they agree), and its combine brings that one back:
        # two micro-batches can be in flight (D0 D1 C0 C1).
        buffer = self._next_ll_buffer()

        def handle_of(h: LowLatencyHandle | StreamOp, src_rank: Array,
                      src_idx: Array) -> LowLatencyBufferHandle:
            return LowLatencyBufferHandle(h, x, src_rank=src_rank, src_idx=src_idx,
                                          num_max_dispatch_tokens_per_rank=num_max,
                                          hidden=int(x_shape[1]), num_experts=int(num_experts),
                                          buffer=buffer, owner=self)

        if mode is not None:
            key = ("dispatch", g.group_id, num_max, use_fp8, round_scale, use_ue8m0,
                   *self._keys(x, topk_idx, cumulative_local_expert_recv_stats))
            e = self._armed(key, mode, lambda: g.arm_low_latency_dispatch(
                x, topk_idx, num_max, use_fp8=use_fp8, round_scale=round_scale,
                use_ue8m0=use_ue8m0,
                cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                timeout=self.timeout))
            if e is not None and buffer >= len(e.op.results):
                buffer = 0  # an engine of one receive buffer
            if e is not None:
                op, res = e.op, e.op.results[buffer]
                if mode == "plain":  # DeepEP's lifetime: the outputs are the caller's own,
                    # allocated on the stream the call runs on (the comm stream with async_finish)
                    got = self._plain(e, x, async_finish, lambda stream: self._copy_received(
                        op, buffer, use_fp8, use_ue8m0, stream), (x, topk_idx), buffer)
                    (rx, rs, count, src_rank, src_idx), event = got
                    h = handle_of(op, src_rank, src_idx)
                    return (rx, rs) if use_fp8 else rx, count, h, event, None
                with self._held_until_hook(e, mode):
                    scales = (C.LowLatencyScales(res.recv_x_scales, use_ue8m0,
                                                 out=self._scales_out(op, buffer, use_ue8m0))
                              if use_fp8 else None)
                    hook, event = self._trigger(
                        op, x, return_recv_hook, async_finish,
                        scales.fill if scales is not None else None, buffer,
                        (x, topk_idx, cumulative_local_expert_recv_stats),
                        entry=e if mode == "hook" else None)
                recv = (res.recv_x, scales.out) if scales is not None else res.recv_x
                return (recv, res.recv_count, handle_of(op, res.recv_src_rank, res.recv_src_idx),
                        event, hook)

        def call():
            res = g.low_latency_dispatch(
                x, topk_idx, num_max, num_experts=int(num_experts),
                use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                timeout=self.timeout, buffer=buffer)
            # DeepEP's scale layout, made on the call's stream (inside run_on_streams)
            scales = C.LowLatencyScales(res.recv_x_scales, use_ue8m0).fill() if use_fp8 \
                else None
            return res, scales

        (out, scales), event = self._run(x, call, None, async_finish and not return_recv_hook,
                                         inputs=(x, topk_idx))
        recv = (out.recv_x, scales) if use_fp8 else out.recv_x
        hook = _no_op_hook if return_recv_hook else None
        return (recv, out.recv_count, handle_of(out.handle, out.recv_src_rank, out.recv_src_idx),
                event, hook)

    def low_latency_combine(self, x: Array, topk_idx: Array, topk_weights: Array,
                            handle: LowLatencyBufferHandle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Array = None,
                            combine_wait_recv_cost_stats: Array = None, *,
                            overlap: bool = False, src_signals: Array = None,
                            src_signal_expect_value: int = 0, packed_recv_count: Array = None,
                            comp_signal: Array = None, block_m: int = 64, threshold: int = 0,
                            num_sms: int = 3):
        """(combined_x, event, hook): combined_x `[num_tokens, hidden]` bf16, the weighted sum
        of each token's expert outputs; written into `out` (and returned) when given. A handle
        of another Buffer of the same group is combined by that Buffer (its armed calls and its
        daemon group). `overlap` and its signals (`src_signals`, `src_signal_expect_value`;
        `packed_recv_count`, `comp_signal`, `block_m`, `threshold`, `num_sms`): the
        single-batch-overlap keywords of DeepEP's hybrid-ep / antgroup-opt branches: with
        overlap off the others are ignored (`_branch_feature`)."""
        if overlap:
            raise _branch_feature("low_latency_combine", "overlap")
        owner, handle = self._owner_of(handle, LowLatencyBufferHandle, "low_latency_dispatch")
        if owner is not self:
            return owner.low_latency_combine(
                x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                return_recv_hook, out, combine_wait_recv_cost_stats)
        g = handle.handle.group
        if isinstance(handle.handle, StreamOp):  # a stream-ordered dispatch: so is its combine
            src = self._stream_ops.entry_of(handle.handle)
            if src is None or not handle.handle.armed:
                raise FailedPrecondition(
                    "this low-latency handle's dispatch is no longer armed: more than "
                    f"{self._stream_ops.limit} distinct plain low-latency calls were made "
                    f"since (raise {PLAIN_OPS_ENV}), or its group was left")
            mode = self._stream_mode(x, return_recv_hook) or "plain"
            key = ("combine", handle.handle.op_id,
                   *self._keys(x, topk_idx, topk_weights, out))
            e = self._armed(key, mode, lambda: g.arm_low_latency_combine(
                x, topk_idx, topk_weights, handle.handle, out=out, timeout=self.timeout),
                source=src)
            if e is None:
                raise ResourceExhausted(
                    "no room is left for the combine of a plain low-latency dispatch (a group "
                    f"holds at most {abi.LL_CHAIN_OPS} armed calls; --max-stream-ops-per-session "
                    "bounds a session's)")
            op, buffer = e.op, handle.buffer
            if mode == "plain":
                result, event = self._plain(e, x, async_finish, lambda _stream: (
                    op.result if out is not None else T.clone(op.result)),
                    (x, topk_idx, topk_weights), buffer)
                return result, event, None
            with self._held_until_hook(e, mode):
                hook, event = self._trigger(op, x, return_recv_hook, async_finish,
                                            buffer=buffer, inputs=(x, topk_idx, topk_weights),
                                            entry=e if mode == "hook" else None)
            return op.result, event, hook
        cx, event = self._run(
            x, lambda: g.low_latency_combine(x, topk_idx, topk_weights, handle.handle, out=out,
                                             timeout=self.timeout),
            None, async_finish and not return_recv_hook, inputs=(x, topk_idx, topk_weights))
        return cx, event, _no_op_hook if return_recv_hook else None

    # -- shrink mode (rank masking) ---------------------------------------------------------
    # EPD's mask is each low-latency group's, shared by its ranks (DeepEP's is each rank's own
    # buffer): masking a rank on one rank masks it for all, and a rank that goes away is masked
    # by the daemon itself. Groups form lazily, so changes made before a group exists are kept
    # and applied when it forms.
    def _check_shrink(self) -> None:
        if not self.enable_shrink:
            raise InvalidArgument("the mask buffer needs Buffer(..., enable_shrink=True) "
                                  "(as in DeepEP)")

    def _ll_groups(self) -> list[Group]:
        return [g for key, g in self._groups.items() if key.low_latency_tokens]

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (`mask=True`) or unmask a rank in this Buffer's low-latency groups: a masked
        rank takes no part in them and the tokens routed to its experts are dropped; its own
        calls return nothing for it. A rank that went away cannot be unmasked
        (FAILED_PRECONDITION). A masked live rank keeps calling; each low-latency dispatch
        leaves out the same ranks on every rank (a mask changed during a call counts from
        that call or the next, for all ranks alike)."""
        self._check_shrink()
        if not 0 <= rank_to_mask < self.group_size:
            raise InvalidArgument(f"rank_to_mask {rank_to_mask} outside [0, {self.group_size})")
        for g in self._ll_groups():
            g.rank_mask(**{"mask" if mask else "unmask": rank_to_mask})
        # (kept for groups formed later; once one exists, its shared mask is what counts)
        if mask:
            self._pending_masks.add(rank_to_mask)
        else:
            self._pending_masks.discard(rank_to_mask)

    def low_latency_query_mask_buffer(self, mask_status: Array) -> None:
        """Write 1 for every masked rank (by a call, or because it went away), else 0, into
        `mask_status` (int32 `[num_ranks]`)."""
        self._check_shrink()
        shape, _ = T.meta(mask_status, "mask_status")
        if tuple(shape) != (self.group_size,):
            raise InvalidArgument(f"mask_status must be [{self.group_size}], got {list(shape)}")
        groups = self._ll_groups()
        masked = [r in self._pending_masks for r in range(self.group_size)]
        if groups:  # the group's mask, which its ranks share (another rank may have changed it)
            masked = [False] * self.group_size
            for g in groups:
                masked = [a or b != 0 for a, b in zip(masked, g.rank_mask(), strict=True)]
        values = [int(m) for m in masked]
        if T.is_torch(mask_status):
            import torch
            mask_status.copy_(torch.tensor(values, dtype=mask_status.dtype))
        else:
            mask_status[...] = values

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank that has not gone away."""
        self._check_shrink()
        self._pending_masks.clear()
        for g in self._ll_groups():
            g.rank_mask(clean=True)

    def low_latency_rejoin(self, rank: int | None = None, timeout: float | None = None) -> None:
        """EPD's addition to the mask calls: bring back a rank that went away. A replacement
        process makes a Buffer of the same group name and rank (on the CUDA engine: on the
        GPU of the rank it replaces); its first low-latency call joins its groups and is
        refused (FAILED_PRECONDITION: it rejoins); then every rank that takes part calls
        `low_latency_rejoin(rank)` and the replacement `low_latency_rejoin()`, a collective of
        each low-latency group (`Group.rejoin`), made with no low-latency dispatch awaiting its
        combine; from the next call on the replacement takes part. Every rank's double buffer
        starts again at buffer 0, as the replacement's does."""
        self._check_shrink()
        groups = self._ll_groups()
        if not groups:
            raise FailedPrecondition("this Buffer has no low-latency group yet: a replacement's "
                                     "first low-latency call joins them (and is refused until "
                                     "the rejoin)")
        for g in groups:
            g.rejoin(rank, timeout)
        self._ll_buffer = 0

    def _apply_pending_masks(self, g: Group) -> None:
        """A low-latency group just formed: the ranks masked by a call in this Buffer's other
        low-latency groups (their mask is shared by the ranks: another rank may have unmasked
        one since), or, where it has none yet, the mask changes made before any existed."""
        others = [o for o in self._ll_groups() if o is not g]
        if others:
            ranks = [r for r, state in enumerate(others[0].rank_mask()) if state == 1]
        else:
            ranks = sorted(self._pending_masks)
        for rank in ranks:
            g.rank_mask(mask=rank)

    # -- stream-ordered low-latency calls (cuda backend) -------------------------------------
    def _stream_mode(self, x: Array, return_recv_hook: bool) -> str | None:
        """How a low-latency call runs where the session's memory has stream-ordered ops
        (cuda): "graph" while the current stream captures a CUDA graph, "hook" with a receive
        hook, else "plain" (outputs copied for the caller, op kept LRU). None: synchronous
        (the cpu backend)."""
        mem = self.session.memory
        if not mem.supports_stream_ops:
            return None
        if mem.is_capturing(x):
            return "graph"
        return "hook" if return_recv_hook else "plain"

    def _keys(self, *arrays: Array) -> tuple:
        return tuple(self._buffer_keys(a) for a in arrays)

    def _armed(self, key: tuple, mode: str, arm, source: Entry | None = None) -> Entry | None:
        """The armed op for `key`, armed now if new. Before a plain call, raises a failure an
        earlier plain call reported on the GPU. None: a plain call found no free slot."""
        cache = self._stream_ops
        if mode == "plain":
            cache.check()
        # (a graph's op is pinned for good; a hook's held until the hook ran: _trigger)
        pin, hold = mode == "graph", mode == "hook"
        e = cache.get(key, pin=pin, hold=hold)
        if e is None:
            with cuda_ipc.relaxed_capture(mode == "graph"):
                e = cache.arm(key, arm, pin=pin, capturing=mode == "graph", source=source,
                              hold=hold)
            if mode == "plain":  # its copy-out kernel compiled now, off the calls that follow
                received_rows.load(self.session.device_ordinal)
        return e

    def _next_ll_buffer(self) -> int:
        """The receive buffer of the next low-latency dispatch: they alternate, per Buffer."""
        buffer = self._ll_buffer
        self._ll_buffer ^= 1
        return buffer

    def _plain(self, e: Entry, x: Array, async_finish: bool, outputs, inputs: tuple,
               buffer: int):
        """Trigger a plain call's op (receive buffer `buffer`) on the current stream (or the
        comm stream with async_finish), then `outputs(stream)` copies its results for the
        caller on that stream; (copies, event)."""
        op = e.op

        def run():
            stream = op.signal(buffer=buffer)
            op.wait(stream)
            got = outputs(stream)
            self._stream_ops.triggered(e, stream)
            return got

        return self._run(x, run, None, async_finish, inputs=inputs)

    def _copy_received(self, op: StreamOp, buffer: int, use_fp8: bool, use_ue8m0: bool,
                       stream: int) -> tuple:
        """A plain dispatch's outputs, the caller's own: the received rows of recv_x (and their
        scales in DeepEP's layout), the counts and the source info, copied by one kernel that
        reads the counts on the GPU (client/received_rows.py), through the op's plan for that
        receive buffer and format (made at its first call)."""
        key = (buffer, use_fp8, use_ue8m0)
        copy = op.plans.get(key)
        if copy is None:
            res = op.results[buffer]
            copy = op.plans[key] = received_rows.CopyPlan(
                res.recv_x, res.recv_x_scales if use_fp8 else None, res.recv_count,
                res.recv_src_rank, res.recv_src_idx, use_ue8m0, self.session.device_ordinal)
        return copy(self._scales_out(op, buffer, use_ue8m0) if use_fp8 else None, stream)

    @staticmethod
    def _scales_out(op: StreamOp, buffer: int, use_ue8m0: bool) -> Any:
        """A new array for a call's FP8 scales in DeepEP's layout (the caller keeps it),
        through the op's allocator for that receive buffer and format (made at its first call:
        deep_ep_compat.LowLatencyScales.allocator)."""
        key = ("scales", buffer, use_ue8m0)
        alloc = op.plans.get(key)
        if alloc is None:
            alloc = op.plans[key] = C.LowLatencyScales.allocator(
                op.results[buffer].recv_x_scales, use_ue8m0)
        return alloc()

    def check(self) -> None:
        """Raise a failure the GPU reported for an earlier plain low-latency call, waiting for
        the calls in flight, or for a call with a hook or replayed from a graph once the
        caller's stream is synchronised, and through each group's `check()` a stream-ordered
        normal-mode call's, a layout's bad expert id among them (raised only here) (an EPD
        addition: DeepEP has no asynchronous errors to collect). A low-latency dispatch that
        a rank's bad expert ids failed on every rank (nothing moved, the group went on) raises
        here only, after the caller's stream is synchronised and its hooks called: every rank
        then raises at the same call."""
        self._stream_ops.take_verdicts()
        self._stream_ops.check(wait=True)
        self._stream_ops.check_all()
        for g in [*self._groups.values(), *self._retired]:  # (a retired group's replays too)
            g.check()

    def _trigger(self, op: StreamOp, x: Array, return_recv_hook: bool, async_finish: bool,
                 after: Any = None, buffer: int = 0, inputs: tuple = (),
                 entry: Entry | None = None):
        """(hook, event). With a hook (DeepEP: the current stream, no async event) the send
        half is enqueued now and the hook enqueues the receive half on the same stream, the
        one current at the call (as DeepEP fixes its launch stream then), whatever stream is
        current when the hook is called. Else both halves, on the comm stream with an event
        after them when `async_finish` (run_on_streams). `after` (no arguments) is enqueued
        behind the receive half, on its stream: work on the received data.

        `inputs` are the arrays the engine reads. Its kernels run after the trigger, in another
        process, while the caller's stream goes on: an input the caller drops at once would go
        back to its allocator and could be rewritten by the caller's next work before the
        engine read it (seen on 2x H200: a freed topk_idx reused for the next micro-batch's x).
        So the hook holds them until it has made the stream wait for the op's end (work after
        that is ordered after the engine's read); on the comm stream they are recorded there.
        `entry`: the cache entry the call holds until its hook ran (then evictable)."""
        # The stream of the call, for the hook's work on the outputs (not x: see inputs); a
        # call without a hook runs that work at once, on the stream current then.
        place = stream_place(x) if after is not None and return_recv_hook else None

        def receive(sent: int) -> None:
            try:
                op.wait(sent)  # the receive half, on the stream the call was made on
                if after is not None:
                    with on_stream(sent, place):
                        after()
            finally:
                if entry is not None:  # (held no more, whatever happened)
                    self._stream_ops.release(entry, sent)

        if return_recv_hook:
            stream = op.signal(buffer=buffer)
            held = [inputs]

            def hook() -> None:
                if not held:  # (once: a second call would release another call's hold)
                    return
                held.clear()
                receive(stream)

            return hook, EventOverlap()

        def both() -> None:
            receive(op.signal(buffer=buffer))

        _, event = self._run(x, both, None, async_finish, inputs=inputs)
        return None, event

    @contextlib.contextmanager
    def _held_until_hook(self, e: Entry, mode: str) -> Iterator[None]:
        """A hook call's hold on its op (taken by _armed) goes back if the call fails before
        it returned its hook (the hook releases it otherwise)."""
        try:
            yield
        except BaseException:
            if mode == "hook":
                self._stream_ops.release(e, None)
            raise

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyBufferHandle) -> Array:
        """A `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` buffer
        to write expert outputs into; it lives in a region the daemon already maps, so passing
        it to `low_latency_combine` costs no staging copy. One buffer per shape and receive
        buffer, reused (by the Buffer that made the handle, which combines it): two
        micro-batches in flight (D0 D1 C0 C1) get two, as DeepEP's double buffer gives (a
        review: one per shape let both write the same memory)."""
        owner, handle = self._owner_of(handle, LowLatencyBufferHandle, "low_latency_dispatch")
        if owner is not self:
            return owner.get_next_low_latency_combine_buffer(handle)
        h = handle.handle
        spec = h.group.spec
        shape = (spec.num_experts // spec.num_ranks,
                 spec.num_ranks * handle.num_max_dispatch_tokens_per_rank, spec.hidden)
        key = (h.group.group_id, shape, T.is_torch(handle.template), handle.buffer)
        buf = self._combine_buffers.get(key)
        if buf is None:
            buf = self._combine_buffers[key] = self.session.empty(
                shape, dtypes.to_numpy(spec.x_dtype), like=handle.template)
        return buf
