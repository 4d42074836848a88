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
