"""Issue 11: the DeepEP call sequences of vLLM, SGLang and Megatron-LM, replayed on EPD's facade
(`epd.client.buffer.Buffer`, what `import deep_ep` resolves to with the opt-in shim) against a
CPU daemon, every output compared bit for bit with server/reference.py.

Each replay was written from the framework's source at the commit cited in its docstring: the
Buffer methods, the order of the calls, which arguments go positionally and which by keyword,
the optional arguments passed (previous_event, async_finish, allocate_on_comm_stream, config,
expert_alignment, use_fp8, round_scale, use_ue8m0, return_recv_hook, out, zero_copy), the
handles kept and the events waited on. Framework-only work (quantisation kernels, expert GEMMs,
stream switches) is replaced by small exact host computations; the Buffer calls are not.

Ranks are threads with a stand-in for the torch.distributed ProcessGroup (`rank()`/`size()`,
all the facade reads from it); each builds its Buffer exactly as the framework does (no EPD
keyword arguments), finding the daemon through EPD_SOCKET_DIR as a user would (README, "Use EPD
from vLLM / SGLang / Megatron"). Tensors are CPU torch tensors here; tests/gpu/
test_framework_replays_gpu.py runs the same replays with CUDA tensors against the CUDA engine
(`DEVICES`: rank r's tensors on cuda:r % GPUs, as a framework's rank process sets its device).

Where the facade lacks what a framework relies on, the case is xfail(strict=True) naming the
missing piece, so that it turns into a failure (to be un-marked) the day EPD does it.
"""

from __future__ import annotations

import gc
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from ranklib import ProcessGroup

torch = pytest.importorskip("torch")

from epd.client import buffer as deep_ep  # noqa: E402  (what `import deep_ep` resolves to)
from epd.client.deep_ep_compat import EventHandle, EventOverlap  # noqa: E402  (deep_ep.utils)
from epd.client.tensors import to_numpy  # noqa: E402
from epd.proto import dtypes  # noqa: E402
from epd.server import reference as ref  # noqa: E402

pytestmark = pytest.mark.slow
BF16 = dtypes.BFLOAT16
NUM_RANKS = 2
_seeds = itertools.count(5000)

VLLM = "vllm-project/vllm@055e47c28003156421365af985d676fc921cb075"
SGLANG_DISPATCHER = "sgl-project/sglang@003a81bf2870c07b110de13641ad4f0ba63b1fa1"
SGLANG_TBO = "sgl-project/sglang@0e02cef94b0e4804e6b1bd8b806c04efc46a012e"
MEGATRON = "NVIDIA/Megatron-LM@d98e8a64ddf34856e74b24714e3bedb2f5a39553"


