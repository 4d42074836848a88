"""One logical node of the two-stage normal-mode test (started by test_nvshmem.py).

argv: pe npes uid_file ranks_per_pe. Each PE is a node of its own (as nvshmem_normal_worker.py)
and drives its ranks' `StagedRunner`s (server/backends/cuda_stages.py, built by the engine's own
`cuda_stages.build` and `Placement`) in lock-step: every rank's step launched, then every
stream waited for. The group is node-major over the PEs, so normal mode runs DeepEP's
hierarchical traffic: the whole group's notify, the rail stage (a token once per destination
node, through NVSHMEM) and the node stage (by pointer). Every output (rows, FP8 scales, top-k
ids and weights, recv_src_idx, per-expert counts, the rank prefix matrix's column, cached
dispatch, worst-token padding, combine with weights and both biases) is compared bit for bit
against reference.hierarchical_dispatch / hierarchical_combine, the stage buffers and outputs
poisoned before each call. The cases must include rows the flat reference orders otherwise,
other recv_src_idx and (more than one rank per node) other combine bits. Then, as a diagnostic,
the host wall clock of dispatch + combine in two stages and with direct puts (the same inputs).
Exit code 0 = all passed; one line per case.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Generator
from typing import Any

import numpy as np


class StageGroup:
    """The ranks of one two-stage group that this PE holds, over a symmetric heap laid out as
    the engine lays out the group's range (cuda_plan.stage_layouts)."""

    def __init__(self, pe: int, npes: int, per_pe: int, num_experts: int, hidden: int,
                 num_topk: int, max_tokens: int, gpu: int) -> None:
        import cupy as cp
        import nvshmem.core as nc

        from epd.proto import dtypes
        from epd.proto.dtypes import BFLOAT16
        from epd.server.backends import cuda_kernels as ck
        from epd.server.backends import cuda_runtime as rt
        from epd.server.backends import cuda_stages
        from epd.server.backends.base import GroupSpec, Hierarchy
        from epd.server.backends.cuda_plan import membership_layout, stage_layouts
        from epd.server.backends.cuda_remote import remote_kernels_for_device

        r = npes * per_pe
        self.num_ranks, self.hidden, self.num_topk = r, hidden, num_topk
        spec = GroupSpec("two-stage", r, num_experts, hidden, max_tokens, num_topk,
                         dtypes.from_numpy(BFLOAT16))
        h = Hierarchy(npes, per_pe)
        lays = stage_layouts(spec, h)
        flat = membership_layout(spec, remote=True, two_stage=True)
        self.heap = nc.array((lays.total_bytes,), dtype="uint8")  # collective: same offset
        self.heap.fill(0)
        here = int(self.heap.data.ptr)
        place = cuda_stages.Placement(tuple(g // per_pe for g in range(r)), (0,) * r, pe,
                                      {0: here}, here, tuple(range(npes)))
        peers, remote = place.peers(list(range(r)), 0, flat.slot_bytes)
        remote_k, local_k = remote_kernels_for_device(gpu), ck.kernels_for_device(gpu)
        self.rank_ids = [pe * per_pe + j for j in range(per_pe)]
        self.staged = {}
        self._keep: Any = None  # a call's device inputs, kept past its launches
        self._barrier_stream = cp.cuda.Stream(non_blocking=True)
        for g in self.rank_ids:
            runner = rt.RankRunner(remote_k, flat.kernel, g, peers, gpu, np.uint16, np.uint16,
                                   owner=self.heap, remote=remote)
            partials = (cp.empty((npes * max_tokens, hidden), cp.uint16),
                        cp.empty((npes * max_tokens, num_topk), cp.float32))
            self.staged[g], _ = cuda_stages.build(runner, spec, h, place, 0, local_k, remote_k,
                                                  self.heap, 0, partials)
        cp.cuda.Device(gpu).synchronize()
        self.barrier()

    def runners(self) -> list[Any]:
        return [st.flat for st in self.staged.values()]  # (the stages share its streams)

    def poison(self) -> None:
        """Every stage buffer but the control blocks, and the partials, to 0xFF; then every PE
        waits (a peer's rows must not land before this PE's fill)."""
        for st in self.staged.values():
            for runner in (st.rail, st.node):
                with runner.stream:
                    for name, v in runner.views.items():
                        if name != "ctrl":
                            v.view(np.uint8).fill(0xFF)
            with st.node.stream:
                st.partial_x.fill(0xFFFF)
                st.partial_w.fill(np.nan)
        self.barrier()

    def barrier(self) -> None:
        import cupy as cp
        import nvshmem.core as nc

        for runner in self.runners():
            runner.stream.synchronize()
        cp.cuda.runtime.deviceSynchronize()
        nc.barrier_all(stream=self._barrier_stream)  # (one stream: each takes a queue)
        self._barrier_stream.synchronize()

    def lockstep(self, steps: dict[int, Generator]) -> dict[int, Any]:
        """Run every rank's staged call: launch each rank's step, wait for all, check errors."""
        done: dict[int, Any] = {}
        pending = {g: next(s) for g, s in steps.items()}
        while pending:
            for runner in pending.values():
                runner.stream.synchronize()
            errors = {g: st.error() for g, st in self.staged.items()}
            assert not any(errors.values()), f"errors by rank: {errors}"
            nxt = {}
            for g, s in steps.items():
                if g in done:
                    continue
                try:
                    nxt[g] = s.send(None)
                except StopIteration as stop:
                    done[g] = stop.value
            pending = nxt
        return done

    def close(self) -> None:
        import nvshmem.core as nc

        self.barrier()  # (no PE frees its heap while another still writes into it)
        self.staged.clear()
        self._keep = None
        nc.free_array(self.heap)


def _dispatch(group: StageGroup, inp: dict, *, alignment: int, worst: int, cached=None,
              num_sms: int, refused_by: int = -1) -> dict[int, Any]:
    """Every rank's staged dispatch in lock-step; rank `refused_by` takes its part as one its
    engine refused (StagedRunner.refused_dispatch: no tokens, the verdict ERR_REFUSED)."""
    import cupy as cp
    from common import TIMEOUT_NS, raw

    dev = {}
    for g, st in group.staged.items():
        with st.flat.stream:
            dev[g] = (cp.asarray(raw(inp["xs"][g])),
                      None if inp["scales"] is None else cp.asarray(inp["scales"][g]),
                      None if cached else cp.asarray(inp["idx"][g]),
                      None if cached else cp.asarray(inp["w"][g]))
    group.barrier()
    from epd.proto import abi

    res = group.lockstep({g: st.refused_dispatch(group.num_topk, group.hidden, 2,
                                                 abi.ERR_REFUSED, TIMEOUT_NS)
                          if g == refused_by else
                          st.dispatch(*dev[g], alignment=alignment, num_worst_tokens=worst,
                                      cached=None if cached is None else cached[g],
                                      timeout_ns=TIMEOUT_NS, num_sms=num_sms)
                          for g, st in group.staged.items()})
    group._keep = dev  # (the inputs outlive the launches)
    return res


def _check_dispatch(group: StageGroup, res: dict[int, Any], hier: Any, *, worst: int,
                    meta: bool, fp8: bool) -> None:
    import cupy as cp
    from common import _check_rank_outputs

    r = group.num_ranks
    for d, st in group.staged.items():
        got = st.outputs(res[d])
        if fp8:  # the rows' FP8 bytes in the bf16-sized buffer
            rows = got["recv_x"].shape[0]
            got["recv_x"] = cp.ndarray((rows, group.hidden), cp.uint8,
                                       memptr=got["recv_x"].data)
        exp = hier.received(d)
        src_rank = hier.sources(d)[0]
        prefix = np.cumsum(np.bincount(src_rank[src_rank >= 0], minlength=r))
        _check_rank_outputs(got, d, exp, exp.recv_src_rank, prefix, worst, meta)


def _combine(group: StageGroup, res: dict[int, Any], ys: list, weights: list, b0, b1,
             num_tokens: list[int], num_sms: int) -> dict[int, tuple[Any, Any]]:
    import cupy as cp
    from common import TIMEOUT_NS, raw

    outs, inputs = {}, {}
    for g, st in group.staged.items():
        with st.flat.stream:
            inputs[g] = (cp.asarray(raw(ys[g])), cp.asarray(weights[g]),
                         None if b0 is None else cp.asarray(raw(b0[g])),
                         None if b1 is None else cp.asarray(raw(b1[g])))
            outs[g] = (cp.full((num_tokens[g], group.hidden), 0xFFFF, cp.uint16),
                       cp.full((num_tokens[g], weights[g].shape[1]), np.nan, cp.float32))
    group.barrier()
    group.lockstep({g: st.combine(inputs[g][0], res[g], outs[g][0],
                                  recv_topk_weights=inputs[g][1], out_weights=outs[g][1],
                                  bias_0=inputs[g][2], bias_1=inputs[g][3],
                                  timeout_ns=TIMEOUT_NS, num_sms=num_sms)
                    for g, st in group.staged.items()})
    group._keep = inputs
    return outs


def roundtrip(group: StageGroup, rng: np.random.Generator, tokens: list[int], e: int, k: int,
              h: int, *, npes: int, payload: str = "bf16", alignment: int = 1, worst: int = 0,
              cached: bool = False, bias: bool = False, num_sms: int = 8,
              **routing: Any) -> dict[str, bool]:
    import cupy as cp
    from common import flat_rows, hierarchical_case, make_inputs, raw

    from epd.proto.dtypes import BFLOAT16
    from epd.server import reference as ref

    inp, hier, flat, differs = hierarchical_case(rng, tokens, e, k, h, npes, payload=payload,
                                                 alignment=alignment, **routing)
    r = len(tokens)
    fp8 = payload == "fp8"
    group.poison()
    res = _dispatch(group, inp, alignment=alignment, worst=worst, num_sms=num_sms)
    _check_dispatch(group, res, hier, worst=worst, meta=True, fp8=fp8)
    if cached:
        fresh = make_inputs(rng, tokens, e, k, h, payload=payload)
        inp2 = dict(inp, xs=fresh["xs"], scales=fresh["scales"])
        hier2 = ref.hierarchical_dispatch(inp2["xs"], inp["idx"], inp["w"], e, npes,
                                          x_scales=inp2["scales"], expert_alignment=alignment)
        group.poison()
        res2 = _dispatch(group, inp2, alignment=alignment, worst=worst, cached=res,
                         num_sms=num_sms)
        _check_dispatch(group, res2, hier2, worst=worst, meta=False, fp8=fp8)
    rds = [hier.received(d) for d in range(r)]
    rows = [worst or rd.recv_x.shape[0] for rd in rds]
    ys = [ref.random_x(rng, n, h, BFLOAT16) for n in rows]  # (padding rows: never read)
    b0 = [ref.random_x(rng, t, h, BFLOAT16) for t in tokens] if bias else None
    b1 = [ref.random_x(rng, t, h, BFLOAT16) for t in tokens] if bias else None
    real = [y[:rd.recv_x.shape[0]] for y, rd in zip(ys, rds, strict=True)]
    want = ref.hierarchical_combine(real, hier, tokens,
                                    recv_topk_weights=[rd.recv_topk_weights for rd in rds],
                                    bias_0=b0, bias_1=b1)
    flat_want = ref.combine([flat_rows(real[d], hier, flat[d], d) for d in range(r)], flat,
                            tokens, bias_0=b0, bias_1=b1)
    differs["rounding"] = any(not np.array_equal(raw(a[0]), raw(b[0]))
                              for a, b in zip(want, flat_want, strict=True))
    weights = [(ref.pad_to_worst(rd, worst) if worst else rd).recv_topk_weights for rd in rds]
    group.poison()
    outs = _combine(group, res, ys, weights, b0, b1, tokens, num_sms)
    for g, (x, w) in outs.items():
        np.testing.assert_array_equal(cp.asnumpy(x), raw(want[g][0]), err_msg=f"rank {g}")
        np.testing.assert_array_equal(cp.asnumpy(w).view(np.uint32),
                                      want[g][1].view(np.uint32), err_msg=f"rank {g} weights")
    return differs


def failed_alike(group: StageGroup, rng: np.random.Generator, e: int, k: int, h: int,
                 m: int, npes: int, num_sms: int) -> None:
    """Calls the whole group's notify fails on every rank alike, each right after a call that
    filled the stage buffers: rank 0 passes m + 1 tokens to a group of m per rank
    (ERR_CAPACITY), then the last rank an expert id out of range (ERR_BAD_INPUT, naming that
    rank and the id in the counter slot). Every rank's both stages skip the call alike (their
    recv_info says the whole group's status: nothing forwarded, nothing received), no error
    word is set anywhere (the lock-step driver asserts it) and no flag is waited for; the
    group goes on, exact. Then the last rank's part taken as refused by its engine
    (ERR_REFUSED naming it; forty-second session): the same on every rank."""
    import cupy as cp
    from common import make_inputs

    from epd.proto import abi

    r = group.num_ranks
    tokens = [m] * r
    bad_id = e + 1000
    for code, case in ((abi.ERR_CAPACITY, "capacity"), (abi.ERR_BAD_INPUT, "bad id"),
                       (abi.ERR_REFUSED, "refused")):
        roundtrip(group, rng, tokens, e, k, h, npes=npes, num_sms=num_sms)  # (buffers filled)
        if code == abi.ERR_CAPACITY:
            inp = make_inputs(rng, [m + 1, *tokens[1:]], e, k, h)
        else:
            inp = make_inputs(rng, tokens, e, k, h)
        if code == abi.ERR_BAD_INPUT:
            inp["idx"][r - 1] = inp["idx"][r - 1].copy()
            inp["idx"][r - 1][0, 0] = bad_id
        res = _dispatch(group, inp, alignment=1, worst=0, num_sms=num_sms,
                        refused_by=r - 1 if code == abi.ERR_REFUSED else -1)
        for g in group.staged:
            for stage in ("flat", "rail", "node"):
                info = cp.asnumpy(getattr(res[g], stage).handle.recv_info)
                assert info[1] == code and info[0] == -1, \
                    f"{case}, rank {g}, {stage}: recv_info {info[:3]}"
            who = int(cp.asnumpy(res[g].flat.handle.recv_info)[2])
            assert who == (0 if code == abi.ERR_CAPACITY else r - 1), f"{case}: named {who}"
    roundtrip(group, rng, tokens, e, k, h, npes=npes, num_sms=num_sms)


def timing(pe: int, npes: int, per_pe: int, gpu: int) -> None:
    """Diagnostic (no target): the host wall clock of dispatch + combine of 2048 tokens per
    rank, top-8 of 256, hidden 7168, bf16: two stages vs direct puts, p50 of 10 after 3.
    Both PEs share one GPU here, so NVSHMEM's P2P transport carries the puts: this compares
    the two designs' costs on the GPU, not on a network."""
    import cupy as cp
    import nvshmem.core as nc
    from common import TIMEOUT_NS, make_inputs, raw
    from nvshmem_ll_worker import NodeGroup

    e, k, h, t = 256, 8, 7168, 2048
    r = npes * per_pe
    inp = make_inputs(np.random.default_rng(3), [t] * r, e, k, h)
    group = StageGroup(pe, npes, per_pe, e, h, k, t, gpu)
    res = _dispatch(group, inp, alignment=1, worst=0, num_sms=24)
    ys = {g: cp.zeros((int(res[g].node.handle.recv_info[0].get()), h), cp.uint16)
          for g in group.staged}
    dev = group._keep
    outs = {g: cp.empty((t, h), cp.uint16) for g in group.staged}

    def staged_once() -> None:
        res = group.lockstep({g: st.dispatch(*dev[g], timeout_ns=TIMEOUT_NS, num_sms=24)
                              for g, st in group.staged.items()})
        group.lockstep({g: st.combine(ys[g][:st.outputs(res[g])["num_recv"]], res[g], outs[g],
                                      timeout_ns=TIMEOUT_NS, num_sms=24)
                        for g, st in group.staged.items()})

    staged = _time(group.barrier, staged_once)
    group.close()
    direct = NodeGroup(pe, npes, per_pe, e, h, k, t, cp.cuda.Stream(non_blocking=True), gpu,
                       hierarchical=True, low_latency=False)
    ins = {g: (cp.asarray(raw(inp["xs"][g])), None, cp.asarray(inp["idx"][g]),
               cp.asarray(inp["w"][g])) for g in direct.rank_ids}

    def direct_once() -> None:
        got = {g: run.dispatch(*ins[g], timeout_ns=TIMEOUT_NS, num_sms=24)
               for g, run in zip(direct.rank_ids, direct.runners, strict=True)}
        for run in direct.runners:
            run.stream.synchronize()
        n = {g: run.recv_info(got[g])[0] for g, run in zip(direct.rank_ids, direct.runners,
                                                           strict=True)}
        for g, run in zip(direct.rank_ids, direct.runners, strict=True):
            run.combine(ys[g][:n[g]] if n[g] <= ys[g].shape[0] else
                        cp.zeros((n[g], h), cp.uint16), got[g], outs[g],
                        timeout_ns=TIMEOUT_NS, num_sms=24)
        for run in direct.runners:
            run.stream.synchronize()

    flat = _time(direct.barrier, direct_once)
    direct.close()
    nc.barrier_all(stream=cp.cuda.Stream(non_blocking=True))
    print(f"PE {pe}: timing R={r} ({npes} nodes x {per_pe}) T={t} H={h} top-{k} of {e} bf16, "
          f"dispatch+combine host wall p50: two stages {staged * 1e6:.0f} us, "
          f"direct puts {flat * 1e6:.0f} us", flush=True)


def _time(barrier, once) -> float:
    samples = []
    for i in range(13):
        barrier()
        t0 = time.perf_counter()
        once()
        if i >= 3:
            samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def main() -> int:
    pe, npes, uid_file, per_pe = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    import nvshmem.core as nc
    from common import told_apart
    from nvshmem_worker import failed, init_pe

    gpu = init_pe(pe, npes, uid_file)
    failures = 0
    r = npes * per_pe
    cases = [  # (experts, topk, hidden, max tokens, tokens of rank g, roundtrip's extras)
        (256, 8, 7168, 512, lambda g: [512, 301, 0, 77][g % 4],
         {"bias": True, "drop": 0.05, "num_sms": 16}),
        (64, 4, 2048, 96, lambda g: [96, 40][g % 2],
         {"payload": "fp8", "alignment": 4, "num_sms": 5, "cached": True}),
        (64, 2, 2048, 16, lambda g: 7 + g % 8, {"cached": True, "num_sms": 3}),
        (max(64, 8 * r), 8, 2048, 128, lambda g: 128,  # (hot rank: top-8 of its experts)
         {"worst": 128 * r, "hot_rank": 0, "hot_fraction": 0.9, "num_sms": 8}),
    ]
    differs = {"order": False, "src_idx": False, "rounding": False}
    # One GPU holds every rank here, and a rank's blocks wait in its peers' barriers: beyond
    # 4 ranks per PE the blocks are capped so that all of a stage's ranks stay resident (with
    # a GPU per rank, as in a deployment, nothing is shared).
    sms_cap = 32 // per_pe if per_pe > 4 else 64
    try:
        for e, k, h, m, tok, extra in cases:
            extra = dict(extra, num_sms=min(extra["num_sms"], sms_cap))
            group = StageGroup(pe, npes, per_pe, e, h, k, m, gpu)
            tokens = [tok(g) for g in range(r)]
            seen: dict[str, bool] = {}

            def run(group=group, e=e, k=k, h=h, m=m, tokens=tokens, extra=extra,
                    seen=seen) -> None:
                rng = np.random.default_rng(e + k + h + m)
                for _ in range(2):  # repeated calls on the same buffers
                    got = roundtrip(group, rng, tokens, e, k, h, npes=npes, **extra)
                    for what, hit in got.items():
                        seen[what] = seen.get(what, False) or hit

            failures += failed(pe, f"two-stage normal mode E={e} K={k} H={h} tokens={tokens} "
                                   f"{extra}", run)
            for what, hit in seen.items():
                differs[what] |= hit
            group.close()
        group = StageGroup(pe, npes, per_pe, 64, 2048, 8, 32, gpu)
        failures += failed(pe, "a call over capacity, one with a bad id, then the next",
                           failed_alike, group, np.random.default_rng(5), 64, 8, 2048, 32, npes,
                           min(8, sms_cap))
        group.close()
        if "--timing" in sys.argv:
            failures += failed(pe, "timing", timing, pe, npes, per_pe, gpu)
    finally:
        nc.finalize()
    failures += told_apart(pe, per_pe, differs)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
