"""Tenant pools on the CUDA engine (`epd serve --tenant-pools`): the pool's engine on the GPU is a
process of its own with its own NVSHMEM world and heap. Run as the daemon's uid, which the pool
lists and the shared engine serves anyway (the uid checks themselves are the CPU tests',
tests/test_tenant_pools.py: the request path is the same Python): a session on each engine gets
exact results, the two sessions map no heap in common (a session maps only its engine's), and
one name joined on both engines makes two groups, not one across two worlds; both engines keep
working after."""

from __future__ import annotations

import os
import threading

import grpc
import pytest

from epd.server.demo import Workload

from .conftest import cuda_daemon
from .test_security_cuda import _solo_round

pytestmark = pytest.mark.gpu
POOL = "gpu-pool"


@pytest.fixture(scope="module")
def pool_daemon():
    # (the daemon's own uid, this test's, is served by a pool's engines only where the pool
    # lists it; the shared engines serve it anyway)
    yield from cuda_daemon(("--tenant-pools", f"{POOL}=41002,{os.geteuid()}"))


def test_a_pools_engine_has_its_own_process_heap_and_groups(pool_daemon) -> None:
    import torch

    from epd.client import EpdError, Session

    torch.cuda.set_device(0)
    shared_sock = pool_daemon.socket(0)
    pool_sock = os.path.join(os.path.dirname(shared_sock), f"gpu0.tenant-{POOL}.sock")
    wl = Workload(1, [96], 2048, 16, 4, seed=41)
    with Session(shared_sock, timeout=30) as shared, Session(pool_sock, timeout=30) as pool:
        assert (shared.engine_index, pool.engine_index) == (0, 1)  # (one GPU: two engines)
        _solo_round(shared, wl, "tp-shared")
        _solo_round(pool, wl, "tp-pool")
        heaps = [set(s._memory._heaps) for s in (shared, pool)]
        assert all(heaps) and not heaps[0] & heaps[1], "a session mapped the other's heap"

        # one name, rank 0 on the shared engine and rank 1 on the pool's: two groups, each
        # waiting for its missing rank until the deadline (one group across two worlds would
        # pair heaps that are apart)
        errors: dict[int, BaseException | None] = {}

        def join(rank: int, s: Session) -> None:
            try:
                s.join("tp-across", rank=rank, num_ranks=2, num_experts=8, hidden=2048,
                       max_tokens_per_rank=16, num_topk=2, timeout=3)
                errors[rank] = None
            except BaseException as e:
                errors[rank] = e
        threads = [threading.Thread(target=join, args=(r, s))
                   for r, s in enumerate((shared, pool))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for rank in (0, 1):
            e = errors.get(rank)
            assert isinstance(e, EpdError) and e.code == grpc.StatusCode.DEADLINE_EXCEEDED, (
                rank, e)
        # both engines go on
        _solo_round(shared, wl, "tp-shared-2")
        _solo_round(pool, wl, "tp-pool-2")