# ------------------------------------------------------------------------------------------------
# harness
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def env(daemon, monkeypatch):
    """The user's environment: EPD_SOCKET_DIR names the daemon, engine 0 (no CUDA here)."""
    monkeypatch.setenv("EPD_SOCKET_DIR", daemon.socket_dir)
    for k in ("EPD_ENGINE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    return daemon


# Where the ranks' tensors live: ["cpu"] here; the GPU module sets CUDA devices (rank r uses
# DEVICES[r % len(DEVICES)]). Each rank thread makes its device current, as a rank process does.
DEVICES: list[str] = ["cpu"]
_rank_device = threading.local()


def device() -> str:
    """The calling rank thread's device (the main thread: the first one)."""
    return getattr(_rank_device, "name", DEVICES[0])


def run_ranks(fn, num_ranks: int = NUM_RANKS) -> list:
    """fn(rank, group) on every rank at once (threads); the results by rank."""
    def on_device(r: int):
        _rank_device.name = DEVICES[r % len(DEVICES)]
        if _rank_device.name != "cpu":
            torch.cuda.set_device(_rank_device.name)
        return fn(r, ProcessGroup(r, num_ranks))

    with ThreadPoolExecutor(num_ranks) as ex:
        futs = [ex.submit(on_device, r) for r in range(num_ranks)]
        errors = [(r, f.exception(timeout=300)) for r, f in enumerate(futs)]
    failed = [(r, e) for r, e in errors if e is not None]
    if failed:  # every rank's error (the first one raised may only be a consequence)
        raise AssertionError("; ".join(f"rank {r}: {type(e).__name__}: {e}"
                                       for r, e in failed)) from failed[0][1]
    return [f.result() for f in futs]


def tt(a: np.ndarray):
    """A NumPy array (bf16 / e4m3 included) as the torch tensor a framework would pass, on the
    rank's device."""
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    elif a.dtype == dtypes.FLOAT8_E4M3:
        t = torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    else:
        t = torch.from_numpy(a.copy())
    return t if device() == "cpu" else t.to(device())


def nd(t) -> np.ndarray:
    if isinstance(t, torch.Tensor) and t.device.type != "cpu":
        torch.cuda.synchronize(t.device)  # (the stream-ordered calls wrote it on the GPU)
        t = t.cpu()
    return np.array(to_numpy(t, "output"))


def exact(got, want, what: str) -> None:
    got = nd(got) if isinstance(got, torch.Tensor) else np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, \
        (what, got.shape, want.shape, got.dtype, want.dtype)
    np.testing.assert_array_equal(np.ascontiguousarray(got).view(np.uint8),
                                  np.ascontiguousarray(want).view(np.uint8), err_msg=what)


def exact_rows(got, want, counts, what: str) -> None:
    """Low-latency outputs `[L, N, ...]`: rows [0, counts[e]) of each expert exact. Rows beyond
    the count are unspecified, as in DeepEP (the CPU backend zeroes them, CUDA does not)."""
    got = nd(got) if isinstance(got, torch.Tensor) else np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, \
        (what, got.shape, want.shape, got.dtype, want.dtype)
    for e, c in enumerate(np.asarray(counts).tolist()):
        exact(got[e, :c], want[e, :c], f"{what}, expert {e}")


def workload(tokens, hidden: int, experts: int, topk: int, *, drop: float = 0.1,
             seed: int | None = None):
    """Per rank: x bf16 [T, H], topk_idx int64, topk_weights float32 (-1 / 0 for dropped)."""
    rng = np.random.default_rng(next(_seeds) if seed is None else seed)
    xs = [ref.random_x(rng, t, hidden, BF16) for t in tokens]
    rt = [ref.random_routing(rng, t, experts, topk, drop_prob=drop, num_ranks=len(tokens))
          for t in tokens]
    return xs, [r[0] for r in rt], [r[1] for r in rt]


def ll_workload(tokens, hidden: int, experts: int, topk: int, seed: int | None = None):
    """Low-latency inputs: distinct experts per token (as a router gives), no drops."""
    return workload(tokens, hidden, experts, topk, drop=0.0, seed=seed)


def times(a: np.ndarray, c: float) -> np.ndarray:
    """An exact stand-in for an expert: bf16(x * c) with c a power of two."""
    return (np.asarray(a).astype(np.float32) * np.float32(c)).astype(BF16)


def dequant(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Per-128-channel FP8 dequantisation to bf16 (vLLM's dequant_fp8, in NumPy)."""
    lead = q.shape[:-1]
    f = q.astype(np.float32).reshape(*lead, -1, 128) * scales[..., None]
    return f.reshape(*lead, q.shape[-1]).astype(BF16)


# ------------------------------------------------------------------------------------------------
# vLLM, high-throughput prepare/finalize
# ------------------------------------------------------------------------------------------------

class VllmHT:
    """vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ht.py
    (DeepEPHTPrepareAndFinalize) at 055e47c: `_do_dispatch`, `_receiver`, `_finalize`; DBO
    helpers from vllm/v1/worker/ubatching.py (dbo_get_previous_event calls `buffer.capture`
    only with DBO)."""

    available_rank_configs = [2, 4, 8, 16, 24, 32, 64, 128, 144, 160]

    def __init__(self, buffer, num_dispatchers: int, rank_expert_offset: int) -> None:
        self.buffer = buffer
        self.num_dispatchers_ = num_dispatchers
        self.rank_expert_offset = rank_expert_offset
        self.async_prepare = True
        self.handles = [None, None]

    def _get_dispatch_config(self):
        if self.num_dispatchers_ not in self.available_rank_configs:
            return None
        return deep_ep.Buffer.get_dispatch_config(self.num_dispatchers_)

    def _get_combine_config(self):
        if self.num_dispatchers_ not in self.available_rank_configs:
            return None
        return deep_ep.Buffer.get_combine_config(self.num_dispatchers_)

    def prepare_async(self, tokens, token_scales, rank_topk_ids, rank_topk_weights,
                      num_experts: int, *, dbo: bool = False, ubatch: int = 0):
        has_scales = token_scales is not None
        previous_event = self.buffer.capture() if dbo else None  # dbo_get_previous_event
        (num_tokens_per_rank, num_tokens_per_rdma_rank, dispatch_expert_num_tokens,
         is_token_in_rank, event) = self.buffer.get_dispatch_layout(
            topk_idx=rank_topk_ids, num_experts=num_experts, previous_event=previous_event,
            async_finish=False, allocate_on_comm_stream=False)
        token_data = (tokens, token_scales) if has_scales else tokens
        (token_data, expert_topk_ids, expert_topk_weights, expert_num_tokens_per_expert_list,
         handle, event) = self.buffer.dispatch(
            x=token_data, handle=None, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=dispatch_expert_num_tokens,
            topk_idx=rank_topk_ids, topk_weights=rank_topk_weights, expert_alignment=1,
            config=self._get_dispatch_config(), previous_event=previous_event,
            async_finish=self.async_prepare and not dbo, allocate_on_comm_stream=False)
        self.handles[ubatch] = handle

        def receiver():
            if event.event is not None:
                event.current_stream_wait()
            expert_x, expert_x_scale = token_data if has_scales else (token_data, None)
            ids = torch.where(expert_topk_ids == -1,
                              num_experts - 1 if self.rank_expert_offset == 0 else 0,
                              expert_topk_ids + self.rank_expert_offset)
            meta = torch.tensor(expert_num_tokens_per_expert_list, dtype=torch.int32)
            return expert_x, expert_x_scale, meta, ids, expert_topk_weights
        return receiver

    def finalize_async(self, output, fused_expert_output, *, dbo: bool = False,
                       ubatch: int = 0):
        handle = self.handles[ubatch]
        assert handle is not None
        previous_event = self.buffer.capture() if dbo else None
        assert fused_expert_output.dtype == torch.bfloat16
        combined_x, _, event = self.buffer.combine(
            x=fused_expert_output, handle=handle, topk_weights=None,
            config=self._get_combine_config(), previous_event=previous_event,
            async_finish=not dbo, allocate_on_comm_stream=False)

        def receiver():
            if event.event is not None:
                event.current_stream_wait()
            output.copy_(combined_x, non_blocking=True)
        return receiver


def _vllm_ht_buffer(group, hidden: int):
    """vllm/distributed/device_communicators/all2all.py DeepEPHTAll2AllManager
    `_make_all2all_kwargs` (intranode; read from the stored vLLM source, not pinned to 055e47c):
    `deep_ep.Buffer(**dict(group=, num_nvl_bytes=VLLM_DEEPEP_BUFFER_SIZE_MB MiB,
    num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True))`."""
    return deep_ep.Buffer(**dict(group=group, num_nvl_bytes=1024 * 1024 * 1024, num_rdma_bytes=0,
                                 low_latency_mode=False, num_qps_per_rank=1,
                                 explicitly_destroy=True))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-block"])
def test_vllm_high_throughput_prepare_finalize(env, fp8: bool) -> None:
    """vLLM DeepEPHTPrepareAndFinalize (deepep_ht.py @ 055e47c): three MoE layers on one Buffer
    (a second get_dispatch_layout on a Buffer included), prepare_async -> receiver ->
    experts -> finalize_async -> receiver. With block-quantised FP8 the dispatch payload is the
    (e4m3 [T, H], float32 [T, H/128]) tuple vLLM builds with moe_kernel_quantize_input."""
    hidden, experts, topk = 256, 8, 2
    layers = [workload([13, 9], hidden, experts, topk) for _ in range(3)]
    quant = [[ref.quantize_fp8(x) for x in xs] for xs, _, _ in layers]

    def rank(r, group):
        pf = VllmHT(_vllm_ht_buffer(group, hidden), group.size(),
                    rank_expert_offset=r * experts // group.size())
        try:
            out = []
            for li, (xs, idx, w) in enumerate(layers):
                tokens, scales = (tt(quant[li][r][0]), tt(quant[li][r][1])) if fp8 else \
                    (tt(xs[r]), None)
                rx, rs, meta, ids, rw = pf.prepare_async(
                    tokens, scales, tt(idx[r]), tt(w[r]), experts)()
                y = dequant(nd(rx), nd(rs)) if fp8 else nd(rx)
                y = times(y, 2.0)
                output = torch.empty((len(xs[r]), hidden), dtype=torch.bfloat16, device=device())
                pf.finalize_async(output, tt(y))()
                out.append((nd(rx), None if rs is None else nd(rs), meta.tolist(), nd(ids),
                            nd(rw), nd(output)))
            return out
        finally:
            pf.buffer.destroy()

    res = run_ranks(rank)
    for li, (xs, idx, w) in enumerate(layers):
        if fp8:
            disp = ref.dispatch([q[0] for q in quant[li]], idx, w, experts,
                                x_scales=[q[1] for q in quant[li]])
            ys = [times(dequant(d.recv_x, d.recv_x_scales), 2.0) for d in disp]
        else:
            disp = ref.dispatch(xs, idx, w, experts)
            ys = [times(d.recv_x, 2.0) for d in disp]
        comb = ref.combine(ys, disp, [len(x) for x in xs])
        for r in range(NUM_RANKS):
            rx, rs, meta, ids, rw, output = res[r][li]
            tag = f"layer {li} rank {r}"
            exact(rx, disp[r].recv_x, f"{tag} expert_x")
            if fp8:
                exact(rs, disp[r].recv_x_scales, f"{tag} expert_x_scale")
            assert meta == disp[r].num_recv_tokens_per_expert, tag
            off = r * experts // NUM_RANKS
            want_ids = np.where(disp[r].recv_topk_idx == -1,
                                experts - 1 if off == 0 else 0, disp[r].recv_topk_idx + off)
            exact(ids, want_ids, f"{tag} expert_topk_ids (global)")
            exact(rw, disp[r].recv_topk_weights, f"{tag} expert_topk_weights")
            exact(output, comb[r][0], f"{tag} finalize output")


def test_vllm_high_throughput_dbo_two_ubatches(env) -> None:
    """vLLM dual-batch overlap with DeepEP HT (deepep_ht.py + v1/worker/ubatching.py @ 055e47c):
    each ubatch thread captures `buffer.capture()` as previous_event, calls without
    async_finish, keeps its handle in `handles[ubatch]`; the yields order the Buffer calls
    layout/dispatch(u0), layout/dispatch(u1), combine(u0), combine(u1)."""
    hidden, experts, topk = 128, 8, 2
    ub = [workload([11, 7], hidden, experts, topk), workload([5, 12], hidden, experts, topk)]

    def rank(r, group):
        pf = VllmHT(_vllm_ht_buffer(group, hidden), group.size(),
                    rank_expert_offset=r * experts // group.size())
        try:
            recv = [pf.prepare_async(tt(xs[r]), None, tt(idx[r]), tt(w[r]), experts, dbo=True,
                                     ubatch=u)() for u, (xs, idx, w) in enumerate(ub)]
            outs = []
            for u, (xs, _, _) in enumerate(ub):
                output = torch.empty((len(xs[r]), hidden), dtype=torch.bfloat16, device=device())
                pf.finalize_async(output, tt(times(nd(recv[u][0]), 2.0 ** (u + 1))), dbo=True,
                                  ubatch=u)()
                outs.append(nd(output))
            return [nd(x[0]) for x in recv], outs
        finally:
            pf.buffer.destroy()

    res = run_ranks(rank)
    for u, (xs, idx, w) in enumerate(ub):
        disp = ref.dispatch(xs, idx, w, experts)
        comb = ref.combine([times(d.recv_x, 2.0 ** (u + 1)) for d in disp], disp,
                           [len(x) for x in xs])
        for r in range(NUM_RANKS):
            exact(res[r][0][u], disp[r].recv_x, f"ubatch {u} rank {r} expert_x")
            exact(res[r][1][u], comb[r][0], f"ubatch {u} rank {r} output")


def test_vllm_high_throughput_mxfp8_packed_int32_scales(env) -> None:
    """vLLM HT dispatch of (e4m3 [T, H], int32 [T, H/128]) (deepep_ht.py @ 055e47c with an
    MXFP8 quant config): packed UE8M0 scales (4 x 32-channel exponents per int32 word), which
    DeepEP V1 carries as opaque 4-byte columns, travel with their rows unchanged and come back
    int32."""
    hidden, experts, topk = 512, 8, 2
    xs, idx, w = workload([8, 6], hidden, experts, topk)
    q = [ref.quantize_fp8(x)[0] for x in xs]
    rng = np.random.default_rng(3)
    packed = [rng.integers(0, 2 ** 31 - 1, (len(x), hidden // 128), dtype=np.int32) for x in xs]

    def rank(r, group):
        pf = VllmHT(_vllm_ht_buffer(group, hidden), group.size(), r * experts // group.size())
        try:
            rx, rs, *_ = pf.prepare_async(tt(q[r]), tt(packed[r]), tt(idx[r]), tt(w[r]),
                                          experts)()
            return nd(rx), nd(rs)
        finally:
            pf.buffer.destroy()

    res = run_ranks(rank)
    disp = ref.dispatch(q, idx, w, experts)
    for r in range(NUM_RANKS):
        exact(res[r][0], disp[r].recv_x, f"rank {r} expert_x")
        want = np.stack([packed[s][t] for s, t in zip(disp[r].recv_src_rank,
                                                      disp[r].recv_src_idx, strict=True)])
        assert res[r][1].dtype == np.int32, res[r][1].dtype
        exact(res[r][1], want, f"rank {r} packed scales")



@pytest.mark.parametrize("payload", ["int8", "uint8", "float8_e5m2"])
def test_vllm_high_throughput_one_byte_payloads_other_than_e4m3(env, payload: str) -> None:
    """vLLM HT dispatch (deepep_ht.py @ 055e47c) quantises to its quant config's dtype before
    dispatch: int8 with an int8 block-quantised config. DeepEP carries any one-byte payload
    with float32 scales and returns the caller's type; so does the facade (the bytes travel as
    e4m3, bit for bit), the cached dispatch of the handle too."""
    hidden, experts, topk = 256, 8, 2
    xs, idx, w = workload([8, 6], hidden, experts, topk)
    rng = np.random.default_rng(4)
    raw = [rng.integers(0, 256, (len(x), hidden), dtype=np.uint8) for x in xs]  # every byte
    scales = [rng.random((len(x), hidden // 128), dtype=np.float32) for x in xs]
    dtype = getattr(torch, payload)

    def rank(r, group):
        pf = VllmHT(_vllm_ht_buffer(group, hidden), group.size(), r * experts // group.size())
        try:
            q = tt(raw[r]).view(dtype)
            rx, rs, *_ = pf.prepare_async(q, tt(scales[r]), tt(idx[r]), tt(w[r]), experts)()
            assert rx.dtype == dtype, rx.dtype
            (cx, cs), *_ = pf.buffer.dispatch((q, tt(scales[r])), handle=pf.handles[0])
            assert cx.dtype == dtype, cx.dtype
            return [nd(t.view(torch.uint8)) for t in (rx, rs.view(torch.uint8), cx,
                                                      cs.view(torch.uint8))]
        finally:
            pf.buffer.destroy()

    res = run_ranks(rank)
    fp8 = [b.view(dtypes.FLOAT8_E4M3) for b in raw]
    disp = ref.dispatch(fp8, idx, w, experts, x_scales=scales)
    for r in range(NUM_RANKS):
        rx, rs, cx, cs = res[r]
        want_x = disp[r].recv_x.view(np.uint8)
        want_s = disp[r].recv_x_scales.view(np.uint8)
        for got, want, what in ((rx, want_x, "expert_x"), (rs, want_s, "scales"),
                                (cx, want_x, "cached expert_x"), (cs, want_s, "cached scales")):
            exact(got, want, f"rank {r} {payload} {what}")


# ------------------------------------------------------------------------------------------------
# vLLM, low-latency prepare/finalize
# ------------------------------------------------------------------------------------------------

class VllmLL:
    """vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ll.py
    (DeepEPLLPrepareAndFinalize) at 055e47c: `prepare_async`, `_receiver`, `_finalize`."""

    def __init__(self, buffer, max_tokens_per_rank: int, use_fp8_dispatch: bool,
                 use_ue8m0_dispatch: bool = False) -> None:
        self.buffer = buffer
        self.max_tokens_per_rank = max_tokens_per_rank
        self.use_fp8_dispatch = use_fp8_dispatch
        self.use_ue8m0_dispatch = use_ue8m0_dispatch  # post_init_setup: packed-ue8m0 experts
        self.handles = [None, None]

    def prepare_async(self, a1, topk_ids, num_experts: int, *, ubatch: int = 0):
        expert_x, expert_num_tokens, handle, _, hook = self.buffer.low_latency_dispatch(
            a1, topk_ids, self.max_tokens_per_rank, num_experts,
            use_fp8=self.use_fp8_dispatch, round_scale=self.use_ue8m0_dispatch,
            use_ue8m0=self.use_ue8m0_dispatch, async_finish=False, return_recv_hook=True)
        self.handles[ubatch] = handle

        def receiver():  # _receiver -> _do_quant, block_k == 128: DeepEP quantised for us
            if self.use_fp8_dispatch:
                x, x_scales = expert_x
                return x, x_scales, expert_num_tokens
            return expert_x, None, expert_num_tokens
        return hook, receiver

    def prepare(self, a1, topk_ids, num_experts: int):
        hook, receiver = self.prepare_async(a1, topk_ids, num_experts)
        hook()
        return receiver()

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, *,
                 do_async: bool = False, dbo: bool = False, ubatch: int = 0):
        do_recv_hook = dbo or do_async
        handle = self.handles[ubatch]
        assert handle is not None
        _, _, recv_hook = self.buffer.low_latency_combine(
            fused_expert_output, topk_ids, topk_weights, handle, async_finish=False,
            zero_copy=False, return_recv_hook=do_recv_hook, out=output)
        return recv_hook


def _vllm_ll_buffer(group, max_tokens: int, hidden: int, experts: int):
    """A low-latency Buffer as vLLM's DeepEPLLAll2AllManager (all2all.py) makes one: sized by
    Buffer.get_low_latency_rdma_size_hint (keyword-spelled), one QP per local expert. Not
    replayed line by line from a pinned commit: only the prepare/finalize calls are."""
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=max_tokens, hidden=hidden, num_ranks=group.size(),
        num_experts=experts)
    return deep_ep.Buffer(group, num_nvl_bytes=0, num_rdma_bytes=num_rdma_bytes,
                          low_latency_mode=True, num_qps_per_rank=experts // group.size(),
                          allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                          enable_shrink=False)


LL_HIDDEN = 2048  # the smallest of DeepEPLLPrepareAndFinalize.SUPPORTED_HIDDEN_SIZES


def _ll_expert(recv, scales, fp8: bool, c: float) -> np.ndarray:
    return times(dequant(recv, scales) if fp8 else recv, c)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_vllm_low_latency_prepare_finalize(env, fp8: bool) -> None:
    """vLLM DeepEPLLPrepareAndFinalize (deepep_ll.py @ 055e47c): prepare (dispatch with
    return_recv_hook=True, then hook()), batched experts, finalize (combine into `out`,
    zero_copy=False, no hook), for two decode steps on one Buffer. With use_fp8 the payload is
    DeepEP's per-128-channel e4m3 quantisation (round_scale/use_ue8m0 off)."""
    experts, topk, num_max = 8, 2, 8
    steps = [ll_workload([5, 7], LL_HIDDEN, experts, topk),
             ll_workload([8, 3], LL_HIDDEN, experts, topk)]

    def rank(r, group):
        pf = VllmLL(_vllm_ll_buffer(group, num_max, LL_HIDDEN, experts), num_max, fp8)
        try:
            out = []
            for xs, idx, w in steps:
                x, s, count = pf.prepare(tt(xs[r]), tt(idx[r]), experts)
                y = _ll_expert(nd(x), None if s is None else nd(s), fp8, 2.0)
                output = torch.empty((len(xs[r]), LL_HIDDEN), dtype=torch.bfloat16, device=device())
                assert pf.finalize(output, tt(y), tt(w[r]), tt(idx[r])) is None
                out.append((nd(x), None if s is None else nd(s), nd(count), nd(output)))
            return out
        finally:
            pf.buffer.destroy()

    res = run_ranks(rank)
    for i, (xs, idx, w) in enumerate(steps):
        disp = ref.low_latency_dispatch(xs, idx, experts, num_max, use_fp8=fp8)
        ys = [_ll_expert(d.recv_x, d.recv_x_scales, fp8, 2.0) for d in disp]
        comb = ref.low_latency_combine(ys, disp, idx, w, experts)
        for r in range(NUM_RANKS):
            x, s, count, output = res[r][i]
            tag = f"step {i} rank {r}"
            np.testing.assert_array_equal(count, disp[r].recv_count, err_msg=tag)
            exact_rows(x, disp[r].recv_x, count, f"{tag} expert_x")  # reference row order
            if fp8:
                exact_rows(s, disp[r].recv_x_scales, count, f"{tag} expert_x_scale")
            exact(output, comb[r], f"{tag} finalize output")


def test_vllm_low_latency_dbo_two_ubatches(env) -> None:
    """vLLM DBO with DeepEP LL (deepep_ll.py + v1/worker/ubatching.py @ 055e47c): ubatch 0 and
    1 each prepare_async (dispatch, hook registered for the other thread to run), then
    finalize with return_recv_hook=True (dbo_enabled): D0 D1 C0 C1 on one Buffer, hooks
    run at the next yield."""
    experts, topk, num_max = 8, 2, 8
    ub = [ll_workload([6, 4], LL_HIDDEN, experts, topk),
          ll_workload([3, 8], LL_HIDDEN, experts, topk)]

    def rank(r, group):
        pf = VllmLL(_vllm_ll_buffer(group, num_max, LL_HIDDEN, experts), num_max, False)
        try:
            pending = [pf.prepare_async(tt(xs[r]), tt(idx[r]), experts, ubatch=u)
                       for u, (xs, idx, _) in enumerate(ub)]
            recvs = []
            for hook, receiver in pending:
                hook()
                recvs.append(receiver())
            outs = []
            for u, (xs, idx, w) in enumerate(ub):
                output = torch.empty((len(xs[r]), LL_HIDDEN), dtype=torch.bfloat16, device=device())
                hook = pf.finalize(output, tt(times(nd(recvs[u][0]), 2.0 ** (u + 1))),
                                   tt(w[r]), tt(idx[r]), dbo=True, ubatch=u)
                hook()
                outs.append(nd(output))
            return [nd(x[0]) for x in recvs], outs
        finally:
            pf.buffer.destroy()

    res = run_ranks(rank)
    for u, (xs, idx, w) in enumerate(ub):
        disp = ref.low_latency_dispatch(xs, idx, experts, num_max)
        comb = ref.low_latency_combine([times(d.recv_x, 2.0 ** (u + 1)) for d in disp], disp,
                                       idx, w, experts)
        for r in range(NUM_RANKS):
            exact_rows(res[r][0][u], disp[r].recv_x, disp[r].recv_count,
                       f"ubatch {u} rank {r} expert_x")
            exact(res[r][1][u], comb[r], f"ubatch {u} rank {r} output")


def test_vllm_low_latency_packed_ue8m0_scales(env) -> None:
    """vLLM deepep_ll.py @ 055e47c with use_ue8m0_dispatch (post_init_setup): dispatch with
    use_fp8=True, round_scale=True, use_ue8m0=True; the scales must be DeepEP's packed int32."""
    experts, topk, num_max = 8, 2, 8
    xs, idx, _ = ll_workload([4, 5], LL_HIDDEN, experts, topk)

    def rank(r, group):
        pf = VllmLL(_vllm_ll_buffer(group, num_max, LL_HIDDEN, experts), num_max, True,
                    use_ue8m0_dispatch=True)
        try:
            _, s, _ = pf.prepare(tt(xs[r]), tt(idx[r]), experts)
            return s.dtype, tuple(s.shape)
        finally:
            pf.buffer.destroy()

    for dtype, shape in run_ranks(rank):
        assert dtype == torch.int32 and shape == (experts // NUM_RANKS, NUM_RANKS * num_max,
                                                  LL_HIDDEN // 512), (dtype, shape)


def test_vllm_low_latency_fp8_scales_layout(env) -> None:
    """vLLM deepep_ll.py @ 055e47c passes the dispatched scales straight to the masked grouped
    GEMM (block_k == 128 branch of _do_quant): their strides are DeepEP's."""
    experts, topk, num_max = 8, 2, 8
    xs, idx, _ = ll_workload([4, 5], LL_HIDDEN, experts, topk)

    def rank(r, group):
        pf = VllmLL(_vllm_ll_buffer(group, num_max, LL_HIDDEN, experts), num_max, True)
        try:
            _, s, _ = pf.prepare(tt(xs[r]), tt(idx[r]), experts)
            return s.stride()
        finally:
            pf.buffer.destroy()

    for stride in run_ranks(rank):
        assert stride[-2] == 1, f"scales strides {stride}: row-major"


def test_low_latency_scales_values_in_deepep_layout(env) -> None:
    """The packed words hold the exponents of the float scales (4 to a word, byte k = scale
    4j + k; DeepEP's kernel stores `bits >> 23` of each power-of-two scale), and both layouts
    are column-major in the last two dimensions (DeepEP csrc/deep_ep.cpp @ 567632d). Checked
    against the float scales of the same call with round_scale, decoded independently."""
    experts, topk, num_max = 8, 2, 8
    xs, idx, _ = ll_workload([4, 5], LL_HIDDEN, experts, topk)

    def rank(r, group):
        buf = _vllm_ll_buffer(group, num_max, LL_HIDDEN, experts)
        try:
            (_, sf), count, *_ = buf.low_latency_dispatch(
                tt(xs[r]), tt(idx[r]), num_max, experts, use_fp8=True, round_scale=True)
            sf = sf.clone()
            (_, packed), *_ = buf.low_latency_dispatch(
                tt(xs[r]), tt(idx[r]), num_max, experts, use_fp8=True, round_scale=True,
                use_ue8m0=True)
            lx, n, s = sf.shape
            assert sf.stride() == (s * n, 1, n) and sf.dtype == torch.float32
            assert packed.shape == (lx, n, s // 4) and packed.dtype == torch.int32
            assert packed.stride() == (s // 4 * n, 1, n)
            return tuple(t.cpu() if t.device.type != "cpu" else t.clone()
                         for t in (sf, packed, count))
        finally:
            buf.destroy()

    for sf, packed, count in run_ranks(rank):
        lx, _, s = sf.shape
        words = packed.numpy().astype(np.int64) & 0xFFFFFFFF
        for le in range(lx):
            for row in range(int(count[le])):
                m, e = np.frexp(sf[le, row].numpy().astype(np.float64))
                assert (m == 0.5).all(), "round_scale gives powers of two"
                exps = (e - 1 + 127).astype(np.int64)  # the IEEE biased exponent
                got = [(int(words[le, row, j // 4]) >> (8 * (j % 4))) & 0xFF for j in range(s)]
                assert got == exps.tolist(), (le, row)


# ------------------------------------------------------------------------------------------------
# SGLang: DeepEPDispatcher (normal, low latency, auto) and two-batch overlap
# ------------------------------------------------------------------------------------------------

class SglangDeepEPBuffer:
    """python/sglang/srt/layers/moe/token_dispatcher/deepep.py `DeepEPBuffer` @ 003a81b: one
    Buffer per process (class state), sized from the Config hints; AUTO mode cleans the
    low-latency buffer when switching from normal to low latency."""

    def __init__(self) -> None:
        self._buffer = None
        self._dispatch_mode = None
        self._args = None

    def get_deepep_buffer(self, group, hidden_size: int, param_bytes: int, mode: str,
                          num_max_dispatch_tokens_per_rank: int, num_experts: int):
        if self._buffer is not None:
            return self._buffer
        self._args = (num_max_dispatch_tokens_per_rank, hidden_size, num_experts)
        num_nvl_bytes, num_rdma_bytes = 0, 0
        if mode in ("normal", "auto"):
            hidden_bytes = hidden_size * param_bytes
            for config in (deep_ep.Buffer.get_dispatch_config(group.size()),
                           deep_ep.Buffer.get_combine_config(group.size())):
                num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()),
                                    num_nvl_bytes)
                num_rdma_bytes = max(
                    config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
        if mode in ("low_latency", "auto"):
            num_rdma_bytes = max(deep_ep.Buffer.get_low_latency_rdma_size_hint(
                num_max_dispatch_tokens_per_rank, hidden_size, group.size(), num_experts),
                num_rdma_bytes)
        num_sms = deep_ep.Buffer.num_sms  # DeepEPConfig without --deepep-config
        num_qps_per_rank = {"normal": num_sms, "low_latency": num_experts // group.size(),
                            "auto": max(num_sms, num_experts // group.size())}[mode]
        self._buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes,
                                      low_latency_mode=mode != "normal",
                                      num_qps_per_rank=num_qps_per_rank, allow_mnnvl=True)
        return self._buffer

    def set_dispatch_mode_as_normal(self) -> None:
        self._dispatch_mode = "normal"

    def set_dispatch_mode_as_low_latency(self) -> None:
        if self._dispatch_mode == "normal" and self._buffer.low_latency_mode:
            self._buffer.clean_low_latency_buffer(*self._args)
        self._dispatch_mode = "low_latency"


class SglangDispatcher:
    """`_DeepEPDispatcherImplNormal` and `_DeepEPDispatcherImplLowLatency`
    (token_dispatcher/deepep.py @ 003a81b): dispatch_a/dispatch_b/combine_a/combine_b with the
    handle kept on the dispatcher (`self.handle`)."""

    def __init__(self, state: SglangDeepEPBuffer, group, *, mode: str, hidden_size: int,
                 num_experts: int, num_max_dispatch_tokens_per_rank: int = 128,
                 async_finish: bool = False, return_recv_hook: bool = False,
                 deepgemm: bool = True) -> None:
        self.state, self.group, self.mode = state, group, mode
        self.hidden_size, self.num_experts = hidden_size, num_experts
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.async_finish, self.return_recv_hook = async_finish, return_recv_hook
        self.deepgemm = deepgemm  # deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM
        self.params_bytes = 2  # DeepEPOutputDtype.BF16
        self.use_fp8 = False
        self.handle = None

    def _get_buffer(self, ll: bool):
        if ll:
            self.state.set_dispatch_mode_as_low_latency()
        else:
            self.state.set_dispatch_mode_as_normal()
        return self.state.get_deepep_buffer(self.group, self.hidden_size, self.params_bytes,
                                            self.mode, self.num_max_dispatch_tokens_per_rank,
                                            self.num_experts)

    # -- normal --------------------------------------------------------------------------------
    def normal_dispatch_a(self, hidden_states, topk_ids, topk_weights):
        topk_ids = topk_ids.to(torch.int64)
        previous_event = deep_ep.Buffer.capture() if self.async_finish else None
        return hidden_states, topk_ids, topk_weights, previous_event

    def normal_dispatch_b(self, x, topk_ids, topk_weights, previous_event):
        buffer = self._get_buffer(False)
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
         previous_event) = buffer.get_dispatch_layout(
            topk_ids, self.num_experts, previous_event=previous_event,
            async_finish=self.async_finish, allocate_on_comm_stream=previous_event is not None)
        (recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, self.handle,
         event) = buffer.dispatch(
            x, topk_idx=topk_ids, topk_weights=topk_weights,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
            previous_event=previous_event, async_finish=self.async_finish,
            allocate_on_comm_stream=(previous_event is not None) and self.async_finish,
            expert_alignment=128 if self.deepgemm else 1, config=None)
        if self.async_finish:
            event.current_stream_wait()
        return recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert

    def normal_combine_a(self, hidden_states):
        previous_event = deep_ep.Buffer.capture() if self.async_finish else None
        return hidden_states, previous_event

    def normal_combine_b(self, x, previous_event):
        buffer = self._get_buffer(False)
        combined_x, _, event = buffer.combine(
            x, self.handle, async_finish=self.async_finish, previous_event=previous_event,
            allocate_on_comm_stream=previous_event is not None, config=None)
        if self.async_finish:
            event.current_stream_wait()
        self.handle = None
        return combined_x

    # -- low latency ---------------------------------------------------------------------------
    def ll_dispatch_a(self, hidden_states, topk_ids):
        buffer = self._get_buffer(True)
        topk_ids = topk_ids.to(torch.int64)
        expected_m = (hidden_states.shape[0] * buffer.group_size * topk_ids.shape[1]
                      + self.num_experts) // self.num_experts
        packed_recv_hidden, self.packed_recv_count, self.handle, event, hook = \
            buffer.low_latency_dispatch(
                hidden_states, topk_ids, self.num_max_dispatch_tokens_per_rank,
                self.num_experts, use_fp8=self.use_fp8, async_finish=not self.return_recv_hook,
                return_recv_hook=self.return_recv_hook)
        return packed_recv_hidden, self.packed_recv_count, expected_m, event, hook

    def ll_dispatch_b(self, event, hook) -> None:
        hook() if self.return_recv_hook else event.current_stream_wait()

    def ll_combine_a(self, hidden_states, topk_ids, topk_weights):
        buffer = self._get_buffer(True)
        combined, event, hook = buffer.low_latency_combine(
            x=hidden_states, topk_idx=topk_ids, topk_weights=topk_weights, handle=self.handle,
            async_finish=not self.return_recv_hook, return_recv_hook=self.return_recv_hook)
        self.packed_recv_count = self.handle = None
        return combined, event, hook

    def ll_combine_b(self, combined, event, hook):
        hook() if self.return_recv_hook else event.current_stream_wait()
        return combined


def _check_normal(res_of, batches, experts: int, align: int, c_of) -> None:
    for b, (xs, idx, w) in enumerate(batches):
        disp = ref.dispatch(xs, idx, w, experts, expert_alignment=align)
        comb = ref.combine([times(d.recv_x, c_of(b)) for d in disp], disp, [len(x) for x in xs])
        for r in range(NUM_RANKS):
            rx, ridx, rw, counts, cx = res_of(r, b)
            tag = f"batch {b} rank {r}"
            exact(rx, disp[r].recv_x, f"{tag} recv_x")
            exact(ridx, disp[r].recv_topk_idx, f"{tag} recv_topk_ids")
            exact(rw, disp[r].recv_topk_weights, f"{tag} recv_topk_weights")
            assert list(counts) == disp[r].num_recv_tokens_per_expert, tag
            exact(cx, comb[r][0], f"{tag} combined")


def _check_ll(res_of, batches, experts: int, num_max: int, c_of) -> None:
    for b, (xs, idx, w) in enumerate(batches):
        disp = ref.low_latency_dispatch(xs, idx, experts, num_max)
        comb = ref.low_latency_combine([times(d.recv_x, c_of(b)) for d in disp], disp, idx, w,
                                       experts)
        for r in range(NUM_RANKS):
            rx, count, expected_m, cx = res_of(r, b)
            tag = f"batch {b} rank {r}"
            np.testing.assert_array_equal(count, disp[r].recv_count, err_msg=tag)
            exact_rows(rx, disp[r].recv_x, count, f"{tag} packed_recv_hidden")
            assert expected_m == (len(xs[r]) * NUM_RANKS * idx[r].shape[1] + experts) // experts
            exact(cx, comb[r], f"{tag} combined")


@pytest.mark.parametrize("async_finish,deepgemm", [(False, True), (True, True), (True, False)],
                         ids=["sync-align128", "async-align128", "async-align1"])
def test_sglang_normal_dispatcher(env, async_finish: bool, deepgemm: bool) -> None:
    """SGLang `_DeepEPDispatcherImplNormal` (token_dispatcher/deepep.py @ 003a81b), prefill in
    normal mode: Buffer.capture() as previous_event with async_finish, the layout's event into
    dispatch with allocate_on_comm_stream, expert_alignment=128 under DeepGEMM, combine
    without topk_weights; two layers on the one Buffer."""
    hidden, experts, topk = 256, 8, 2
    layers = [workload([14, 10], hidden, experts, topk) for _ in range(2)]

    def rank(r, group):
        state = SglangDeepEPBuffer()
        d = SglangDispatcher(state, group, mode="normal", hidden_size=hidden,
                             num_experts=experts, async_finish=async_finish, deepgemm=deepgemm)
        try:
            out = []
            for xs, idx, w in layers:
                a = d.normal_dispatch_a(tt(xs[r]), tt(idx[r]), tt(w[r]))
                rx, ridx, rw, counts = d.normal_dispatch_b(*a)
                cx = d.normal_combine_b(*d.normal_combine_a(tt(times(nd(rx), 2.0))))
                out.append((nd(rx), nd(ridx), nd(rw), counts, nd(cx)))
            return out
        finally:
            state._buffer.destroy()

    res = run_ranks(rank)
    _check_normal(lambda r, b: res[r][b], layers, experts, 128 if deepgemm else 1,
                  lambda b: 2.0)


@pytest.mark.parametrize("return_recv_hook", [False, True], ids=["event", "hook"])
def test_sglang_auto_mode_normal_then_low_latency(env, return_recv_hook: bool) -> None:
    """SGLang DeepEPDispatcher in AUTO mode (token_dispatcher/deepep.py @ 003a81b): one Buffer
    with low_latency_mode=True serves a prefill (normal dispatcher, sync) and then decode steps
    (low-latency dispatcher: clean_low_latency_buffer on the switch; async_finish events, or
    return_recv_hook hooks), keyword-spelled low_latency_combine."""
    hidden, experts, topk, num_max = 256, 8, 2, 16
    prefill = workload([12, 9], hidden, experts, topk)
    decode = [ll_workload([5, 8], hidden, experts, topk), ll_workload([16, 2], hidden, experts,
                                                                      topk)]

    def rank(r, group):
        state = SglangDeepEPBuffer()
        kw = dict(mode="auto", hidden_size=hidden, num_experts=experts,
                  num_max_dispatch_tokens_per_rank=num_max)
        normal = SglangDispatcher(state, group, async_finish=False, **kw)
        ll = SglangDispatcher(state, group, return_recv_hook=return_recv_hook, **kw)
        try:
            xs, idx, w = prefill
            rx, ridx, rw, counts = normal.normal_dispatch_b(
                *normal.normal_dispatch_a(tt(xs[r]), tt(idx[r]), tt(w[r])))
            cx = normal.normal_combine_b(*normal.normal_combine_a(tt(times(nd(rx), 2.0))))
            normal_out = (nd(rx), nd(ridx), nd(rw), counts, nd(cx))
            ll_out = []
            for xs, idx, w in decode:
                hidden_states, count, expected_m, event, hook = ll.ll_dispatch_a(
                    tt(xs[r]), tt(idx[r]))
                ll.ll_dispatch_b(event, hook)
                y = tt(times(nd(hidden_states), 4.0))
                cx = ll.ll_combine_b(*ll.ll_combine_a(y, tt(idx[r]), tt(w[r])))
                ll_out.append((nd(hidden_states), nd(count), expected_m, nd(cx)))
            return normal_out, ll_out
        finally:
            state._buffer.destroy()

    res = run_ranks(rank)
    _check_normal(lambda r, b: res[r][0], [prefill], experts, 128, lambda b: 2.0)
    _check_ll(lambda r, b: res[r][1][b], decode, experts, num_max, lambda b: 4.0)


def _execute_two_batch(stages_a, stages_b, delta_stages: int) -> None:
    """sglang/srt/batch_overlap/two_batch_overlap.py `_execute_two_batch_raw`: `delta_stages`
    stages of a first, then a and b alternately, then b's last `delta_stages`."""
    a, b = iter(stages_a), iter(stages_b)
    for _ in range(delta_stages):
        next(a)()
    for _ in range(len(stages_a) - delta_stages):
        next(a)()
        next(b)()
    for _ in range(delta_stages):
        next(b)()


def test_sglang_two_batch_overlap(env) -> None:
    """SGLang two-batch overlap (batch_overlap/operations_strategy.py @ 0e02cef, DeepSeek
    strategies; two_batch_overlap.py's executor): two DeepEPDispatcher instances (one per
    micro-batch, as MaybeTboDeepEPDispatcher holds) share the process's one Buffer.
    Prefill (normal, async_finish, tbo_delta_stages=0): stages split at YieldOperation after
    dispatch_a and after combine_a, so the Buffer sees D0 D1 C0 C1 with both handles held.
    Decode (low latency, return_recv_hook, tbo_delta_stages=2): dispatch_a | dispatch_b,
    experts, combine_a | combine_b, interleaved two stages apart; three layers."""
    hidden, experts, topk, num_max = 256, 8, 2, 16
    pre = [workload([10, 13], hidden, experts, topk), workload([7, 4], hidden, experts, topk)]
    layers = 3
    dec = [[ll_workload([4, 6], hidden, experts, topk), ll_workload([5, 3], hidden, experts,
                                                                    topk)]
           for _ in range(layers)]

    def rank(r, group):
        state = SglangDeepEPBuffer()
        kw = dict(mode="auto", hidden_size=hidden, num_experts=experts,
                  num_max_dispatch_tokens_per_rank=num_max)
        try:
            # prefill: normal dispatchers with async_finish (SGLang's TBO default for normal)
            normal = [SglangDispatcher(state, group, async_finish=True, **kw) for _ in range(2)]
            pout: list[dict] = [{}, {}]

            def prefill_stages(m):
                d, (xs, idx, w), o = normal[m], pre[m], pout[m]

                def s0():  # ... op_select_experts, op_dispatch_a | yield
                    o["a"] = d.normal_dispatch_a(tt(xs[r]), tt(idx[r]), tt(w[r]))

                def s1():  # op_dispatch_b, op_experts, op_combine_a | yield
                    o["recv"] = d.normal_dispatch_b(*o.pop("a"))
                    o["ca"] = d.normal_combine_a(tt(times(nd(o["recv"][0]), 2.0 ** (m + 1))))

                def s2():  # op_shared_experts, op_combine_b, op_output, ...
                    o["cx"] = d.normal_combine_b(*o.pop("ca"))
                return [s0, s1, s2]

            _execute_two_batch(prefill_stages(0), prefill_stages(1), delta_stages=0)
            prefill_res = [(nd(o["recv"][0]), nd(o["recv"][1]), nd(o["recv"][2]),
                            o["recv"][3], nd(o["cx"])) for o in pout]

            # decode: low-latency dispatchers with return_recv_hook (TBO decode)
            lld = [SglangDispatcher(state, group, return_recv_hook=True, **kw)
                   for _ in range(2)]
            dout: list[list[dict]] = [[{} for _ in range(layers)] for _ in range(2)]

            def decode_stages(m):
                d, stages = lld[m], []
                for layer in range(layers):
                    xs, idx, w = dec[layer][m]
                    o = dout[m][layer]

                    def attn():  # (previous layer's op_output, ...) op_prepare | yield
                        pass

                    def core():  # op_core ... op_select_experts | yield
                        pass

                    def disp_a(xs=xs, idx=idx, o=o):  # op_dispatch_a, shared | yield
                        o["a"] = d.ll_dispatch_a(tt(xs[r]), tt(idx[r]))

                    def disp_b(idx=idx, w=w, o=o, layer=layer):  # dispatch_b, experts,
                        hs, count, expected_m, event, hook = o.pop("a")  # combine_a | yield
                        d.ll_dispatch_b(event, hook)
                        o["recv"] = (nd(hs), nd(count), expected_m)
                        y = tt(times(o["recv"][0], 2.0 ** (m + layer % 2)))
                        o["ca"] = d.ll_combine_a(y, tt(idx[r]), tt(w[r]))

                    def comb_b(o=o):  # op_combine_b | yield
                        o["cx"] = nd(d.ll_combine_b(*o.pop("ca")))
                    stages += [attn, core, disp_a, disp_b, comb_b]
                return [*stages, lambda: None]  # the last layer's op_output, postprocess

            _execute_two_batch(decode_stages(0), decode_stages(1), delta_stages=2)
            decode_res = [[(*o["recv"], o["cx"]) for o in dout[m]] for m in range(2)]
            return prefill_res, decode_res
        finally:
            state._buffer.destroy()

    res = run_ranks(rank)
    _check_normal(lambda r, b: res[r][0][b], pre, experts, 128, lambda b: 2.0 ** (b + 1))
    for layer in range(layers):
        _check_ll(lambda r, b, layer=layer: res[r][1][b][layer], dec[layer], experts, num_max,
                  lambda b, layer=layer: 2.0 ** (b + layer % 2))


# ------------------------------------------------------------------------------------------------
# Megatron-LM: fused dispatch / combine, forward and backward
# ------------------------------------------------------------------------------------------------

class MegatronFusedA2A:
    """megatron/core/transformer/moe/fused_a2a.py @ d98e8a6: `get_buffer` (module-global
    Buffer, re-made when too small or of another group), FusedDispatch.forward/backward and
    FusedCombine.forward/backward, with the MoEFlexTokenDispatcher defaults
    (token_dispatcher.py: async_finish=True, allocate_on_comm_stream=True,
    set_deepep_num_sms(20)). One instance per rank thread stands for the module global."""

    def __init__(self) -> None:
        self._buffer = None
        self.buffers_made = 0

    @staticmethod
    def get_hidden_bytes(x) -> int:
        return x.size(1) * max(x.element_size(), 2)

    def get_buffer(self, group, hidden_bytes: int):
        num_nvl_bytes, num_rdma_bytes = 0, 0
        for config in (deep_ep.Buffer.get_dispatch_config(group.size()),
                       deep_ep.Buffer.get_combine_config(group.size())):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()),
                                num_nvl_bytes)
            num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()),
                                 num_rdma_bytes)
        if (self._buffer is None or self._buffer.group != group
                or self._buffer.num_nvl_bytes < num_nvl_bytes
                or self._buffer.num_rdma_bytes < num_rdma_bytes):
            self._buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes)
            self.buffers_made += 1
        return self._buffer

    def dispatch_forward(self, ctx: dict, x, token_indices, token_probs, num_experts, group,
                         async_finish=True, allocate_on_comm_stream=True):
        previous_event = None
        if async_finish:
            previous_event = EventOverlap(EventHandle())
        buffer = self.get_buffer(group, self.get_hidden_bytes(x))
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
         event) = buffer.get_dispatch_layout(
            token_indices, num_experts, previous_event=previous_event,
            async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
        (recv_x, recv_token_indices, recv_token_probs, num_recv_tokens_per_expert_list, handle,
         after_event_overlap) = buffer.dispatch(
            x, topk_idx=token_indices, topk_weights=token_probs,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
            previous_event=event, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after_event_overlap.current_stream_wait()
        ctx.update(group=group, handle=handle, async_finish=async_finish,
                   allocate_on_comm_stream=allocate_on_comm_stream)
        tokens_per_expert = torch.tensor(num_recv_tokens_per_expert_list)
        return recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, handle

    def dispatch_backward(self, ctx: dict, grad_output, grad_token_probs):
        buffer = self.get_buffer(ctx["group"], self.get_hidden_bytes(grad_output))
        previous_event = None
        if ctx["async_finish"]:
            previous_event = EventOverlap(EventHandle())
        grad_x, grad_token_probs, after_event = buffer.combine(
            grad_output.contiguous(), ctx["handle"], topk_weights=grad_token_probs.float(),
            previous_event=previous_event, async_finish=ctx["async_finish"],
            allocate_on_comm_stream=ctx["allocate_on_comm_stream"])
        if ctx["async_finish"]:
            after_event.current_stream_wait()
        return grad_x, grad_token_probs

    def combine_forward(self, ctx: dict, x, group, handle, async_finish=True,
                        allocate_on_comm_stream=True):
        previous_event = None
        if async_finish:
            previous_event = EventOverlap(EventHandle())
        buffer = self.get_buffer(group, self.get_hidden_bytes(x))
        combined_x, _, after_event = buffer.combine(
            x, handle=handle, async_finish=async_finish, previous_event=previous_event,
            allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after_event.current_stream_wait()
        ctx.update(handle=handle, group=group, async_finish=async_finish,
                   allocate_on_comm_stream=allocate_on_comm_stream)
        return combined_x

    def combine_backward(self, ctx: dict, grad_output):
        previous_event = None
        if ctx["async_finish"]:
            previous_event = EventOverlap(EventHandle())
        buffer = self.get_buffer(ctx["group"], self.get_hidden_bytes(grad_output))
        grad_x, _, _, _, _, after_event = buffer.dispatch(
            grad_output.contiguous(), handle=ctx["handle"], previous_event=previous_event,
            async_finish=ctx["async_finish"],
            allocate_on_comm_stream=ctx["allocate_on_comm_stream"])
        if ctx["async_finish"]:
            after_event.current_stream_wait()
        return grad_x


MEGATRON_LAYERS = 100


def test_megatron_fused_dispatch_combine_100_layers_forward_backward(env) -> None:
    """Megatron-LM fused_a2a.py @ d98e8a6 through MoEFlexTokenDispatcher (token_dispatcher.py:
    token indices from torch.topk, -1 where dropped by the capacity factor, float32 probs):
    100 MoE layers forward (FusedDispatch.forward, experts, FusedCombine.forward; each layer's
    autograd ctx keeps the dispatch handle), then backward in reverse layer order as autograd
    runs it: FusedCombine.backward (cached dispatch with the handle), experts' backward,
    FusedDispatch.backward (combine with the handle and topk_weights=grad of the received
    probs). async_finish and allocate_on_comm_stream as the flex dispatcher passes them."""
    hidden, experts, topk = 128, 8, 2
    tokens = [9, 6]
    fwd = [workload(tokens, hidden, experts, topk, drop=0.1) for _ in range(MEGATRON_LAYERS)]
    rng = np.random.default_rng(11)
    grad_out = [[ref.random_x(rng, t, hidden, BF16) for t in tokens]
                for _ in range(MEGATRON_LAYERS)]
    deepep_num_sms = deep_ep.Buffer.num_sms
    barrier = threading.Barrier(NUM_RANKS)

    def rank(r, group):
        deep_ep.Buffer.set_num_sms(20)  # set_deepep_num_sms(moe_flex_dispatcher_num_sms or 20)
        m = MegatronFusedA2A()
        try:
            ctxs, out = [], []
            for xs, idx, w in fwd:  # forward
                cd, cc = {}, {}
                recv_x, recv_idx, recv_probs, tpe, handle = m.dispatch_forward(
                    cd, tt(xs[r]), tt(idx[r]), tt(w[r]), experts, group)
                y = tt(times(nd(recv_x), 2.0))  # expert MLP stand-in: y = 2 x
                combined = m.combine_forward(cc, y, group, handle)
                ctxs.append((cd, cc, recv_probs))
                out.append([nd(recv_x), nd(recv_idx), nd(recv_probs), tpe.tolist(),
                            nd(combined)])
            barrier.wait()
            for layer in reversed(range(MEGATRON_LAYERS)):  # backward, reverse layer order
                cd, cc, recv_probs = ctxs[layer]
                g_y = m.combine_backward(cc, tt(grad_out[layer][r]))
                g_recv = tt(times(nd(g_y), 2.0))  # d(2x)/dx
                g_probs = recv_probs * 0.5  # a gradient for the received probs
                grad_x, grad_probs = m.dispatch_backward(cd, g_recv, g_probs)
                out[layer] += [nd(g_y), nd(grad_x), nd(grad_probs)]
                ctxs[layer] = None
            return out, m.buffers_made
        finally:
            if m._buffer is not None:
                m._buffer.destroy()

    try:
        res = run_ranks(rank)
    finally:
        deep_ep.Buffer.num_sms = deepep_num_sms
    assert [made for _, made in res] == [1, 1]  # one Buffer for every layer, as Megatron's
    for layer, (xs, idx, w) in enumerate(fwd):
        disp = ref.dispatch(xs, idx, w, experts)
        comb = ref.combine([times(d.recv_x, 2.0) for d in disp], disp, tokens)
        gdisp = ref.dispatch(grad_out[layer], idx, w, experts)
        g_probs = [(d.recv_topk_weights * np.float32(0.5)).astype(np.float32) for d in disp]
        gcomb = ref.combine([times(g.recv_x, 2.0) for g in gdisp], disp, tokens,
                            recv_topk_weights=g_probs)
        for r in range(NUM_RANKS):
            recv_x, recv_idx, recv_probs, tpe, combined, g_y, grad_x, grad_probs = \
                res[r][0][layer]
            tag = f"layer {layer} rank {r}"
            exact(recv_x, disp[r].recv_x, f"{tag} recv_x")
            exact(recv_idx, disp[r].recv_topk_idx, f"{tag} recv_token_indices")
            exact(recv_probs, disp[r].recv_topk_weights, f"{tag} recv_token_probs")
            assert tpe == disp[r].num_recv_tokens_per_expert, tag
            exact(combined, comb[r][0], f"{tag} combine forward")
            exact(g_y, gdisp[r].recv_x, f"{tag} combine backward (cached dispatch)")
            exact(grad_x, gcomb[r][0], f"{tag} dispatch backward grad_x")
            exact(grad_probs, gcomb[r][1], f"{tag} dispatch backward grad_token_probs")


XTUNER = "InternLM/xtuner@02d761bd648ee4d99d23887820e9b93fdaffe6e0"


class XtunerDeepEP:
    """xtuner/v1/ops/comm/deepep_op.py @ 02d761b: DeepEPDispatch and DeepEPCombine, autograd
    functions that keep DeepEP's handle as its parts, `ctx.save_for_backward(*handle)`, and
    give `ctx.saved_tensors` (a tuple of tensors and Nones) back to `combine` (dispatch
    backward) and to a cached `dispatch` (combine backward). `get_buffer`, `buffer_capture`
    and the four *_forward/*_backward helpers as there (normal-mode Buffer, async_finish=True,
    allocate_on_comm_stream when a previous event is given)."""

    def __init__(self, group) -> None:
        self.buffer = deep_ep.Buffer(group, int(1e9), 0)
        outer = self

        class Dispatch(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, topk_idx, topk_weights, num_experts, group, previous_event=None):
                (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
                 handle, event) = outer.dispatch_forward(x, topk_idx, topk_weights, num_experts,
                                                         previous_event)
                ctx.save_for_backward(*handle)
                ctx.num_experts = num_experts
                return (recv_x, recv_topk_idx, recv_topk_weights,
                        num_recv_tokens_per_expert_list, handle, event)

            @staticmethod
            def backward(ctx, grad_recv_x, grad_recv_topk_idx, grad_recv_topk_weights, *args):
                handle = ctx.saved_tensors
                combined_grad_x, combined_grad_recv_topk_weights, event = \
                    outer.dispatch_backward(grad_recv_x, grad_recv_topk_weights, handle,
                                            outer.buffer_capture())
                event.current_stream_wait()
                return combined_grad_x, None, combined_grad_recv_topk_weights, None, None, None

        class Combine(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, num_experts, handle, group, previous_event=None):
                combined_x, event = outer.combine_forward(x, handle, previous_event)
                ctx.save_for_backward(*handle)
                ctx.num_experts = num_experts
                return combined_x, event

            @staticmethod
            def backward(ctx, grad_combined_x, *args):
                handle = ctx.saved_tensors
                grad_x, event = outer.combine_backward(grad_combined_x, handle,
                                                       outer.buffer_capture())
                event.current_stream_wait()
                return grad_x, None, None, None, None

        self.Dispatch, self.Combine = Dispatch, Combine

    def buffer_capture(self):
        return EventOverlap(EventHandle())

    def dispatch_forward(self, x, topk_idx, topk_weights, num_experts, previous_event=None):
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
         previous_event) = self.buffer.get_dispatch_layout(
            topk_idx, num_experts, previous_event=previous_event, async_finish=True,
            allocate_on_comm_stream=previous_event is not None)
        return self.buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
            previous_event=previous_event, async_finish=True, allocate_on_comm_stream=True)

    def dispatch_backward(self, grad_recv_x, grad_recv_topk_weights, handle, previous_event=None):
        return self.buffer.combine(grad_recv_x, handle, topk_weights=grad_recv_topk_weights,
                                   async_finish=True, previous_event=previous_event,
                                   allocate_on_comm_stream=previous_event is not None)

    def combine_forward(self, x, handle, previous_event=None):
        combined_x, _, event = self.buffer.combine(
            x, handle, async_finish=True, previous_event=previous_event,
            allocate_on_comm_stream=previous_event is not None)
        return combined_x, event

    def combine_backward(self, grad_combined_x, handle, previous_event=None):
        grad_x, _, _, _, _, event = self.buffer.dispatch(
            grad_combined_x, handle=handle, async_finish=True, previous_event=previous_event,
            allocate_on_comm_stream=previous_event is not None)
        return grad_x, event


XTUNER_LAYERS = 4


def test_xtuner_autograd_functions_keep_the_handle_as_saved_tensors(env) -> None:
    """xtuner's DeepEPDispatch / DeepEPCombine (XTUNER) over several chained MoE layers (each
    layer's input the previous one's combined output), forward then one autograd backward
    through all of them: each function saves the handle's parts with
    `save_for_backward(*handle)` (the positions EPD does not produce unpack as None) and its
    backward passes `ctx.saved_tensors` as the handle. Forward outputs and every layer's input
    gradient exact against the reference; once the graph is dropped the engine holds no
    handle (the saved parts kept them alive, nothing more)."""
    hidden, experts, topk = 128, 8, 2
    tokens = [7, 10]
    routing = [workload(tokens, hidden, experts, topk, drop=0.1) for _ in range(XTUNER_LAYERS)]
    rng = np.random.default_rng(23)
    grad_out = [ref.random_x(rng, t, hidden, BF16) for t in tokens]

    def rank(r, group):
        m = XtunerDeepEP(group)
        try:
            h = tt(routing[0][0][r]).requires_grad_(True)
            inputs, outs = [], []
            for _, idx, w in routing:
                h.retain_grad()
                inputs.append(h)
                recv_x, _, recv_w, tpe, handle, _ = m.Dispatch.apply(
                    h, tt(idx[r]), tt(w[r]), experts, group)
                y = recv_x * 2.0  # the experts (exact in bf16), differentiable
                h, _ = m.Combine.apply(y, experts, handle, group)
                outs.append((nd(recv_x), nd(recv_w), list(tpe), nd(h)))
            h.backward(tt(grad_out[r]))
            grads = [nd(t.grad) for t in inputs]
            del h, recv_x, recv_w, handle, y, inputs
            for _ in range(100):  # (gc.collect() returns at once while another rank's thread
                gc.collect()  # collects: the cycles may be freed a moment later)
                held = [g.release_handles() for g in m.buffer._groups.values()]
                if not any(held):
                    break
                time.sleep(0.02)
            return outs, grads, held
        finally:
            m.buffer.destroy()

    res = run_ranks(rank)
    xs, disps = routing[0][0], []
    for layer, (_, idx, w) in enumerate(routing):  # the forward, layer by layer
        disp = ref.dispatch(xs, idx, w, experts)
        comb = ref.combine([times(d.recv_x, 2.0) for d in disp], disp, tokens)
        for r in range(NUM_RANKS):
            recv_x, recv_w, tpe, combined = res[r][0][layer]
            tag = f"{XTUNER} layer {layer} rank {r}"
            exact(recv_x, disp[r].recv_x, f"{tag} recv_x")
            exact(recv_w, disp[r].recv_topk_weights, f"{tag} recv_topk_weights")
            assert tpe == disp[r].num_recv_tokens_per_expert, tag
            exact(combined, comb[r][0], f"{tag} combined")
        disps.append(disp)
        xs = [c[0] for c in comb]
    g = grad_out
    for layer in reversed(range(XTUNER_LAYERS)):  # the backward: combine's is a cached
        # dispatch of the gradient, the experts' a factor 2, dispatch's a combine (with the
        # gradient of the received weights, zeros: nothing used them)
        _, idx, w = routing[layer]
        gdisp = ref.dispatch(g, idx, w, experts)
        zeros = [np.zeros_like(d.recv_topk_weights) for d in disps[layer]]
        g = [c[0] for c in ref.combine([times(d.recv_x, 2.0) for d in gdisp], disps[layer],
                                       tokens, recv_topk_weights=zeros)]
        for r in range(NUM_RANKS):
            exact(res[r][1][layer], g[r], f"{XTUNER} layer {layer} rank {r} input gradient")
    for r in range(NUM_RANKS):
        assert res[r][2] and res[r][2] == [0] * len(res[r][2]), (r, res[r][2])


def test_handles_unpacked_and_passed_back_as_tuples(env) -> None:
    """DeepEP's handles are tuples, so a caller may unpack one and pass the parts back:
    `tuple(handle)` to combine and to a cached dispatch (normal mode), and to
    low_latency_combine. Unpacked, the positions EPD does not produce are None; indexed, they
    still raise Unsupported naming them. A tuple whose parts are not a handle's is refused."""
    hidden, experts, topk = 128, 8, 2
    tokens = [6, 9]
    xs, idx, w = workload(tokens, hidden, experts, topk)
    lxs, lidx, lw = ll_workload(tokens, LL_HIDDEN, experts, topk)

    def rank(r, group):
        buf = deep_ep.Buffer(group, int(1e9), 0)
        lbuf = _vllm_ll_buffer(group, 16, LL_HIDDEN, experts)
        try:
            n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(tt(idx[r]), experts)
            recv_x, _, _, _, handle, _ = buf.dispatch(
                tt(xs[r]), topk_idx=tt(idx[r]), topk_weights=tt(w[r]),
                num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=n_exp)
            parts = tuple(handle)
            assert [p is None for p in parts] == [False, True, True, False, False, True]
            with pytest.raises(deep_ep.Unsupported, match="channel_prefix_matrix"):
                handle[1]
            combined, _, _ = buf.combine(recv_x, list(parts))
            cached = buf.dispatch(tt(xs[r]), handle=parts)[0]
            with pytest.raises(deep_ep.InvalidArgument, match="tuple"):
                buf.combine(recv_x, (parts[0].clone(), *parts[1:]))
            recv, _, lhandle, _, _ = lbuf.low_latency_dispatch(
                tt(lxs[r]), tt(lidx[r]), 16, experts, use_fp8=False)
            lcombined, _, _ = lbuf.low_latency_combine(recv, tt(lidx[r]), tt(lw[r]),
                                                       tuple(lhandle))
            lwant, _, _ = lbuf.low_latency_combine(recv, tt(lidx[r]), tt(lw[r]), lhandle)
            return nd(combined), nd(cached), nd(recv_x), nd(lcombined), nd(lwant)
        finally:
            buf.destroy()
            lbuf.destroy()

    res = run_ranks(rank)
    disp = ref.dispatch(xs, idx, w, experts)
    comb = ref.combine([d.recv_x for d in disp], disp, tokens)
    for r in range(NUM_RANKS):
        combined, cached, recv_x, lcombined, lwant = res[r]
        exact(combined, comb[r][0], f"rank {r} combine of tuple(handle)")
        exact(cached, recv_x, f"rank {r} cached dispatch of tuple(handle)")
        exact(lcombined, lwant, f"rank {r} low_latency_combine of tuple(handle)")
