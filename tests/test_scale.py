"""One node at EP4 and EP8: the CPU backend with 4 and 8 engine processes (one per "GPU", as
the CUDA deployment has), every rank on its own engine, exact against the reference."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from epd.client import Session
from epd.server import reference as ref
from epd.server.demo import Daemon, Workload

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("engines", [4, 8])
def test_one_rank_per_engine(engines: int) -> None:
    wl = Workload(engines, [40 + 3 * r for r in range(engines)], 256, 8 * engines, 4,
                  seed=engines, drop_prob=0.05)
    ins = wl.all_inputs()
    disp = ref.dispatch([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins],
                        wl.num_experts)
    comb = ref.combine([d.recv_x for d in disp], disp, wl.tokens,
                       recv_topk_weights=[d.recv_topk_weights for d in disp])

    def rank(r: int):
        x, idx, w = ins[r]
        with Session(d.socket(r)) as s:
            assert s.engine_index == r
            g = s.join(f"ep{engines}", rank=r, num_ranks=engines, num_experts=wl.num_experts,
                       hidden=wl.hidden, max_tokens_per_rank=max(wl.tokens), num_topk=4)
            out = g.dispatch(x, idx, w)
            cx, cw = g.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights)
            return out, cx, cw

    with Daemon(backend="cpu", engines=engines) as d, ThreadPoolExecutor(engines) as ex:
        results = list(ex.map(rank, range(engines)))
    for r, (out, cx, cw) in enumerate(results):
        np.testing.assert_array_equal(out.recv_x.view(np.uint16), disp[r].recv_x.view(np.uint16))
        np.testing.assert_array_equal(out.recv_topk_idx, disp[r].recv_topk_idx)
        np.testing.assert_array_equal(out.recv_src_idx, disp[r].recv_src_idx)
        assert out.num_recv_tokens_per_expert == disp[r].num_recv_tokens_per_expert
        np.testing.assert_array_equal(cx.view(np.uint16), comb[r][0].view(np.uint16))
        np.testing.assert_array_equal(cw, comb[r][1])
