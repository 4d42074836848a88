"""DeepEP V2's `ElasticBuffer` through EPD's facade on the CPU backend: the checks of DeepEP's
own V2 test replayed (deepseek-ai/DeepEP@dd758ca, tests/elastic/test_ep.py,
`test_dispatch_combine`), against a reference written here from DeepEP's reference semantics
(deep_ep/utils/refs.py: rows ordered by global source index, top-k ids made local with -1
for other ranks' experts, combine = the ranks' sums plus the biases).

One buffer for every case; per case: dispatch, expanded dispatch, cached dispatch, cached
expanded dispatch with zero padding, combine and expanded combine, with and without a
captured previous event, async and not, bf16 and FP8, 0/1/2 biases, expert alignment 1 and
8, masked top-k slots (-1), with and without the CPU sync. Data are small integers in bf16
(and FP8 rows of exact values), so every sum is exact in any order and every output is
compared exactly.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from deepep_replay import run_ranks, use_daemon  # noqa: E402

from epd.client import elastic_buffer as deep_ep  # noqa: E402  (deep_ep.ElasticBuffer)
from epd.client.deep_ep_compat import Unsupported  # noqa: E402
from epd.proto.errors import InvalidArgument  # noqa: E402

pytestmark = pytest.mark.slow
NUM_RANKS, MAX_TOKENS, HIDDEN, EXPERTS, TOPK = 2, 40, 256, 8, 3
LOCAL = EXPERTS // NUM_RANKS


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _inputs(rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    tokens = MAX_TOKENS - 3 * rank  # (ranks hold different counts, as DeepEP's test does)
    scores = torch.rand((tokens, EXPERTS), generator=g)
    topk_weights, topk_idx = torch.topk(scores, TOPK, dim=-1, sorted=False)
    topk_idx = topk_idx.to(torch.int64)
    masked = torch.rand(topk_idx.shape, generator=g) < 0.2
    topk_idx[masked] = -1
    topk_weights[masked] = 0
    x = torch.randint(-8, 9, (tokens, HIDDEN), generator=g).to(torch.bfloat16)
    bias = [torch.randint(-4, 5, (tokens, HIDDEN), generator=g).to(torch.bfloat16)
            for _ in range(2)]
    return {"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights, "bias": bias}


def _to_fp8(x):
    """Exact e4m3 rows (small integers) with power-of-two scales per 128 channels."""
    scales = torch.ones((x.shape[0], x.shape[1] // 128), dtype=torch.float32) * 2.0
    return (x.float() / 2.0).to(torch.float8_e4m3fn), scales


def _reference(all_inputs: list[dict], rank: int) -> dict:
    """What rank `rank` receives (DeepEP's refs.dispatch): rows ordered by global source
    index, top-k ids local (-1 for other ranks' experts), weights as sent."""
    lo, hi = rank * LOCAL, (rank + 1) * LOCAL
    rows, idx, w, src = [], [], [], []
    for s, inp in enumerate(all_inputs):
        mine = ((inp["topk_idx"] >= lo) & (inp["topk_idx"] < hi)).any(dim=1)
        for t in mine.nonzero().flatten().tolist():
            rows.append(inp["x"][t])
            ids = inp["topk_idx"][t]
            idx.append(torch.where((ids >= lo) & (ids < hi), ids - lo, torch.full_like(ids, -1)))
            w.append(inp["topk_weights"][t])
            src.append(s * MAX_TOKENS + t)
    return {"x": torch.stack(rows), "idx": torch.stack(idx), "w": torch.stack(w),
            "src": torch.tensor(src, dtype=torch.int32),
            "per_rank": [int(((i["topk_idx"] >= lo) & (i["topk_idx"] < hi)).any(dim=1).sum())
                         for i in all_inputs]}


def _expert_outputs(src: torch.Tensor) -> torch.Tensor:
    """[rows, TOPK, HIDDEN] small-integer expert outputs of a row's global source index."""
    k = torch.arange(TOPK).view(1, TOPK, 1)
    h = torch.arange(HIDDEN).view(1, 1, HIDDEN)
    return ((src.view(-1, 1, 1).long() * 7 + k * 3 + h) % 9 - 4).to(torch.bfloat16)


COMBOS = list(itertools.product((8, 1), (True, False), (0, 1, 2), (False, True), (False, True),
                                (True, False)))  # alignment, fp8, biases, event, async, sync


def _on(a, device: str):
    """`a` (a tensor, a tuple of them, or None) on `device`."""
    if isinstance(a, tuple):
        return tuple(_on(t, device) for t in a)
    return a.to(device) if a is not None else None


class _HostView:
    """A handle's tensors on the host, for the checks (the handle itself stays for the calls)."""

    def __init__(self, h) -> None:
        for name in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                     "num_unaligned_recv_tokens_per_expert", "recv_src_metadata",
                     "dst_buffer_slot_idx"):
            setattr(self, name, _on(getattr(h, name), "cpu"))
        for name in ("num_recv_tokens", "num_expanded_tokens",
                     "num_recv_tokens_per_expert_list"):
            setattr(self, name, getattr(h, name))


def _rank(rank: int, group, all_inputs: list[dict]) -> int:
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                                   num_topk=TOPK, explicitly_destroy=True)
    try:
        assert buffer.get_logical_domain_size() == (1, NUM_RANKS)
        assert buffer.num_bytes % deep_ep.BUFFER_ALIGNMENT == 0
        cases = run_cases(buffer, rank, all_inputs, "cpu", COMBOS)
        buffer.barrier()
    finally:
        buffer.destroy()
    return cases


