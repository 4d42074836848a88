"""DeepEP V1's own low-latency test, its checks replayed through EPD's facade on the CPU backend.

Source read: deepseek-ai/DeepEP@567632d, tests/test_low_latency.py, `test_main` with its default
arguments (no LogFMT, no shrink test) and `test_loop`'s Buffer construction. The same call
sequence on one Buffer: for each input (a constant-per-rank x whose last 128 columns carry the
token index, and a random one), with and without the receive hook, bf16 / FP8 / FP8 with power-
of-two scales / UE8M0-packed scales, the dispatch repeated once or twice (the combine takes the
latest handle), then the combine with and without `zero_copy` into a caller's `out`. The checks
are DeepEP's, restated here: every local expert's count equals the cumulative stats, the sum of
`handle[1]` (layout_range) and the number of top-k entries naming the expert on every rank;
received rows of the constant input carry their source rank in the first hidden-128 columns
(row by row, and per source range of `handle[1]`) and the token index (`handle[0]`) in the last
128; the combine equals x times the sum of the valid weights within DeepEP's tolerance. The
GEMM and timing parts are not replayed. Small shapes (the CPU backend in CI); the same test on
the CUDA engine is DeepEP's own file on the GPU machine (issue 11).
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from deepep_replay import dequant, diff, run_ranks, use_daemon  # noqa: E402

from epd.client import buffer as deep_ep  # noqa: E402  (what `import deep_ep` resolves to)

pytestmark = pytest.mark.slow
NUM_RANKS, TOKENS, HIDDEN, EXPERTS, TOPK = 2, 24, 1024, 12, 4
DEEPEP_TEST = "deepseek-ai/DeepEP@567632d tests/test_low_latency.py"


def _rank(rank: int, group) -> int:
    torch.manual_seed(rank)
    random.seed(rank)
    local = EXPERTS // NUM_RANKS
    offset = 128  # the source rank is stored as rank - 128, exact in bf16
    # test_loop: DeepEP's constructor, low-latency mode, its size hint
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(TOKENS, HIDDEN, NUM_RANKS,
                                                                   EXPERTS)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=EXPERTS // NUM_RANKS,
                            allow_nvlink_for_low_latency_mode=True, explicitly_destroy=True)
    try:
        x = torch.ones((TOKENS, HIDDEN), dtype=torch.bfloat16) * (rank - offset)
        x[:, -128:] = torch.arange(TOKENS).to(torch.bfloat16).view(-1, 1)
        inputs = [x, torch.randn((TOKENS, HIDDEN), dtype=torch.bfloat16) * 0.1]
        scores = torch.randn((TOKENS, EXPERTS), dtype=torch.float32).abs() + 1
        topk_idx = torch.topk(scores, TOPK, dim=-1, largest=True, sorted=True)[1]
        topk_idx = topk_idx.to(deep_ep.topk_idx_t)
        topk_weights = torch.randn((TOKENS, TOPK), dtype=torch.float32).abs()
        for _ in range(10):
            topk_idx[random.randint(0, TOKENS - 1), random.randint(0, TOPK - 1)] = -1
        everyone = group.all_gather(topk_idx)  # [R, T, K]
        calls = 0
        for current in inputs:
            for hooked in (False, True):
                for fp8 in (False, True):
                    for round_scale in ((False, True) if fp8 else (False,)):
                        for ue8m0 in ((False, True) if round_scale else (False,)):
                            calls += 1
                            for _ in range(calls % 2 + 1):  # once or twice in a row
                                stats = torch.zeros((local,), dtype=torch.int)
                                recv, counts, handle, event, hook = buffer.low_latency_dispatch(
                                    current, topk_idx, TOKENS, EXPERTS, use_fp8=fp8,
                                    round_scale=round_scale, use_ue8m0=ue8m0,
                                    cumulative_local_expert_recv_stats=stats,
                                    async_finish=not hooked, return_recv_hook=hooked)
                                hook() if hooked else event.current_stream_wait()
                            if fp8:
                                recv = (recv[0], recv[1].contiguous())
                                gemm_x = dequant(recv[0].view(-1, HIDDEN),
                                                  recv[1].view(recv[0].shape[0] * recv[0].shape[1],
                                                               -1)).view(recv[0].shape)
                            else:
                                gemm_x = recv.clone()
                            for i in range(local):
                                expert = rank * local + i
                                n = int(counts[i].item())
                                ranges = handle[1][i]
                                assert int(stats[i]) == n
                                assert n == int((ranges & 0xFFFFFFFF).sum())
                                assert n == int((everyone == expert).sum())
                                if n == 0 or current is not x:
                                    continue
                                rows = gemm_x[i][:n]
                                src_info = handle[0][i][:n]
                                body_min = rows[:, :-128].amin(dim=-1)
                                assert torch.equal(body_min, rows[:, :-128].amax(dim=-1))
                                if round_scale:
                                    assert diff(rows[:, -1], src_info.view(-1)) < 0.007
                                else:
                                    assert (rows[:, -128:] - src_info.view(-1, 1) % TOKENS
                                            ).sum().item() == 0
                                for j in range(NUM_RANKS):
                                    begin, cnt = int(ranges[j] >> 32), int(ranges[j] & 0xFFFFFFFF)
                                    if round_scale:
                                        continue
                                    assert int((body_min == j - offset).sum()) == int(
                                        (everyone[j] == expert).sum())
                                    assert (rows[begin:begin + cnt, :-128] - j + offset
                                            ).sum().item() == 0
                            for zero_copy in (False, True):
                                if zero_copy:
                                    buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = \
                                        gemm_x
                                out = torch.empty((TOKENS, HIDDEN), dtype=torch.bfloat16)
                                combined, event, hook = buffer.low_latency_combine(
                                    gemm_x, topk_idx, topk_weights, handle,
                                    async_finish=not hooked, zero_copy=zero_copy,
                                    return_recv_hook=hooked, out=out)
                                hook() if hooked else event.current_stream_wait()
                                want = current * topk_weights.masked_fill(topk_idx == -1, 0).sum(
                                    dim=1).view(-1, 1)
                                assert not torch.isnan(combined).any()
                                if not round_scale:
                                    assert diff(want, combined) < (9e-4 if fp8 else 1e-5), \
                                        (calls, fp8, zero_copy)
        return calls
    finally:
        buffer.destroy()


def test_deepep_low_latency_test_main_on_the_facade(daemon, monkeypatch) -> None:
    use_daemon(daemon, monkeypatch)
    results = run_ranks(_rank, NUM_RANKS)
    # 2 inputs x 2 hook modes x 4 precisions (bf16, FP8, FP8 power-of-two, UE8M0)
    assert results == [16, 16]
