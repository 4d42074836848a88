"""Shared helpers of the GPU tests: run a normal dispatch/combine on a LocalGroup and compare
every output bit-exactly with the NumPy reference (epd.server.reference)."""

from __future__ import annotations

from typing import Any

import numpy as np

from epd.proto.dtypes import BFLOAT16, FLOAT8_E4M3
from epd.server import reference as ref

TIMEOUT_NS = 5_000_000_000


def raw(a: np.ndarray) -> np.ndarray:
    """bf16/fp8 have no CuPy dtype: move their bits as uint16/uint8."""
    if a.dtype == BFLOAT16:
        return a.view(np.uint16)
    if a.dtype == FLOAT8_E4M3:
        return a.view(np.uint8)
    return a


def ll_combined(x: np.ndarray, idx: np.ndarray, w: np.ndarray,
                expert_value: Any = None) -> np.ndarray:
    """One rank's low-latency combine (bits, x's dtype) where every expert returns the rows it
    received (or, with `expert_value(e)`, that value on every column): fp32 in k order,
    skipping -1, one fused multiply-add a term as the kernels (reference.fma_f32)."""
    acc = np.zeros(x.shape, np.float32)
    for k in range(idx.shape[1]):
        sel = idx[:, k] >= 0
        y = (x[sel].astype(np.float32) if expert_value is None else
             np.array([expert_value(int(e)) for e in idx[sel, k]], np.float32)[:, None])
        acc[sel] = ref.fma_f32(w[sel, k][:, None], y, acc[sel])
    return raw(acc.astype(x.dtype))


def ranks_of(group: Any) -> list[tuple[int, Any]]:
    """(global rank, runner) pairs this process drives (all of them for a LocalGroup)."""
    ids = getattr(group, "rank_ids", None)
    return list(zip(ids if ids is not None else range(len(group.runners)), group.runners,
                    strict=True))


def make_inputs(rng: np.random.Generator, num_tokens: list[int], num_experts: int,
                num_topk: int, hidden: int, *, payload: str = "bf16", drop: float = 0.0,
                hot_rank: int | None = None, hot_fraction: float = 0.0) -> dict[str, Any]:
    r = len(num_tokens)
    routes = [ref.random_routing(rng, t, num_experts, num_topk, drop_prob=drop,
                                 hot_rank=hot_rank, hot_fraction=hot_fraction, num_ranks=r)
              for t in num_tokens]
    scales = None
    if payload == "fp8":
        qs = [ref.quantize_fp8(ref.random_x(rng, t, hidden, BFLOAT16)) for t in num_tokens]
        xs = [q for q, _ in qs]
        scales = [s for _, s in qs]
    else:
        dt = {"bf16": BFLOAT16, "f32": np.dtype(np.float32)}[payload]
        xs = [ref.random_x(rng, t, hidden, dt) for t in num_tokens]
    return {"xs": xs, "scales": scales, "idx": [i for i, _ in routes],
            "w": [w for _, w in routes]}


def run_dispatch(group: Any, inp: dict[str, Any], *, alignment: int = 1, worst: int = 0,
                 cached: dict[int, Any] | None = None, num_sms: int = 8,
                 slots: list[Any] | None = None) -> dict[int, Any]:
    import cupy as cp

    # Every rank's inputs on the device before any rank launches: an allocation between the
    # launches could wait for a kernel that spins on a rank not launched yet (several ranks of
    # one process; seen across two PEs as an entry barrier past its deadline).
    inputs = {}
    for r, runner in ranks_of(group):
        with cp.cuda.Device(runner.device_id), runner.stream:  # no null-stream syncs
            inputs[r] = (cp.asarray(raw(inp["xs"][r])),
                         None if inp["scales"] is None else cp.asarray(inp["scales"][r]),
                         None if cached else cp.asarray(inp["idx"][r]),
                         None if cached else cp.asarray(inp["w"][r]))
    group.synchronize()
    results: dict[int, Any] = {}
    for r, runner in ranks_of(group):
        with cp.cuda.Device(runner.device_id), runner.stream:
            results[r] = runner.dispatch(
                *inputs[r], alignment=alignment, num_worst_tokens=worst,
                cached=None if cached is None else cached[r], timeout_ns=TIMEOUT_NS,
                num_sms=num_sms, counter_slot_ptr=0 if slots is None else slots[r].ptr)
    group.synchronize()
    _assert_no_error(group)
    return results


