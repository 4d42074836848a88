"""DeepEP V1's own intranode test, its checks replayed through EPD's facade on the CPU backend.

Source read: deepseek-ai/DeepEP@567632d, tests/test_intranode.py, `test_main`'s correctness part
(the layout check and the dispatch/combine loop; the tuning loops measure kernels and are not
replayed) with `test_loop`'s Buffer construction. One Buffer; the layout checked against counts
computed from top-k; then, with and without a captured previous event, synchronous and
`async_finish`, for a random input, a constant-per-rank input and its FP8 form (scales passed
column-major, as that test passes them), with and without top-k: dispatch (counts, rows per
source by `handle[0]`, received top-k ids and weights), the worst-case form (padding), the
cached form, and combine (the sum over the ranks a token went to, within DeepEP's tolerance).
Small shapes for the CPU backend in CI; DeepEP's file itself runs on the GPU machine (issue 11).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from deepep_replay import dequant, diff, run_ranks, use_daemon  # noqa: E402

from epd.client import buffer as deep_ep  # noqa: E402  (what `import deep_ep` resolves to)
from epd.proto import dtypes  # noqa: E402
from epd.server import reference as ref  # noqa: E402

pytestmark = pytest.mark.slow
NUM_RANKS, TOKENS, HIDDEN, EXPERTS, TOPK = 2, 96, 256, 16, 4


def _to_fp8(x) -> tuple:
    """(e4m3 [T, H], float32 scales [T, H/128]) from bf16 rows: EPD's reference quantisation."""
    bits = x.view(torch.int16).numpy().view(dtypes.BFLOAT16)
    q, scales = ref.quantize_fp8(bits)
    fp8 = torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return fp8, torch.from_numpy(scales)


