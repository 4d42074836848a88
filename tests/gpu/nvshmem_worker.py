"""One NVSHMEM PE of the multi-process GPU test (started by test_nvshmem.py).

argv: pe npes uid_file ranks_per_pe. PE p runs on GPU p modulo the GPUs there are (two PEs on
one GPU is NVSHMEM's multiple-processes-per-GPU mode, under MPS). Every PE generates the whole
workload from the same seeds, drives its own ranks (buffers at offsets of its symmetric heap,
peers through nvshmem.core.get_peer_array) and checks them against the reference. Exit code 0 =
all passed.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np


class PeGroup:
    """The ranks of one group that this PE drives (the LocalGroup interface of common.py)."""

    def __init__(self, pe: int, npes: int, per_pe: int, num_experts: int, hidden: int,
                 num_topk: int, max_tokens: int, stream, gpu: int) -> None:
        import nvshmem.core as nc

        from epd.proto import dtypes
        from epd.proto.dtypes import BFLOAT16
        from epd.server.backends import cuda_kernels as ck
        from epd.server.backends import cuda_runtime as rt
        from epd.server.backends.base import GroupSpec
        from epd.server.backends.cuda_plan import membership_layout

        r = npes * per_pe
        self.num_ranks = r
        spec = GroupSpec("nvshmem-test", r, num_experts, hidden, max_tokens, num_topk,
                         dtypes.from_numpy(BFLOAT16))
        self.layout = membership_layout(spec).kernel  # the daemon's layout
        size = membership_layout(spec).slot_bytes
        self.heap = nc.array((per_pe * size,), dtype="uint8")  # collective, same order on all
        self.heap.fill(0)
        bases = []
        for g in range(r):
            p, j = divmod(g, per_pe)
            arr = self.heap if p == pe else nc.get_peer_array(self.heap, p)
            bases.append(int(arr.data.ptr) + j * size)
        self.rank_ids = [pe * per_pe + j for j in range(per_pe)]
        kern = ck.kernels_for_device(gpu)
        self.runners = [rt.RankRunner(kern, self.layout, g, bases, gpu, BFLOAT16, BFLOAT16,
                                      owner=self.heap) for g in self.rank_ids]
        self.size = size
        self.stream = stream
        self.barrier()  # every PE zeroed its control blocks

    def poison(self) -> None:
        off = self.layout.offsets["recv_x"]
        for j in range(len(self.runners)):
            self.heap[j * self.size + off:(j + 1) * self.size].fill(0xAB)

    def barrier(self) -> None:
        """This PE's work done, then every PE's (common._poison calls it between poisoning
        and launching: a peer's rows must not land before this PE's fill, seen with two ranks
        per PE on one GPU)."""
        import cupy as cp
        import nvshmem.core as nc

        self.synchronize()
        cp.cuda.runtime.deviceSynchronize()
        nc.barrier_all(stream=self.stream)
        self.stream.synchronize()

    def synchronize(self) -> None:
        for r in self.runners:
            r.stream.synchronize()

    def close(self) -> None:
        import nvshmem.core as nc

        self.barrier()  # (no PE frees its heap while another still writes into it)
        self.runners.clear()
        nc.free_array(self.heap)


def failed(pe: int, what: str, check, *args, **kwargs) -> int:
    """check(*args, **kwargs), one check of this PE: 0 and a line saying it passed, or 1 and
    its traceback."""
    try:
        check(*args, **kwargs)
    except Exception:
        traceback.print_exc()
        return 1
    print(f"PE {pe}: {what} ok", flush=True)
    return 0


def init_pe(pe: int, npes: int, uid_file: str) -> int:
    """Join the NVSHMEM world of `npes` PEs (PE 0 writes the unique id to `uid_file`);
    returns the GPU this PE runs on."""
    import cupy as cp
    import nvshmem.core as nc
    from cuda.core import Device

    gpu = pe % cp.cuda.runtime.getDeviceCount()
    dev = Device(gpu)
    dev.set_current()
    cp.cuda.Device(gpu).use()
    if pe == 0:
        uid = nc.get_unique_id()
        with open(uid_file + ".tmp", "wb") as f:
            f.write(uid._data.tobytes())
        os.rename(uid_file + ".tmp", uid_file)
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(uid_file):
            if time.monotonic() > deadline:
                raise TimeoutError("no NVSHMEM unique id from PE 0")
            time.sleep(0.01)
        uid = nc.get_unique_id(empty=True)
        uid._data.view(np.uint8)[:] = np.frombuffer(Path(uid_file).read_bytes(), np.uint8)
    nc.init(device=dev, uid=uid, rank=pe, nranks=npes, initializer_method="uid")
    return gpu


def main() -> int:
    pe, npes, uid_file, per_pe = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    import cupy as cp
    import nvshmem.core as nc
    from common import roundtrip  # this folder is on sys.path (run as a script)

    gpu = init_pe(pe, npes, uid_file)
    stream = cp.cuda.Stream(non_blocking=True)
    failures = 0
    cases = [  # (experts, topk, hidden, tokens per rank, extra)
        (256, 8, 7168, 4096, {"bias": True, "drop": 0.05}),
        (64, 2, 2048, 7, {"cached": True, "worst": 0}),
        (32, 8, 2048, 128, {"worst": 1024, "hot_rank": 0, "hot_fraction": 0.9}),
    ]
    try:
        for e, k, h, t, extra in cases:
            group = PeGroup(pe, npes, per_pe, e, h, k, 4096, stream, gpu)
            rng = np.random.default_rng(e + k + h + t)
            tokens = [t if g % 3 else max(t // 2, 0) for g in range(group.num_ranks)]
            failures += failed(pe, f"case E={e} K={k} H={h} T={t} {extra}", roundtrip, group,
                               rng, tokens, e, k, h, num_sms=16, **extra)
            group.close()
    finally:
        nc.finalize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