def check_dispatch(group: Any, results: dict[int, Any], expected: list[Any], *, worst: int = 0,
                   meta: bool = True) -> list[dict[str, Any]]:
    """Every output of the ranks this process drives against the flat reference `expected`."""
    outs = []
    for d, runner in ranks_of(group):
        exp = expected[d]
        got = runner.outputs(results[d])
        _check_rank_outputs(got, d, exp, exp.recv_src_rank, np.cumsum(np.diff(exp.src_offsets)),
                            worst, meta)
        outs.append(got)
    return outs


def _check_rank_outputs(got: dict[str, Any], d: int, exp: Any, src_rank: np.ndarray,
                        prefix: np.ndarray, worst: int, meta: bool) -> None:
    """Rank `d`'s dispatch outputs (`runner.outputs`) against its reference rows `exp` (padded
    here to `worst`), the rows' source ranks and its column of the rank prefix matrix."""
    import cupy as cp

    n = exp.recv_x.shape[0]
    if worst:
        exp = ref.pad_to_worst(exp, worst)
        src_rank = np.concatenate([src_rank, np.full(worst - n, -1, np.int32)])
    assert got["num_recv"] == n
    assert got["per_expert"] == list(exp.num_recv_tokens_per_expert)
    np.testing.assert_array_equal(raw(cp.asnumpy(got["recv_x"])), raw(exp.recv_x))
    np.testing.assert_array_equal(cp.asnumpy(got["recv_src_idx"]), exp.recv_src_idx)
    np.testing.assert_array_equal(cp.asnumpy(got["recv_src_rank"]), src_rank)
    if meta:
        np.testing.assert_array_equal(cp.asnumpy(got["recv_topk_idx"]), exp.recv_topk_idx)
        np.testing.assert_array_equal(cp.asnumpy(got["recv_topk_weights"]).view(np.uint32),
                                      exp.recv_topk_weights.view(np.uint32))
    if exp.recv_x_scales is not None:
        np.testing.assert_array_equal(cp.asnumpy(got["recv_x_scales"]).view(np.uint32),
                                      exp.recv_x_scales.view(np.uint32))
    np.testing.assert_array_equal(cp.asnumpy(got["rank_prefix"])[:, d], prefix)


def run_and_check_combine(group: Any, rng: np.random.Generator, results: dict[int, Any],
                          expected: list[Any], num_tokens: list[int], hidden: int, *,
                          worst: int = 0, bias: bool = False, num_sms: int = 8) -> None:
    disp = [ref.pad_to_worst(e, worst) if worst else e for e in expected]
    ys = [ref.random_x(rng, e.recv_x.shape[0], hidden, BFLOAT16) for e in disp]
    b0 = [ref.random_x(rng, t, hidden, BFLOAT16) for t in num_tokens] if bias else None
    b1 = [ref.random_x(rng, t, hidden, BFLOAT16) for t in num_tokens] if bias else None
    want = ref.combine(ys, disp, num_tokens, recv_topk_weights=[e.recv_topk_weights for e in disp],
                       bias_0=b0, bias_1=b1)
    _combine_exact(group, results, ys, [e.recv_topk_weights for e in disp], b0, b1,
                   num_tokens, hidden, want, num_sms)


def _assert_no_error(group: Any) -> None:
    """No rank this process drives recorded an error (all of them named: the first may only
    be a consequence of another's)."""
    errors = {r: runner.error() for r, runner in ranks_of(group)}
    assert not any(errors.values()), f"errors by rank: {errors}"


def _poison(group: Any) -> None:
    """Poison the outputs; a group of several processes (PEs) then waits at its barrier, or a
    peer's rows could land before this PE's fill and be overwritten (seen across two PEs)."""
    group.poison()
    if hasattr(group, "barrier"):
        group.barrier()


