"""One logical node of the normal-mode test across nodes (started by test_nvshmem.py).

argv: pe npes uid_file ranks_per_pe. As nvshmem_ll_worker.py: each PE is a node of its own,
the other PEs' ranks are reached only through NVSHMEM's device API (the kernels' EPD_NVSHMEM
build), ranks of this PE by pointer. Normal mode: layout-free notify, dispatch (bf16, FP8 with
scales, cached, worst-token padding, an empty rank, a hot rank) and combine (with bias), every
rank's outputs bit-exact against the reference, poisoned before each round. Exit code 0 = all
passed; one line per case.
"""

from __future__ import annotations

import sys

import numpy as np
from nvshmem_ll_worker import NodeGroup  # this folder is on sys.path (run as a script)


def main() -> int:
    pe, npes, uid_file, per_pe = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    import cupy as cp
    import nvshmem.core as nc
    from common import roundtrip
    from nvshmem_worker import failed, init_pe

    from epd.proto.dtypes import FLOAT8_E4M3

    gpu = init_pe(pe, npes, uid_file)
    stream = cp.cuda.Stream(non_blocking=True)
    failures = 0
    r = npes * per_pe
    cases = [  # (experts, topk, hidden, max tokens, tokens of rank g, roundtrip's extras)
        (256, 8, 7168, 512, lambda g: [512, 301, 0, 77][g % 4],
         {"bias": True, "drop": 0.05, "num_sms": 16}),
        (64, 4, 2048, 96, lambda g: [96, 40][g % 2],
         {"payload": "fp8", "alignment": 4, "num_sms": 5}),
        (64, 2, 2048, 16, lambda g: 7 + g, {"cached": True, "num_sms": 3}),
        (64, 8, 2048, 128, lambda g: 128,
         {"worst": 128 * r, "hot_rank": 0, "hot_fraction": 0.9, "num_sms": 8}),
    ]
    try:
        for e, k, h, m, tok, extra in cases:
            group = NodeGroup(pe, npes, per_pe, e, h, k, m, stream, gpu,
                              x_dtype=FLOAT8_E4M3 if extra.get("payload") == "fp8" else None)
            rng = np.random.default_rng(e + k + h + m)
            tokens = [tok(g) for g in range(r)]
            failures += failed(pe, f"normal mode E={e} K={k} H={h} tokens={tokens} {extra}",
                               roundtrip, group, rng, tokens, e, k, h, **extra)
            group.close()
    finally:
        nc.finalize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