def run_cases(buffer, rank: int, all_inputs: list[dict], device: str, combos) -> int:
    """DeepEP V2's test_ep checks for each combination, the calls on `device` (the CPU here,
    a GPU in tests/gpu/test_elastic_buffer_gpu.py), the checks on the host."""
    cases = 0
    inp = all_inputs[rank]
    ref = _reference(all_inputs, rank)
    n = ref["x"].shape[0]
    idx_d, w_d = _on(inp["topk_idx"], device), _on(inp["topk_weights"], device)
    cpu = lambda a: _on(a, "cpu")  # noqa: E731
    for (alignment, fp8, num_bias, prev, async_, cpu_sync) in combos:
        cases += 1
        x = _on(_to_fp8(inp["x"]) if fp8 else inp["x"], device)
        bias = _on((None, inp["bias"][0], tuple(inp["bias"]))[num_bias], device)

        def launch(name, prev=prev, async_=async_, **kw):
            if prev:  # (V2's capture(): an EventHandle)
                kw.update(previous_event=buffer.capture(), allocate_on_comm_stream=True)
            else:  # (V2 takes allocate_on_comm_stream without previous_event, V1 does not)
                kw.update(allocate_on_comm_stream=async_)
            out = getattr(buffer, name)(async_with_compute_stream=async_, **kw)
            if async_:
                out[-1].current_stream_wait()
            return out

        common = dict(num_max_tokens_per_rank=MAX_TOKENS, num_experts=EXPERTS,
                      expert_alignment=alignment, do_cpu_sync=cpu_sync)
        recv_x, recv_idx, recv_w, handle_d, _ = launch(
            "dispatch", x=x, topk_idx=idx_d, topk_weights=w_d, **common)
        ex_x, ex_idx, ex_w, ex_handle_d, _ = launch(
            "dispatch", x=x, topk_idx=idx_d, topk_weights=w_d,
            do_expand=True, use_tma_aligned_col_major_sf=True, **common)
        c_x, c_idx, c_w, c_handle, _ = launch("dispatch", x=x, handle=handle_d)
        ce_x, _, ce_w, _, _ = launch("dispatch", x=x, handle=ex_handle_d,
                                     topk_weights=w_d, do_expand=True,
                                     use_tma_aligned_col_major_sf=True,
                                     do_zero_padding=True)
        assert c_handle is handle_d and c_w is None
        ce2_x, _, ce2_w, _, _ = launch("dispatch", x=x, handle=ex_handle_d, do_expand=True)
        assert ce2_w is None
        if cases == 1:  # the cumulative per-expert counts (added to, on the call's stream)
            stats = torch.full((LOCAL,), 5, dtype=torch.int32, device=device)
            launch("dispatch", x=x, topk_idx=idx_d, topk_weights=w_d,
                   cumulative_local_expert_recv_stats=stats, **common)
            assert stats.tolist() == [5 + int((ref["idx"] == e).sum()) for e in range(LOCAL)]
        ex_scales_stride = ex_x[1].stride() if fp8 else None
        recv_idx_d = recv_idx
        recv_x, recv_idx, recv_w, ex_x, ex_w, c_x, c_idx, ce_x, ce_w, ce2_x = map(
            cpu, (recv_x, recv_idx, recv_w, ex_x, ex_w, c_x, c_idx, ce_x, ce_w, ce2_x))
        recv_idx = recv_idx.clone()  # (the device tensor is overwritten below)
        handle, ex_handle = _HostView(handle_d), _HostView(ex_handle_d)

        # Counts, prefix sums and the handle's metadata.
        rows = n if cpu_sync else NUM_RANKS * MAX_TOKENS
        got_x = recv_x[0] if fp8 else recv_x
        assert got_x.shape == (rows, HIDDEN)
        assert handle.num_recv_tokens == rows
        psum = handle.psum_num_recv_tokens_per_scaleup_rank.tolist()
        assert psum == np.cumsum(ref["per_rank"]).tolist()
        assert ex_handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == psum
        assert torch.equal(handle.recv_src_metadata[:n, 0], ref["src"])
        assert (handle.recv_src_metadata[n:, :2] == -1).all()
        src_rank = ref["src"] // MAX_TOKENS
        last = TOPK - 1 - (ref["idx"] >= 0).flip(1).int().argmax(dim=1)  # DeepEP's master lane
        assert torch.equal(handle.recv_src_metadata[:n, 1], (src_rank * TOPK + last).int())
        counts = [int((ref["idx"] == e).sum()) for e in range(LOCAL)]
        aligned = [_align(c, alignment) for c in counts]
        assert handle.psum_num_recv_tokens_per_expert.tolist() == np.cumsum(aligned).tolist()
        assert handle.num_recv_tokens_per_expert_list == (aligned if cpu_sync else [])
        starts = np.cumsum([0, *aligned])[:-1]
        assert ex_handle.psum_num_recv_tokens_per_expert.tolist() == \
            (starts + np.array(counts)).tolist()
        assert ex_handle.num_unaligned_recv_tokens_per_expert.tolist() == counts
        assert handle.num_unaligned_recv_tokens_per_expert.tolist() == counts
        # dst_buffer_slot_idx: each slot's row at its destination, checked there below.
        assert handle.dst_buffer_slot_idx.shape == inp["topk_idx"].shape

        # Received rows, ids and weights exactly (the weights where the id is local).
        local = ref["idx"] >= 0
        if fp8:
            assert torch.equal(recv_x[0][:n].view(torch.uint8),
                               _to_fp8(ref["x"])[0].view(torch.uint8))
            assert torch.equal(recv_x[1][:n], _to_fp8(ref["x"])[1])
        else:
            assert torch.equal(recv_x[:n], ref["x"])
        assert torch.equal(recv_idx[:n], ref["idx"])
        assert (recv_idx[n:] == -1).all()
        assert torch.equal(recv_w[:n][local], ref["w"][local])
        # Cached: the same rows, the handle's ids, the same handle (checked above).
        assert torch.equal(c_idx, recv_idx)
        assert (c_x[0] if fp8 else c_x).shape[0] == rows  # (the handle's rows, as DeepEP)
        if fp8:  # (rows past n: the worst case's padding, unspecified)
            assert torch.equal(c_x[0][:n].view(torch.uint8), recv_x[0][:n].view(torch.uint8))
            assert torch.equal(c_x[1][:n], recv_x[1][:n])
        else:
            assert torch.equal(c_x[:n], recv_x[:n])

        # The expanded layout: each local slot's row at its slot, grouped by expert in
        # source order, padding zero.
        assert ex_idx is None
        slots = ex_handle.recv_src_metadata[:n, 2:].long()
        assert torch.equal(slots >= 0, local)
        ex0 = ex_x[0] if fp8 else ex_x
        expect_rows = sum(aligned) if cpu_sync else _align(
            NUM_RANKS * MAX_TOKENS * min(TOPK, LOCAL) + (alignment - 1) * LOCAL, alignment)
        assert ex0.shape[0] == expect_rows == ex_handle.num_expanded_tokens
        for e in range(LOCAL):
            r, k = (ref["idx"] == e).nonzero(as_tuple=True)
            assert slots[r, k].tolist() == list(range(int(starts[e]),
                                                      int(starts[e]) + counts[e]))
            for out, w in ((ex_x, ex_w), (ce_x, ce_w), (ce2_x, None)):
                o = out[0].float() * out[1][:, :1] if fp8 else out
                assert torch.equal(o[slots[r, k]].float(), ref["x"][r].float())
                if w is not None:
                    assert torch.equal(w[slots[r, k]], ref["w"][r, k])
            pad = slice(int(starts[e]) + counts[e], int(starts[e]) + aligned[e])
            assert (ce_x[0] if fp8 else ce_x)[pad].float().abs().sum() == 0
            assert ce_w[pad].abs().sum() == 0
        if fp8:  # DeepEP's TMA-aligned column-major scales
            assert ex_scales_stride == (1, _align(ex_x[1].shape[0], 4))

        # Combine: the expert outputs summed per row here (non-expanded) or per slot
        # (expanded), then over the ranks, plus the biases; the weights come back.
        y = _expert_outputs(ref["src"])
        y[~local] = 0
        per_row = y.float().sum(dim=1).to(torch.bfloat16)
        comb_in = torch.zeros((rows, HIDDEN), dtype=torch.bfloat16)
        comb_in[:n] = per_row
        ex_in = torch.zeros((ex0.shape[0], HIDDEN), dtype=torch.bfloat16)
        ex_in[slots[local]] = y[local]
        # (DeepEP V2 returns every slot's weight, other ranks' experts' too, so a caller's
        # weights there are not zero: only the local slots' count)
        noisy_w = torch.where(recv_idx >= 0, recv_w, torch.full_like(recv_w, 99.0))
        recv_idx_d.fill_(-1)  # (a caller's write to its outputs does not reach the handle)
        cx, cw, _ = launch("combine", x=_on(comb_in, device), handle=handle_d,
                           topk_weights=_on(noisy_w, device), bias=bias)
        rx, rw, _ = launch("combine", x=_on(ex_in, device), handle=ex_handle_d,
                           topk_weights=_on(ex_w, device), bias=bias)
        result = {"combined": cpu(cx), "weights": cpu(cw), "reduced": cpu(rx),
                  "reduced_weights": cpu(rw), "dst_slot": handle.dst_buffer_slot_idx,
                  "src": ref["src"]}
        _check_combine(rank, all_inputs, result, cpu(bias))
    return cases