def roundtrip(group: Any, rng: np.random.Generator, num_tokens: list[int], num_experts: int,
              num_topk: int, hidden: int, *, payload: str = "bf16", alignment: int = 1,
              worst: int = 0, cached: bool = False, bias: bool = False, num_sms: int = 8,
              **routing: Any) -> dict[int, Any]:
    inp = make_inputs(rng, num_tokens, num_experts, num_topk, hidden, payload=payload,
                      **routing)
    expected = ref.dispatch(inp["xs"], inp["idx"], inp["w"], num_experts,
                            x_scales=inp["scales"], expert_alignment=alignment)
    _poison(group)
    results = run_dispatch(group, inp, alignment=alignment, worst=worst, num_sms=num_sms)
    check_dispatch(group, results, expected, worst=worst)
    if cached:
        # Same routing, new payload: the cached handle must place the new rows identically.
        fresh = make_inputs(rng, num_tokens, num_experts, num_topk, hidden, payload=payload)
        inp2 = dict(inp, xs=fresh["xs"], scales=fresh["scales"])
        expected2 = ref.dispatch(inp2["xs"], inp["idx"], inp["w"], num_experts,
                                 x_scales=inp2["scales"], expert_alignment=alignment)
        _poison(group)
        results2 = run_dispatch(group, inp2, worst=worst, cached=results, num_sms=num_sms)
        check_dispatch(group, results2, expected2, worst=worst, meta=False)
    if payload != "f32":
        run_and_check_combine(group, rng, results, expected, num_tokens, hidden, worst=worst,
                              bias=bias, num_sms=num_sms)
    return results


def hierarchical_roundtrip(group: Any, rng: np.random.Generator, num_tokens: list[int],
                           num_experts: int, num_topk: int, hidden: int, *, num_nodes: int,
                           payload: str = "bf16", alignment: int = 1, worst: int = 0,
                           cached: bool = False, bias: bool = False, num_sms: int = 8,
                           **routing: Any) -> dict[str, bool]:
    """`roundtrip` for a group placed node-major over `num_nodes` nodes, whose normal mode runs
    the hierarchical semantics: every output against reference.hierarchical_dispatch /
    hierarchical_combine, bit-exact, outputs poisoned first. Returns where the flat reference
    differs from the hierarchical one in this case (row order, recv_src_idx, combine bits), so
    that a caller can make sure that flat results could not have passed."""
    inp, hier, flat, differs = hierarchical_case(rng, num_tokens, num_experts, num_topk, hidden,
                                                 num_nodes, payload=payload,
                                                 alignment=alignment, **routing)
    _poison(group)
    results = run_dispatch(group, inp, alignment=alignment, worst=worst, num_sms=num_sms)
    check_hierarchical_dispatch(group, results, hier, worst=worst)
    if cached:
        # Same routing, new payload: the cached handle must place the new rows identically.
        fresh = make_inputs(rng, num_tokens, num_experts, num_topk, hidden, payload=payload)
        inp2 = dict(inp, xs=fresh["xs"], scales=fresh["scales"])
        hier2 = ref.hierarchical_dispatch(inp2["xs"], inp["idx"], inp["w"], num_experts,
                                          num_nodes, x_scales=inp2["scales"],
                                          expert_alignment=alignment)
        _poison(group)
        results2 = run_dispatch(group, inp2, worst=worst, cached=results, num_sms=num_sms)
        check_hierarchical_dispatch(group, results2, hier2, worst=worst, meta=False)
    if payload != "f32":
        differs["rounding"] = run_and_check_hierarchical_combine(
            group, rng, results, hier, flat, num_tokens, hidden, worst=worst, bias=bias,
            num_sms=num_sms)
    return differs


def hierarchical_case(rng: np.random.Generator, num_tokens: list[int], num_experts: int,
                      num_topk: int, hidden: int, num_nodes: int, *, payload: str = "bf16",
                      alignment: int = 1, **routing: Any
                      ) -> tuple[dict[str, Any], Any, list[Any], dict[str, bool]]:
    """Inputs of one hierarchical case, their hierarchical and flat reference dispatches, and
    where the two differ (row order, recv_src_idx; "rounding" is for the combine to say)."""
    inp = make_inputs(rng, num_tokens, num_experts, num_topk, hidden, payload=payload,
                      **routing)
    hier = ref.hierarchical_dispatch(inp["xs"], inp["idx"], inp["w"], num_experts, num_nodes,
                                     x_scales=inp["scales"], expert_alignment=alignment)
    flat = ref.dispatch(inp["xs"], inp["idx"], inp["w"], num_experts, x_scales=inp["scales"],
                        expert_alignment=alignment)
    r = len(num_tokens)
    differs = {
        "order": any(not np.array_equal(hier.sources(d)[0], flat[d].recv_src_rank)
                     for d in range(r)),
        "src_idx": any(not np.array_equal(hier.received(d).recv_src_idx, flat[d].recv_src_idx)
                       for d in range(r)),
        "rounding": False}
    return inp, hier, flat, differs


