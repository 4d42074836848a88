"""One logical node of the normal-mode test across nodes (started by test_nvshmem.py).

argv: pe npes uid_file ranks_per_pe. As nvshmem_ll_worker.py: each PE is a node of its own,
the other PEs' ranks are reached only through NVSHMEM's device API (the kernels' EPD_NVSHMEM
build), ranks of this PE by pointer. The group is node-major over the PEs, so its normal mode
runs the hierarchical semantics (as the engine runs such a group): layout-free notify, dispatch
(bf16, FP8 with scales, cached, worst-token padding, an empty rank, a hot rank) and combine
(with bias), every rank's outputs bit-exact against reference.hierarchical_dispatch /
hierarchical_combine, poisoned before each round; then the first case once more with the flat
semantics (what a group placed otherwise runs) against the flat reference. The cases together
must include rows ordered otherwise by the flat reference, other recv_src_idx and (with more than
one rank per node) other combine bits, so flat results could not pass. Exit code 0 = all passed;
one line per case.
"""

from __future__ import annotations

import sys

import numpy as np
from nvshmem_ll_worker import NodeGroup  # this folder is on sys.path (run as a script)


def main() -> int:
    pe, npes, uid_file, per_pe = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    import cupy as cp
    import nvshmem.core as nc
    from common import hierarchical_roundtrip, roundtrip, told_apart
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
    differs = {"order": False, "src_idx": False, "rounding": False}
    try:
        for e, k, h, m, tok, extra in cases:
            group = NodeGroup(pe, npes, per_pe, e, h, k, m, stream, gpu, hierarchical=True,
                              x_dtype=FLOAT8_E4M3 if extra.get("payload") == "fp8" else None)
            rng = np.random.default_rng(e + k + h + m)
            tokens = [tok(g) for g in range(r)]
            seen: dict[str, bool] = {}

            def run(group=group, rng=rng, tokens=tokens, e=e, k=k, h=h, extra=extra,
                    seen=seen) -> None:
                seen.update(hierarchical_roundtrip(group, rng, tokens, e, k, h,
                                                   num_nodes=npes, **extra))

            failures += failed(pe, f"hierarchical normal mode E={e} K={k} H={h} "
                                   f"tokens={tokens} {extra}", run)
            for what, hit in seen.items():
                differs[what] |= hit
            group.close()
        # The flat semantics across the same nodes: a group placed otherwise (not node-major).
        e, k, h, m, tok, extra = cases[0]
        group = NodeGroup(pe, npes, per_pe, e, h, k, m, stream, gpu)
        tokens = [tok(g) for g in range(r)]
        failures += failed(pe, f"flat normal mode E={e} K={k} H={h} tokens={tokens} {extra}",
                           roundtrip, group, np.random.default_rng(e + k + h + m), tokens, e,
                           k, h, **extra)
        group.close()
    finally:
        nc.finalize()
    # The comparison must be able to fail: the flat semantics give other results here.
    # (one rank per node: the (local index, node) order is rank order, a partial one row)
    failures += told_apart(pe, per_pe, differs)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