def _check_combine(rank: int, all_inputs: list[dict], got: dict, bias) -> None:
    inp = all_inputs[rank]
    tokens = inp["x"].shape[0]
    src = rank * MAX_TOKENS + torch.arange(tokens)
    y = _expert_outputs(src)  # this rank's tokens' expert outputs, by global source index
    y[inp["topk_idx"] < 0] = 0
    expect = y.float().sum(dim=1)
    if isinstance(bias, tuple):
        expect += bias[0].float() + bias[1].float()
    elif bias is not None:
        expect += bias.float()
    expect = expect.to(torch.bfloat16)
    sent = (inp["topk_idx"] >= 0).any(dim=1)
    for key in ("combined", "reduced"):
        assert torch.equal(got[key][sent], expect[sent]), key
    for key in ("weights", "reduced_weights"):
        assert torch.equal(got[key], inp["topk_weights"]), key
    # dst_buffer_slot_idx (DeepEP's encoding): on the last slot of each destination rank,
    # rank * MAX_TOKENS + the token's place among those this rank sends there.
    slot = got["dst_slot"]
    refs = [_reference(all_inputs, d) for d in range(NUM_RANKS)]
    for t in range(tokens):
        dests = [int(e) // LOCAL if e >= 0 else -1 for e in inp["topk_idx"][t]]
        for k, dest in enumerate(dests):
            if dest < 0 or dest in dests[k + 1:]:
                assert slot[t, k] == -1
                continue
            place = int(slot[t, k]) - rank * MAX_TOKENS
            row = sum(refs[dest]["per_rank"][:rank]) + place
            assert int(refs[dest]["src"][row]) == rank * MAX_TOKENS + t


def test_deepep_v2_test_ep_checks_on_the_facade(daemon, monkeypatch) -> None:
    use_daemon(daemon, monkeypatch)
    all_inputs = [_inputs(r, seed=1) for r in range(NUM_RANKS)]
    results = run_ranks(lambda r, g: _rank(r, g, all_inputs), NUM_RANKS, timeout=600)
    assert results == [96] * NUM_RANKS


def _bad_calls(rank: int, group) -> None:
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                                   explicitly_destroy=True)
    try:
        inp = _inputs(rank, seed=2)
        with pytest.raises(Unsupported, match="Engram"):
            buffer.engram_fetch(torch.zeros(1))
        with pytest.raises(InvalidArgument, match="num_max_tokens_per_rank"):
            buffer.dispatch(inp["x"], topk_idx=inp["topk_idx"], num_experts=EXPERTS,
                            num_max_tokens_per_rank=4)
        with pytest.raises(InvalidArgument, match="multiple of"):
            buffer.dispatch(inp["x"], topk_idx=inp["topk_idx"], num_experts=EXPERTS - 1)
        # (both ranks make the same good call after the refusals: nothing changed)
        _, _, _, h, _ = buffer.dispatch(inp["x"], topk_idx=inp["topk_idx"],
                                        topk_weights=inp["topk_weights"], num_experts=EXPERTS)
        _, _, no_w, _, _ = buffer.dispatch(inp["x"], topk_idx=inp["topk_idx"],
                                           num_experts=EXPERTS)  # (V2: weights optional)
        assert no_w is None
        with pytest.raises(Unsupported):
            buffer.get_agrs_buffer_size_hint(group, 1 << 20)
        with pytest.raises(InvalidArgument, match="takes no topk_idx"):
            buffer.dispatch(inp["x"], topk_idx=inp["topk_idx"], handle=h)
        with pytest.raises(InvalidArgument, match="do_expand"):
            buffer.dispatch(inp["x"], handle=h, do_expand=True)
        with pytest.raises(InvalidArgument, match="differ from the handle"):
            buffer.dispatch(inp["x"], handle=h, expert_alignment=4)
        recv, *_ = buffer.dispatch(inp["x"], handle=h)
        combined, _, _ = buffer.combine(recv, h)
        sent = (inp["topk_idx"] >= 0).any(dim=1)
        ranks_of = [len({int(e) // LOCAL for e in row if e >= 0}) for row in inp["topk_idx"]]
        expect = inp["x"].float() * torch.tensor(ranks_of).view(-1, 1)
        assert torch.equal(combined[sent].float(), expect[sent])
    finally:
        buffer.destroy()
    with pytest.raises(Exception, match="destroyed"):
        buffer.dispatch(inp["x"], topk_idx=inp["topk_idx"], num_experts=EXPERTS)


def test_elastic_buffer_refusals_change_nothing(daemon, monkeypatch) -> None:
    use_daemon(daemon, monkeypatch)
    run_ranks(_bad_calls, NUM_RANKS)


# -- vLLM's DeepEP V2 prepare/finalize, replayed ---------------------------------------------
# The call sequence of vLLM's `DeepEPV2PrepareAndFinalize` (fused_moe; read in public vLLM
# trees of 2026): prefill mode dispatches with do_expand=True, do_cpu_sync=True and builds
# each expanded row's global expert id with repeat_interleave over
# `handle.num_recv_tokens_per_expert_list`; decode mode dispatches with do_expand=False,
# do_cpu_sync=False and `num_max_tokens_per_rank` the next power of two of the batch, then
# rewrites `recv_topk_idx` in place to global ids (-1 past the received rows, read from
# `psum_num_recv_tokens_per_scaleup_rank[-1]` on the device). Both apply the router weights
# per row and combine with `topk_weights=None`. The experts here scale rows by 1 + expert id,
# weights are powers of two and data small integers: every product and sum is exact.


def _vllm_layer(buffer, rank: int, inp: dict, decode: bool) -> torch.Tensor:
    x, idx, w = inp["x"], inp["topk_idx"], inp["w2"]
    offset = rank * LOCAL
    if decode:
        num_max = 1 << max(x.shape[0] - 1, 0).bit_length()
        recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
            x=x, topk_idx=idx, topk_weights=w, num_experts=EXPERTS,
            num_max_tokens_per_rank=num_max, do_expand=False, do_cpu_sync=False,
            async_with_compute_stream=False)
        if event.event is not None:
            event.current_stream_wait()
        n = handle.psum_num_recv_tokens_per_scaleup_rank[-1]
        rows = torch.arange(recv_idx.shape[0]).unsqueeze(1)
        recv_idx.copy_(torch.where((recv_idx >= 0) & (rows < n), recv_idx + offset,
                                   torch.full_like(recv_idx, -1)))  # (in place, as vLLM)
        scale = torch.where(recv_idx >= 0, (1 + recv_idx).float() * recv_w, 0).sum(dim=1)
        out = (recv_x.float() * scale.unsqueeze(1)).to(torch.bfloat16)
    else:
        recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
            x=x, topk_idx=idx, topk_weights=w, num_experts=EXPERTS,
            num_max_tokens_per_rank=MAX_TOKENS, do_expand=True, do_cpu_sync=True,
            async_with_compute_stream=False)
        assert recv_idx is None
        counts = handle.num_recv_tokens_per_expert_list
        ids = torch.repeat_interleave(torch.arange(LOCAL) + offset, torch.tensor(counts),
                                      output_size=sum(counts))
        assert recv_x.shape[0] == sum(counts)
        out = (recv_x.float() * ((1 + ids).float() * recv_w).unsqueeze(1)).to(torch.bfloat16)
    combined, _, _ = buffer.combine(x=out, handle=handle, topk_weights=None,
                                    async_with_compute_stream=False)
    return combined


def _vllm_rank(rank: int, group, all_inputs: list[dict]) -> list[torch.Tensor]:
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                                   num_topk=TOPK, explicitly_destroy=True)
    try:
        return [_vllm_layer(buffer, rank, all_inputs[rank], decode)
                for decode in (False, True, False, True, True)]
    finally:
        buffer.destroy()