def flat_rows(y: np.ndarray, hier: Any, flat_d: Any, d: int) -> np.ndarray:
    """Rank d's expert outputs `y` (in the hierarchical rows' order) in the flat reference's
    row order: the same output per (source rank, token)."""
    src_rank, src_idx = hier.sources(d)
    where = {(int(s), int(t)): i for i, (s, t) in enumerate(zip(src_rank, src_idx, strict=True))}
    return y[[where[(int(s), int(t))] for s, t in zip(flat_d.recv_src_rank, flat_d.recv_src_idx,
                                                      strict=True)]]


def told_apart(pe: int, per_pe: int, differs: dict[str, bool]) -> int:
    """1 (and a line) unless the cases gave results the flat semantics would not: other
    recv_src_idx, and with more than one rank per node other row order and combine bits."""
    want = {"src_idx"} | ({"order", "rounding"} if per_pe > 1 else set())
    missing = sorted(w for w in want if not differs[w])
    if missing:
        print(f"PE {pe}: FAILED: the flat reference agrees with the hierarchical one in "
              f"{missing}: the test could not tell them apart", flush=True)
        return 1
    return 0


def check_hierarchical_dispatch(group: Any, results: dict[int, Any], hier: Any, *,
                                worst: int = 0, meta: bool = True) -> None:
    """Every output of the ranks this process drives against `hier.received(rank)`; the rows'
    recv_src_rank (an internal buffer, not an output of the engine) holds the original source
    rank, `hier.sources(rank)`; rank_prefix_matrix keeps its counts by original rank."""
    r = hier.num_nodes * hier.ranks_per_node
    for d, runner in ranks_of(group):
        src_rank = hier.sources(d)[0]
        counts = np.bincount(src_rank[src_rank >= 0], minlength=r)
        _check_rank_outputs(runner.outputs(results[d]), d, hier.received(d), src_rank,
                            np.cumsum(counts), worst, meta)


def run_and_check_hierarchical_combine(group: Any, rng: np.random.Generator,
                                       results: dict[int, Any], hier: Any, flat: list[Any],
                                       num_tokens: list[int], hidden: int, *, worst: int = 0,
                                       bias: bool = False, num_sms: int = 8) -> bool:
    """Combine of every rank this process drives against `ref.hierarchical_combine`; returns
    whether the flat `ref.combine` of the same rows (in flat order) gives other bits."""
    r = len(num_tokens)
    rds = [hier.received(d) for d in range(r)]
    rows = [worst or rd.recv_x.shape[0] for rd in rds]
    ys = [ref.random_x(rng, n, hidden, BFLOAT16) for n in rows]  # (padding rows: never read)
    b0 = [ref.random_x(rng, t, hidden, BFLOAT16) for t in num_tokens] if bias else None
    b1 = [ref.random_x(rng, t, hidden, BFLOAT16) for t in num_tokens] if bias else None
    real = [y[:rd.recv_x.shape[0]] for y, rd in zip(ys, rds, strict=True)]
    want = ref.hierarchical_combine(real, hier, num_tokens,
                                    recv_topk_weights=[rd.recv_topk_weights for rd in rds],
                                    bias_0=b0, bias_1=b1)
    flat_want = ref.combine([flat_rows(real[d], hier, flat[d], d) for d in range(r)], flat,
                            num_tokens, bias_0=b0, bias_1=b1)
    rounding = any(not np.array_equal(raw(a[0]), raw(b[0]))
                   for a, b in zip(want, flat_want, strict=True))
    weights = [(ref.pad_to_worst(rd, worst) if worst else rd).recv_topk_weights for rd in rds]
    _combine_exact(group, results, ys, weights, b0, b1, num_tokens, hidden, want, num_sms)
    return rounding


