"""DeepEP V2's `ElasticBuffer` on the CUDA engine: the checks of tests/test_elastic_buffer.py
(DeepEP's V2 test_ep replayed: dispatch, expanded, cached and cached expanded dispatch,
combine and expanded combine, exact) with CUDA tensors, each rank its own process, one
buffer for every case. Also: a dispatch without the CPU sync makes no torch synchronisation
(the handle's layout is computed on the device), checked by torch's CUDA sync debug mode (the
V1 path's wait for the receive count, a spin on mapped memory, is not a torch call)."""

from __future__ import annotations

import os
import sys

import pytest

from .test_daemon import _spawn_ranks

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # (tests/: the CPU module)
pytestmark = pytest.mark.gpu
# Every combination of alignment, FP8, biases, event, async and CPU sync would take minutes
# of host work per rank here; these cover each value of each once with the others varied.
GPU_COMBOS = [(8, True, 2, True, True, False), (1, False, 0, False, False, True),
              (8, False, 1, True, False, True), (1, True, 1, False, True, False),
              (8, True, 0, False, False, True), (1, False, 2, True, True, False)]


def _elastic_rank(rank: int, socket: str, device: int, q) -> None:
    import test_elastic_buffer as T
    import torch

    from epd.client import Session
    from epd.client.elastic_buffer import ElasticBuffer
    torch.cuda.set_device(device)
    all_inputs = [T._inputs(r, seed=3) for r in range(T.NUM_RANKS)]
    with Session(socket, client_name=f"elastic-{rank}", timeout=60) as s:
        buf = ElasticBuffer(num_max_tokens_per_rank=T.MAX_TOKENS, hidden=T.HIDDEN,
                            num_topk=T.TOPK, explicitly_destroy=True, rank=rank,
                            num_ranks=T.NUM_RANKS, session=s, group_name="gpu-elastic")
        try:
            cases = T.run_cases(buf, rank, all_inputs, f"cuda:{device}", GPU_COMBOS)
            # No host synchronisation in a dispatch without the CPU sync (after a first
            # call of the shape: groups and ops are set up by then).
            inp = all_inputs[rank]
            x, idx = inp["x"].cuda(), inp["topk_idx"].cuda()
            w = inp["topk_weights"].cuda()
            kw = dict(topk_idx=idx, topk_weights=w, num_experts=T.EXPERTS,
                      num_max_tokens_per_rank=T.MAX_TOKENS, do_cpu_sync=False)
            buf.dispatch(x, **kw)
            buf.dispatch(x, do_expand=True, **kw)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                _, _, _, h, _ = buf.dispatch(x, **kw)
                buf.dispatch(x, do_expand=True, **kw)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            q.put({"rank": rank, "cases": cases,
                   "received": int(h.psum_num_recv_tokens_per_scaleup_rank[-1])})
        finally:
            buf.destroy()


def test_elastic_buffer_on_the_cuda_engine(daemon) -> None:
    import test_elastic_buffer as T
    results = _spawn_ranks(daemon, _elastic_rank, T.NUM_RANKS)
    assert [r["cases"] for r in results] == [len(GPU_COMBOS)] * T.NUM_RANKS
    inputs = [T._inputs(r, seed=3) for r in range(T.NUM_RANKS)]
    for r, res in enumerate(results):
        assert res["received"] == T._reference(inputs, r)["x"].shape[0]