def test_vllm_deepep_v2_prepare_finalize_replay(daemon, monkeypatch) -> None:
    use_daemon(daemon, monkeypatch)
    all_inputs = [_inputs(r, seed=4) for r in range(NUM_RANKS)]
    g = torch.Generator().manual_seed(5)
    for inp in all_inputs:
        inp["w2"] = 2.0 ** -torch.randint(0, 3, inp["topk_idx"].shape, generator=g).float()
    results = run_ranks(lambda r, grp: _vllm_rank(r, grp, all_inputs), NUM_RANKS)
    for rank, layers in enumerate(results):
        inp = all_inputs[rank]
        idx, w = inp["topk_idx"], inp["w2"]
        per_slot = torch.where(idx >= 0, (1 + idx).float() * w, 0).sum(dim=1, keepdim=True)
        expect = (inp["x"].float() * per_slot).to(torch.bfloat16)
        sent = (idx >= 0).any(dim=1)
        for combined in layers:
            assert torch.equal(combined[sent], expect[sent])


def test_expanded_slots_past_the_worst_case_are_dropped_not_written() -> None:
    """Duplicate expert ids in a token's top-k (outside DeepEP's contract; V1's normal mode
    takes them) count one slot each, so a worst-case expanded layout (sized for distinct ids)
    can get slots at or past its row count: spread and fold drop those (the kernels would
    write and read past the tensors), as they drop slots that are not local."""
    from epd.client import elastic_expand as EX
    meta = torch.tensor([[0, 1, 0, 1], [1, 1, 2, 5], [-1, -1, -1, -1]], dtype=torch.int32)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]).to(torch.bfloat16)
    w = torch.tensor([[0.5, 0.25], [0.125, 2.0], [0.0, 0.0]])
    out, out_w = EX.spread(torch, meta, 3, x, w)  # (3 rows: slot 5 is past them)
    assert torch.equal(out.float(), torch.tensor([[1.0, 2.0], [1.0, 2.0], [3.0, 4.0]]))
    assert torch.equal(out_w, torch.tensor([0.5, 0.25, 0.125]))
    y = torch.tensor([[1.0, 1.0], [2.0, 2.0], [4.0, 4.0], [8.0, 8.0]]).to(torch.bfloat16)
    yw = torch.tensor([0.5, 0.25, 0.125, 9.0])
    folded, folded_w = EX.fold(torch, meta, 3, y, yw)
    assert torch.equal(folded.float(), torch.tensor([[3.0, 3.0], [4.0, 4.0], [0.0, 0.0]]))
    assert torch.equal(folded_w, torch.tensor([[0.5, 0.25], [0.125, 0.0], [0.0, 0.0]]))