def _rank(rank: int, group) -> int:
    torch.manual_seed(rank)
    local = EXPERTS // NUM_RANKS
    buffer = deep_ep.Buffer(group, int(2e9), 0, low_latency_mode=False, num_qps_per_rank=1,
                            explicitly_destroy=True, allow_mnnvl=False, use_fabric=False)
    try:
        x = torch.ones((TOKENS, HIDDEN), dtype=torch.bfloat16) * rank
        x_rand = torch.randn((TOKENS, HIDDEN), dtype=torch.bfloat16)
        fp8, scales = _to_fp8(x)
        x_e4m3 = (fp8, scales.T.contiguous().T)  # column-major scales, as the test passes them
        scores = torch.randn((TOKENS, EXPERTS), dtype=torch.float32).abs() + 1
        topk_idx = torch.topk(scores, TOPK, dim=-1, largest=True, sorted=False)[1]
        topk_idx = topk_idx.to(deep_ep.topk_idx_t)
        topk_weights = torch.ones((TOKENS, TOPK), dtype=torch.float32) * rank
        topk_weights_rand = torch.randn((TOKENS, TOPK), dtype=torch.float32)
        dest = topk_idx // local
        is_token_in_rank = torch.zeros((TOKENS, NUM_RANKS), dtype=torch.bool)
        for r in range(NUM_RANKS):
            is_token_in_rank[:, r] = (dest == r).any(dim=1)
        num_tokens_per_rank = is_token_in_rank.sum(dim=0).to(torch.int)
        num_tokens_per_expert = torch.bincount(topk_idx.flatten(), minlength=EXPERTS).to(
            torch.int)
        gbl_per_expert = group.all_reduce(num_tokens_per_expert)
        gbl_per_rank = group.all_reduce(num_tokens_per_rank)

        got_rank, _, got_expert, got_in_rank, _ = buffer.get_dispatch_layout(topk_idx, EXPERTS)
        assert torch.equal(got_rank, num_tokens_per_rank)
        assert torch.equal(got_expert, num_tokens_per_expert)
        assert torch.equal(got_in_rank, is_token_in_rank)
        config = deep_ep.Config(24, 8, 256)

        def check_rows(rows, prefix) -> None:  # rows from source i all equal i, in source order
            assert torch.allclose(rows.amin(dim=1), rows.amax(dim=1))
            start = 0
            for i in range(NUM_RANKS):
                end = int(prefix[i][rank])
                assert (rows[start:end, :].int() - i).sum().item() == 0
                start = end

        runs = 0
        for previous in (False, True):
            for asynchronous in (False, True):
                for current in (x_rand, x, x_e4m3):
                    for with_topk in (False, True):
                        runs += 1
                        args = {"x": current, "num_tokens_per_rank": num_tokens_per_rank,
                                "is_token_in_rank": is_token_in_rank,
                                "num_tokens_per_expert": num_tokens_per_expert, "config": config,
                                "async_finish": asynchronous}
                        if with_topk:
                            args.update(topk_idx=topk_idx, topk_weights=topk_weights_rand
                                        if current is x_rand else topk_weights)
                        if previous:
                            args["previous_event"] = buffer.capture()
                        recv_x, recv_idx, recv_w, recv_counts, handle, event = \
                            buffer.dispatch(**args)
                        if asynchronous:
                            event.current_stream_wait()
                        recv_x = dequant(*recv_x) if isinstance(recv_x, tuple) else recv_x
                        prefix = handle[0]
                        assert int(gbl_per_rank[rank]) == recv_x.size(0)
                        assert gbl_per_expert.view(NUM_RANKS, -1)[rank].tolist() == recv_counts
                        if current is not x_rand:
                            check_rows(recv_x, prefix)
                        w_clone = None
                        if with_topk:
                            assert (recv_idx.eq(-1) | ((recv_idx >= 0) & (recv_idx < local))
                                    ).sum().item() == recv_idx.numel()
                            for i, count in enumerate(recv_counts):
                                assert recv_idx.eq(i).sum().item() == count
                            w_clone = recv_w.clone()
                            if current is not x_rand:  # in place, as the test does: combine
                                # then sums full rows of each source's weight
                                fill = recv_w.amax(dim=1, keepdim=True).expand_as(recv_w)
                                recv_w[recv_idx.eq(-1)] = fill[recv_idx.eq(-1)]
                                check_rows(recv_w, prefix)
                            worst = NUM_RANKS * TOKENS
                            wx, widx, ww, empty, _, event = buffer.dispatch(
                                **args, num_worst_tokens=worst)
                            if asynchronous:
                                event.current_stream_wait()
                            wx = dequant(*wx) if isinstance(wx, tuple) else wx
                            n = recv_x.size(0)
                            assert len(empty) == 0 and wx.size(0) == worst == widx.size(0) \
                                == ww.size(0)
                            assert torch.equal(recv_x, wx[:n]) and torch.equal(recv_idx, widx[:n])
                            assert torch.equal(w_clone, ww[:n])
                            assert bool((widx[n:] == -1).all())
                        else:  # cached dispatch: the handle's routing, no top-k
                            cargs = {"x": current, "handle": handle, "config": config,
                                     "async_finish": asynchronous}
                            if previous:
                                cargs["previous_event"] = buffer.capture()
                            cx, _, _, _, _, event = buffer.dispatch(**cargs)
                            if asynchronous:
                                event.current_stream_wait()
                            cx = dequant(*cx) if isinstance(cx, tuple) else cx
                            if current is not x_rand:
                                check_rows(cx, prefix)
                        cargs = {"x": recv_x, "handle": handle, "config": config,
                                 "async_finish": asynchronous}
                        if with_topk:
                            cargs["topk_weights"] = recv_w
                        if previous:
                            cargs["previous_event"] = buffer.capture()
                        combined, combined_w, event = buffer.combine(**cargs)
                        if asynchronous:
                            event.current_stream_wait()
                        fanout = is_token_in_rank.sum(dim=1).unsqueeze(1)
                        ref_x = x_rand if current is x_rand else x
                        assert diff(combined.float() / fanout, ref_x) < 5e-6
                        if with_topk:
                            check_w = combined_w if current is x_rand else combined_w / fanout
                            ref_w = topk_weights_rand if current is x_rand else topk_weights
                            assert diff(check_w, ref_w) < 1e-9
        return runs
    finally:
        buffer.destroy()


def test_deepep_intranode_test_main_on_the_facade(daemon, monkeypatch) -> None:
    use_daemon(daemon, monkeypatch)
    results = run_ranks(_rank, NUM_RANKS)
    assert results == [24, 24]  # 2 previous x 2 async x 3 inputs x 2 top-k