def _combine_exact(group: Any, results: dict[int, Any], ys: list[np.ndarray],
                   weights: list[np.ndarray], b0: list[np.ndarray] | None,
                   b1: list[np.ndarray] | None, num_tokens: list[int], hidden: int,
                   want: list[Any], num_sms: int) -> None:
    """Combine on every rank this process drives (every rank's inputs uploaded and outputs
    poisoned before any launch, as in run_dispatch), outputs and weights bit-exact against
    `want` (the reference's (rows, weights) per rank)."""
    import cupy as cp

    outs, inputs = {}, {}
    for r, runner in ranks_of(group):
        with cp.cuda.Device(runner.device_id), runner.stream:
            w = cp.asarray(weights[r])
            inputs[r] = (cp.asarray(raw(ys[r])), w,
                         None if b0 is None else cp.asarray(raw(b0[r])),
                         None if b1 is None else cp.asarray(raw(b1[r])))
            outs[r] = (cp.full((num_tokens[r], hidden), 0xFFFF, cp.uint16),  # poison: NaN
                       cp.full((num_tokens[r], w.shape[1]), np.nan, cp.float32))
    group.synchronize()
    for r, runner in ranks_of(group):
        y, w, bias_0, bias_1 = inputs[r]
        with cp.cuda.Device(runner.device_id), runner.stream:
            runner.combine(y, results[r], outs[r][0], recv_topk_weights=w,
                           out_weights=outs[r][1], bias_0=bias_0, bias_1=bias_1,
                           timeout_ns=TIMEOUT_NS, num_sms=num_sms)
    group.synchronize()
    _assert_no_error(group)
    for r in outs:
        np.testing.assert_array_equal(cp.asnumpy(outs[r][0]), raw(want[r][0]))
        np.testing.assert_array_equal(cp.asnumpy(outs[r][1]).view(np.uint32),
                                      want[r][1].view(np.uint32))


def ll_roundtrip(g: Any, rng: np.random.Generator, tokens: list[int], e: int, k: int, h: int,
                 m: int, *, fp8: bool = False, round_scale: bool = False, drop: float = 0.0,
                 combine_drop: float = 0.0, num_sms: int = 16, buffer: int = 0,
                 spoil: Any = None) -> None:
    """One low-latency dispatch + combine of the ranks `g` drives (ranks_of: every rank of a
    LocalGroup, one PE's of a multi-process group), fresh inputs of every rank from `rng`,
    outputs poisoned first, everything bit-exact against the reference. A group with a
    `barrier` (several processes) waits there between poisoning and launching. Every rank's
    combine verdict must be none, or with `spoil(comb_idx, idxs)` -> (sent, reference,
    verdicts): the combine gets `sent`, the reference `reference` (a spoiled entry left out)
    and rank s's verdict must be verdicts[s] (code, rank, token, id)."""
    import cupy as cp

    r = len(tokens)
    lx = e // r
    routes = [ref.random_routing(rng, t, e, k, drop_prob=drop) for t in tokens]
    idxs = [i for i, _ in routes]
    ws = [w for _, w in routes]  # (the router's weights, for the combine too)
    xs = [ref.random_x(rng, t, h, BFLOAT16) for t in tokens]
    _poison(g)
    mine = ranks_of(g)
    # Every rank's inputs on the device before any rank launches (as run_dispatch: an upload
    # between two ranks' launches can wait for the first's kernel, which spins on the second;
    # the likely cause of the 8-ranks-per-PE failure across logical nodes, ninth session).
    ins = {}
    for s, runner in mine:
        with cp.cuda.Device(runner.device_id), runner.stream:
            ins[s] = (cp.asarray(raw(xs[s])), cp.asarray(idxs[s]))
    g.synchronize()
    for s, runner in mine:
        with cp.cuda.Device(runner.device_id), runner.stream:
            runner.ll_dispatch(*ins[s], m, fp8=fp8, round_scale=round_scale,
                               timeout_ns=TIMEOUT_NS, num_sms=num_sms, buffer=buffer)
    g.synchronize()
    for _, runner in mine:
        assert runner.error() is None, runner.error()
    want = ref.low_latency_dispatch(xs, idxs, e, m, use_fp8=fp8, round_scale=round_scale)
    for d, runner in mine:
        with cp.cuda.Device(runner.device_id):
            out = {n: cp.asnumpy(a) for n, a in runner.ll_outputs(m, fp8, buffer).items()}
        check_ll_dispatch(out, want[d], fp8)
    # Combine: fresh expert outputs in the valid rows, NaN beyond them (must never be read);
    # some entries dropped only at combine time. (The reference reads only the rows below the
    # counts, which check_ll_dispatch found equal to the GPU's.)
    ys, comb_idx = ll_combine_inputs(rng, want, idxs, lx, m, h, combine_drop)
    verdicts: dict[int, tuple] = {}
    if spoil is not None:
        comb_idx, ref_idx, verdicts = spoil(comb_idx, idxs)
    expected = ref.low_latency_combine(ys, want, ref_idx if spoil else comb_idx, ws, e)
    outs, ins = {}, {}
    for s, runner in mine:  # (inputs and poisoned outputs first, as for the dispatch)
        with cp.cuda.Device(runner.device_id), runner.stream:
            ins[s] = (cp.asarray(raw(ys[s])), cp.asarray(comb_idx[s]), cp.asarray(ws[s]))
            outs[s] = cp.full((tokens[s], h), 0xFFFF, cp.uint16)  # poison: NaN
    g.synchronize()
    for s, runner in mine:
        with cp.cuda.Device(runner.device_id), runner.stream:
            runner.ll_combine(*ins[s], outs[s], m, timeout_ns=TIMEOUT_NS, num_sms=num_sms,
                              buffer=buffer)
    g.synchronize()
    for s, runner in mine:
        assert runner.error() is None, runner.error()  # (a combine's verdict aborts nothing)
        got = take_combine_verdict(runner, buffer)
        assert got == verdicts.get(s, (0, 0, 0, 0)), (s, got)
    for s, out in outs.items():
        np.testing.assert_array_equal(cp.asnumpy(out), raw(expected[s]))