def _v1_outputs(torch, rng, ranks: int, local: int, topk: int, tokens: int, max_tokens: int,
                me: int, worst: bool):
    """A V1 dispatch's outputs as rank `me` would hold them (for the handle's layout): every
    rank's routing drawn at random (-1 slots included), the rows received at `me` ordered by
    source then token, padding rows (-1 ids) to the worst case when `worst`."""
    experts = ranks * local
    idx = []
    for _ in range(ranks):
        ids = torch.from_numpy(rng.integers(0, experts, (tokens, topk))).to(torch.int64)
        ids[torch.from_numpy(rng.random((tokens, topk)) < 0.2)] = -1
        idx.append(ids)
    counts = torch.zeros((ranks, ranks), dtype=torch.int64)
    src_idx, recv = [], []
    for s, ids in enumerate(idx):
        dest = torch.where(ids >= 0, ids // local, torch.full_like(ids, -1))
        for d in range(ranks):
            counts[s, d] = int((dest == d).any(dim=1).sum())
        mine = (dest == me).any(dim=1).nonzero().flatten()
        src_idx.append(mine.to(torch.int32))
        part = ids[mine]
        recv.append(torch.where(part // local == me, part - me * local, torch.full_like(part, -1)))
    recv_idx, recv_src = torch.cat(recv), torch.cat(src_idx)
    if worst:
        pad = ranks * max_tokens - recv_idx.shape[0]
        recv_idx = torch.cat([recv_idx, torch.full((pad, topk), -1, dtype=torch.int64)])
        recv_src = torch.cat([recv_src, torch.full((pad,), -1, dtype=torch.int32)])
    prefix = torch.cumsum(counts, 0).to(torch.int32)
    in_rank = torch.stack([((idx[me] >= 0) & (idx[me] // local == d)).any(dim=1)
                           for d in range(ranks)], dim=1)
    return prefix, recv_src, recv_idx, idx[me], in_rank


SHAPES = [  # ranks, local experts, top-k, tokens (max_tokens), alignment, expand, worst
    (2, 4, 3, 40, 1, False, False), (2, 4, 3, 40, 8, True, True), (4, 32, 8, 128, 1, True, False),
    (8, 32, 8, 1025, 128, False, True), (8, 32, 8, 1025, 128, True, True),
    (16, 2, 1, 7, 1, False, True), (2, 128, 8, 3000, 64, True, False), (3, 5, 2, 0, 1, False, True)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_handle_layout_kernel_matches_the_torch_operations(shape) -> None:
    """client/elastic_layout.py: the kernel's tensors equal the torch path's exactly (the
    torch path is the one checked against DeepEP's reference on the CPU), on fresh random
    routings, its output allocation poisoned first (a word it failed to write would show)."""
    import numpy as np
    import torch

    from epd.client import elastic_layout as EL
    ranks, local, topk, tokens, align, expand, worst = shape
    rng = np.random.default_rng([*shape[:4], align])
    for me in sorted({0, ranks - 1, ranks // 2}):
        prefix, src, ridx, tidx, in_rank = _v1_outputs(torch, rng, ranks, local, topk, tokens,
                                                       max(tokens, 1), me, worst)
        args = (prefix, src, ridx, tidx, in_rank, me, ranks, ranks * local, align,
                max(tokens, 1), expand)
        want = EL.compute(torch, *args)
        on_gpu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
        n = ranks + 2 * local + (ridx.shape[0] * (2 + topk) + tidx.shape[0] * topk) * 3 - \
            ridx.shape[0] * 2 * 2  # (int32 words: the int64 copies of both id tensors too)
        poison = torch.full((n,), 0x7F7F7F7F, dtype=torch.int32, device="cuda")
        del poison  # (the caching allocator hands this block to the kernel's outputs)
        got = EL.compute(torch, *on_gpu)
        torch.cuda.synchronize()
        for name, w, g in zip(EL.HandleLayout._fields, want, got, strict=True):
            assert g.is_cuda and g.dtype == w.dtype and g.shape == w.shape, name
            assert torch.equal(g.cpu(), w), (name, me)


@pytest.mark.parametrize(("shape", "hidden", "fp8"), [
    (SHAPES[1], 256, False), (SHAPES[2], 7168, True), (SHAPES[4], 130, False),
    (SHAPES[6], 512, True), (SHAPES[7], 256, False)])
def test_the_expanded_layout_kernels_match_the_torch_operations(shape, hidden, fp8) -> None:
    """client/elastic_expand.py: spread (received rows to expanded rows, weights to [n]) and
    fold (expanded rows summed per token in float32, rounded once; weights back to [rows, K])
    by the kernels equal the torch index copies exactly, on random bf16 values (rounding
    included), FP8 pairs and rows that are not 16-byte multiples; fold's outputs poisoned."""
    import numpy as np
    import torch

    from epd.client import elastic_expand as EX
    from epd.client import elastic_layout as EL
    ranks, local, topk, tokens, align, _, worst = shape
    rng = np.random.default_rng([*shape[:4], hidden])
    prefix, src, ridx, tidx, in_rank = _v1_outputs(torch, rng, ranks, local, topk, tokens,
                                                   max(tokens, 1), 0, worst)
    lay = EL.compute(torch, prefix, src, ridx, tidx, in_rank, 0, ranks, ranks * local, align,
                     max(tokens, 1), True)
    meta = lay.meta
    rows = meta.shape[0]
    n = int(lay.psum_experts[-1]) if local else 0  # (the last expert's end: every slot below)
    n = max(n, int(meta[:, 2:].max()) + 1 if rows else 0)
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    x = torch.randn((rows, hidden), generator=g).to(torch.bfloat16)
    if fp8:
        x = (torch.randn((rows, hidden), generator=g).to(torch.float8_e4m3fn),
             torch.rand((rows, hidden // 128), generator=g))
    w = torch.rand((rows, topk), generator=g)

    def cuda(a):
        return tuple(cuda(b) for b in a) if isinstance(a, tuple) else a.cuda()
    want_x, want_w = EX.spread(torch, meta, n, x, w)
    got_x, got_w = EX.spread(torch, meta.cuda(), n, cuda(x), w.cuda())
    for a, b in zip(want_x if fp8 else (want_x,), got_x if fp8 else (got_x,), strict=True):
        assert b.is_cuda and torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))
    assert torch.equal(want_w, got_w.cpu())

    y = torch.randn((n + 3, hidden), generator=g).to(torch.bfloat16)  # (more rows: allowed)
    yw = torch.rand(n + 3, generator=g)
    want_y, want_yw = EX.fold(torch, meta, n, y, yw)
    on_gpu = (meta.cuda(), n, y.cuda(), yw.cuda())
    poison = torch.full((rows * hidden + rows * topk + 64,), -7.0, device="cuda")
    del poison  # (the caching allocator hands this block to fold's outputs)
    got_y, got_yw = EX.fold(torch, *on_gpu)
    torch.cuda.synchronize()
    assert got_y.is_cuda and torch.equal(want_y.view(torch.int16), got_y.cpu().view(torch.int16))
    assert torch.equal(want_yw, got_yw.cpu())


@pytest.mark.parametrize(("rows", "topk"), [(0, 8), (1, 1), (256, 8), (4099, 3)])
def test_the_combine_weights_mask_kernel_matches_torch(rows, topk) -> None:
    """client/elastic_expand.py `local_weights`: the kernel's masked weights equal torch's
    masked_fill (its output poisoned first)."""
    import torch

    from epd.client import elastic_expand as EX
    g = torch.Generator().manual_seed(rows * 10 + topk)
    ids = torch.randint(-1, 4, (rows, topk), generator=g)
    w = torch.rand((rows, topk), generator=g)
    want = EX.local_weights(torch, ids, w)
    on_gpu = (ids.cuda(), w.cuda())
    poison = torch.full((max(rows * topk, 1),), -7.0, device="cuda")
    del poison
    got = EX.local_weights(torch, *on_gpu)
    torch.cuda.synchronize()
    assert got.is_cuda and torch.equal(got.cpu(), want)


def test_the_expanded_kernels_drop_slots_past_the_rows() -> None:
    """A slot at or past the expanded rows (duplicate ids overflowing the worst case) is
    dropped by the kernels as by the torch path (tests/test_elastic_buffer.py has the values),
    not written or read past the tensors."""
    import torch

    from epd.client import elastic_expand as EX
    meta = torch.tensor([[0, 1, 0, 1], [1, 1, 2, 5], [-1, -1, -1, -1]], dtype=torch.int32)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]).repeat(1, 64).to(torch.bfloat16)
    w = torch.tensor([[0.5, 0.25], [0.125, 2.0], [0.0, 0.0]])
    want = EX.spread(torch, meta, 3, x, w)
    got = EX.spread(torch, meta.cuda(), 3, x.cuda(), w.cuda())
    assert all(torch.equal(a, b.cpu()) for a, b in zip(want, got, strict=True))
    y = torch.arange(8.0).view(4, 2).repeat(1, 64).to(torch.bfloat16)
    yw = torch.tensor([0.5, 0.25, 0.125, 9.0])
    want = EX.fold(torch, meta, 3, y, yw)
    got = EX.fold(torch, meta.cuda(), 3, y.cuda(), yw.cuda())
    assert all(torch.equal(a, b.cpu()) for a, b in zip(want, got, strict=True))
