"""The CUDA engine's handle bound (`CudaRankComm.handle_bytes`) sizes each stage's
`DispatchHandle` by `DispatchHandle.nbytes_for`: checked here against what `allocate` really
takes on the device, flat and over nodes (tests/test_handle_bytes.py has the budget itself)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("tokens", "ranks", "local_experts", "nodes"),
                         [(0, 2, 4, 1), (1, 8, 32, 1), (4096, 8, 32, 1), (777, 16, 16, 2),
                          (300, 64, 4, 8)])
def test_nbytes_for_is_what_allocate_takes(tokens: int, ranks: int, local_experts: int,
                                           nodes: int) -> None:
    from epd.server.backends import cuda_kernels as ck

    h = ck.DispatchHandle.allocate(tokens, ranks, local_experts, nodes)
    arrays = [h.token_mask, h.pos, h.count_matrix, h.rank_prefix, h.recv_info, h.node_pos,
              h.node_base]
    held = [a.nbytes for a in arrays if a is not None]
    assert sum(-(-n // 512) * 512 for n in held) == \
        ck.DispatchHandle.nbytes_for(tokens, ranks, local_experts, nodes) >= sum(held)