def take_combine_verdict(runner: Any, buffer: int = 0) -> tuple[int, int, int, int]:
    """(code, rank, token, id) of the combine verdict in a receive buffer's header (a bad entry
    of the rank's own combine top-k; zeros: none), cleared as the done kernel of a
    stream-ordered combine clears it (the synchronous runner has none)."""
    import cupy as cp

    from epd.proto import abi, counter_page

    with cp.cuda.Device(runner.device_id):
        words = runner.ll_view("topk", (abi.LL_TOPK_HEADER // 8,), np.uint64, buffer)
        got = counter_page.ll_header_verdict(cp.asnumpy(words)[abi.LL_COMBINE_VERDICT:])
        words[abi.LL_COMBINE_VERDICT + 1:abi.LL_COMBINE_VERDICT + 2].fill(0)
        cp.cuda.Device(runner.device_id).synchronize()
    return got


def check_ll_dispatch(out: dict[str, np.ndarray], exp: Any, fp8: bool) -> None:
    """One rank's low-latency dispatch outputs (host copies of RankRunner.ll_outputs) against
    the reference's: counts, then per local expert the valid rows bit-exact (source rank and
    token, payload, FP8 scales) and -1 beyond them."""
    np.testing.assert_array_equal(out["recv_count"], exp.recv_count)
    for le in range(len(exp.recv_count)):
        c = int(exp.recv_count[le])
        np.testing.assert_array_equal(out["recv_src_rank"][le][:c], exp.recv_src_rank[le][:c])
        np.testing.assert_array_equal(out["recv_src_idx"][le][:c], exp.recv_src_idx[le][:c])
        np.testing.assert_array_equal(raw(out["recv_x"][le][:c]), raw(exp.recv_x[le][:c]))
        if fp8:
            np.testing.assert_array_equal(out["recv_x_scales"][le][:c].view(np.uint32),
                                          exp.recv_x_scales[le][:c].view(np.uint32))
        assert (out["recv_src_rank"][le][c:] == -1).all()
        assert (out["recv_src_idx"][le][c:] == -1).all()


def ll_combine_inputs(rng: np.random.Generator, dispatched: list[Any], idxs: list[np.ndarray],
                      lx: int, m: int, h: int, combine_drop: float
                      ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(expert outputs, combine topk_idx) of every rank: fresh rows in the valid rows, NaN
    beyond them (never to be read); entries dropped at combine time with `combine_drop`."""
    r = len(dispatched)
    ys = []
    for d in range(r):
        y = np.full((lx, r * m, h), 0xFFFF, np.uint16).view(BFLOAT16)
        for le in range(lx):
            c = int(dispatched[d].recv_count[le])
            y[le, :c] = ref.random_x(rng, c, h, BFLOAT16) if c else y[le, :0]
        ys.append(y)
    comb_idx = []
    for i in idxs:
        c = i.copy()
        c[rng.random(c.shape) < combine_drop] = -1
        comb_idx.append(c)
    return ys, comb_idx
