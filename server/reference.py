"""Executable specification of EPD's DeepEP-compatible semantics: what every backend computes.

Plain NumPy, written for clarity rather than speed. Every backend (CPU, GPU) is tested against
these functions, so they validate their inputs and follow the documented rules exactly:

* normal mode: ``get_dispatch_layout``, ``dispatch``, ``pad_to_worst`` (num_worst_tokens mode),
  ``combine``;
* low-latency mode: ``low_latency_dispatch``, ``low_latency_combine``, ``quantize_fp8``;
* workload generators shared by tests, demo and benchmarks: ``random_routing``, ``random_x``.

Lists are indexed by rank: ``xs[s]`` is what rank ``s`` holds. Accumulation is in float32 and
the cast back uses ml_dtypes (round-to-nearest-even), as the GPU kernels do.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..proto.dtypes import BFLOAT16, FLOAT8_E4M3, FP8_BLOCK

__all__ = [
    "FP8_MAX",
    "Layout",
    "LowLatencyDispatch",
    "RankDispatch",
    "combine",
    "dispatch",
    "fma_f32",
    "get_dispatch_layout",
    "low_latency_combine",
    "low_latency_dispatch",
    "pad_to_worst",
    "quantize_fp8",
    "random_routing",
    "random_x",
]

FP8_MAX = 448.0  # largest finite float8_e4m3fn
_FP8_AMAX_MIN = 1e-4
_PAYLOAD_DTYPES = (BFLOAT16, np.dtype(np.float16), np.dtype(np.float32), FLOAT8_E4M3)
_COMPUTE_DTYPES = (BFLOAT16, np.dtype(np.float16), np.dtype(np.float32))


# --------------------------------------------------------------------------------------------
# arithmetic
# --------------------------------------------------------------------------------------------

def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a * b + c in float32 with one rounding (to nearest even), as the GPU's fmaf.

    DeepEP's low-latency combine accumulates `acc += float(x) * w`, which nvcc contracts into
    one fused multiply-add (its default --fmad=true), so EPD's kernel and this reference do too.
    NumPy has no fused multiply-add: the product of two float32 is exact in float64, and the
    float64 sum rounded to float32 is the correctly rounded result unless that sum was itself
    rounded onto a float32 midpoint (or into float32's subnormal range, where fewer bits are
    kept). Only those elements are redone: their float64 sum is rounded to odd (TwoSum gives
    its exact error; an inexact result with an even last bit moves one float64 ulp towards the
    error), which rounds to float32 correctly, as rounding to odd with 2 or more extra bits
    cannot round twice."""
    with np.errstate(invalid="ignore", over="ignore"):  # (inf - inf: not a candidate below)
        p = np.asarray(a, np.float32).astype(np.float64) * np.asarray(b, np.float32)
        c64 = np.asarray(c, np.float32).astype(np.float64)
        s = np.asarray(p + c64)
        # float64 -> float32 drops 29 mantissa bits of a normal result: a midpoint keeps
        # exactly the highest of them
        bits = s.view(np.int64)
        maybe = (bits & 0x1FFFFFFF) == 0x10000000
        maybe |= np.abs(s) < 2.0 ** -126
        if np.any(maybe):
            p, c64 = np.broadcast_arrays(p, c64)
            ps, cs, ss = p[maybe], c64[maybe], s[maybe]
            bb = ss - ps
            err = (ps - (ss - bb)) + (cs - bb)
            odd = np.isfinite(ss) & (err != 0) & ((ss.view(np.int64) & 1) == 0)
            s[maybe] = np.where(odd, np.nextafter(ss, np.where(err > 0, np.inf, -np.inf)), ss)
        return s.astype(np.float32)


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------

def _check_experts(num_experts: int, num_ranks: int) -> int:
    """Validate the expert/rank split and return L, the number of local experts per rank."""
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of num_ranks "
                         f"({num_ranks})")
    return num_experts // num_ranks


def _check_topk_idx(topk_idx: np.ndarray, num_experts: int, what: str = "topk_idx") -> np.ndarray:
    """Return topk_idx as int64 [T, K] after checking its shape and that ids lie in [-1, E)."""
    arr = np.asarray(topk_idx)
    if arr.ndim != 2:
        raise ValueError(f"{what} must be 2-D [num_tokens, num_topk], got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must have an integer dtype, got {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = (arr < -1) | (arr >= num_experts)
    if bad.any():
        t, k = np.argwhere(bad)[0]
        raise ValueError(f"{what}[{t}, {k}] = {arr[t, k]} is out of range [-1, {num_experts})")
    return arr


def _check_weights(weights: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
    """Return weights as float32 after checking they have the given shape."""
    arr = np.asarray(weights)
    if arr.shape != shape:
        raise ValueError(f"{what} has shape {arr.shape}, expected {shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{what} must have a floating dtype, got {arr.dtype}")
    return arr.astype(np.float32)


def _check_scales(x_scales: list, xs: list[np.ndarray], hidden: int) -> list[np.ndarray]:
    """FP8 scales per rank, [T_s, S]: floating ones as float32, or int32 words (e.g. packed
    UE8M0 exponents, vLLM's MXFP8) kept bit for bit; every rank's of one dtype and one width S
    (any S >= 1, as DeepEP's: per token [T, 1], per 128 channels [T, hidden/128], packed
    [T, hidden/512]; carried with their rows, never read)."""
    del hidden  # (the width is the caller's; the daemon bounds it by its buffers)
    out = []
    widths = set()
    for s, sc in enumerate(x_scales):
        arr = np.asarray(sc)
        if arr.ndim != 2 or arr.shape[0] != xs[s].shape[0] or arr.shape[1] < 1:
            raise ValueError(f"x_scales[{s}] has shape {arr.shape}, expected "
                             f"({xs[s].shape[0]}, S) with S >= 1")
        widths.add(arr.shape[1])
        if arr.dtype == np.int32:
            out.append(arr)
        elif np.issubdtype(arr.dtype, np.floating) or not arr.size:
            out.append(arr.astype(np.float32))
        else:
            raise ValueError(f"x_scales[{s}] must be floating or int32, got {arr.dtype}")
    if len(widths) > 1:
        raise ValueError(f"x_scales differ in width across ranks: {sorted(widths)}")
    kinds = {a.dtype for a in out if a.size}
    if len(kinds) > 1:
        raise ValueError(f"x_scales mix dtypes across ranks: {sorted(str(k) for k in kinds)}")
    kind = kinds.pop() if kinds else np.dtype(np.float32)
    return [a.astype(kind, copy=False) for a in out]


def _check_rank_list(name: str, values: list, num_ranks: int) -> None:
    if len(values) != num_ranks:
        raise ValueError(f"{name} has {len(values)} entries, expected one per rank ({num_ranks})")


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# --------------------------------------------------------------------------------------------
# normal mode
# --------------------------------------------------------------------------------------------

@dataclass
class Layout:
    """Dispatch layout of one source rank (DeepEP ``get_dispatch_layout``)."""

    num_tokens_per_rank: np.ndarray    # [R] int32, tokens with >=1 expert on rank r (once per rank)
    num_tokens_per_expert: np.ndarray  # [E] int32, (token,k) pairs per expert
    is_token_in_rank: np.ndarray       # [T, R] bool
    # [R / ranks_per_node] int32, tokens with >=1 expert on a rank of node n (DeepEP's
    # num_tokens_per_rdma_rank; rank r on node r // ranks_per_node). None on one node.
    num_tokens_per_rdma_rank: np.ndarray | None = None


def tokens_per_node(is_token_in_rank: np.ndarray, rank_nodes: list[int]) -> np.ndarray:
    """Tokens with at least one expert on a rank of each node: [number of distinct nodes]
    int32, in ascending node order (DeepEP's num_tokens_per_rdma_rank for any placement)."""
    in_rank = np.asarray(is_token_in_rank, dtype=bool)
    nodes = np.asarray(rank_nodes)
    if in_rank.ndim != 2 or in_rank.shape[1] != nodes.size:
        raise ValueError(f"is_token_in_rank of shape {list(in_rank.shape)} does not match "
                         f"{nodes.size} ranks")
    return np.array([int(in_rank[:, nodes == n].any(axis=1).sum()) for n in np.unique(nodes)],
                    dtype=np.int32)


def get_dispatch_layout(topk_idx: np.ndarray, num_experts: int, num_ranks: int,
                        num_ranks_per_node: int = 0) -> Layout:
    """Count, for one source rank, the tokens per destination rank and the pairs per expert;
    with `num_ranks_per_node` < num_ranks (a group over several nodes, ranks laid out node
    by node as in DeepEP) also the tokens per destination node."""
    local = _check_experts(num_experts, num_ranks)
    idx = _check_topk_idx(topk_idx, num_experts)
    num_tokens = idx.shape[0]

    valid = idx >= 0
    num_tokens_per_expert = np.bincount(idx[valid], minlength=num_experts).astype(np.int32)

    is_token_in_rank = np.zeros((num_tokens, num_ranks), dtype=bool)
    tokens, ks = np.nonzero(valid)
    is_token_in_rank[tokens, idx[tokens, ks] // local] = True
    num_tokens_per_rank = is_token_in_rank.sum(axis=0).astype(np.int32)
    per_node = None
    if 0 < num_ranks_per_node < num_ranks:
        if num_ranks % num_ranks_per_node:
            raise ValueError(f"num_ranks {num_ranks} is not a multiple of num_ranks_per_node "
                             f"{num_ranks_per_node}")
        per_node = tokens_per_node(is_token_in_rank,
                                   [r // num_ranks_per_node for r in range(num_ranks)])
    return Layout(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, per_node)


@dataclass
class RankDispatch:
    """What destination rank d receives from all sources in normal dispatch."""

    recv_x: np.ndarray                 # [N, H], dtype of x (carried bit-exactly)
    recv_x_scales: np.ndarray | None   # [N, S] float32 or int32 (as x_scales) when given
    recv_topk_idx: np.ndarray | None   # [N, K] int64: local expert id e - d*L, else -1
    recv_topk_weights: np.ndarray | None  # [N, K] float32: weight where e lives on d, else 0
    # (both None for a dispatch without top-k)
    num_recv_tokens_per_expert: list[int]  # [L] pairs per local expert, rounded up to alignment
    recv_src_rank: np.ndarray          # [N] int32 source rank of each row
    recv_src_idx: np.ndarray           # [N] int32 source token index of each row
    src_offsets: np.ndarray            # [R+1] int64: rows from source s are [off[s], off[s+1])


def dispatch(xs: list[np.ndarray], topk_idx: list[np.ndarray] | None,
             topk_weights: list[np.ndarray] | None, num_experts: int, *,
             x_scales: list[np.ndarray] | None = None, expert_alignment: int = 1,
             is_token_in_rank: list[np.ndarray] | None = None,
             num_tokens_per_expert: list[np.ndarray] | None = None) -> list[RankDispatch]:
    """Normal (high-throughput) dispatch; returns one ``RankDispatch`` per destination rank.

    Rows on each destination are ordered by source rank, then source token index; a token
    appears once per destination rank holding any of its experts (not once per expert).

    Without top-k (DeepEP's ``topk_idx=None``: topk_idx and topk_weights None), the routing is
    ``is_token_in_rank[s]`` (bool [T_s, R]) alone: same row order, recv_topk_idx and
    recv_topk_weights are None, and ``num_recv_tokens_per_expert`` of rank d is the sum over
    sources of ``num_tokens_per_expert[s][d*L:(d+1)*L]`` (int [E], as the sources declare
    them: DeepEP's notify sums them without looking at any top-k), rounded up to
    expert_alignment.
    """
    num_ranks = len(xs)
    local = _check_experts(num_experts, num_ranks)
    if topk_idx is None:
        return _dispatch_without_topk(xs, topk_weights, num_experts, x_scales,
                                      expert_alignment, is_token_in_rank, num_tokens_per_expert)
    if is_token_in_rank is not None or num_tokens_per_expert is not None:
        raise ValueError("is_token_in_rank/num_tokens_per_expert are for dispatch without "
                         "top-k; with topk_idx the layout follows from it")
    _check_rank_list("topk_idx", topk_idx, num_ranks)
    if topk_weights is None:
        raise ValueError("topk_weights must be given with topk_idx")
    _check_rank_list("topk_weights", topk_weights, num_ranks)
    if expert_alignment < 1:
        raise ValueError(f"expert_alignment must be >= 1, got {expert_alignment}")

    xs, hidden, dtype = _check_payloads(xs)

    idxs = [_check_topk_idx(topk_idx[s], num_experts, f"topk_idx[{s}]") for s in range(num_ranks)]
    num_topk = idxs[0].shape[1]
    for s, idx in enumerate(idxs):
        if idx.shape != (xs[s].shape[0], num_topk):
            raise ValueError(f"topk_idx[{s}] has shape {idx.shape}, expected "
                             f"{(xs[s].shape[0], num_topk)} (tokens of xs[{s}], num_topk)")
    weights = [_check_weights(topk_weights[s], idxs[s].shape, f"topk_weights[{s}]")
               for s in range(num_ranks)]

    scales = _check_fp8_scales(x_scales, xs, hidden, dtype)

    layouts = [get_dispatch_layout(idx, num_experts, num_ranks) for idx in idxs]

    out: list[RankDispatch] = []
    for d in range(num_ranks):
        lo, hi = d * local, (d + 1) * local
        parts_x, parts_scales, parts_idx, parts_w, parts_rank, parts_src = [], [], [], [], [], []
        offsets = [0]
        for s in range(num_ranks):
            tokens = np.nonzero(layouts[s].is_token_in_rank[:, d])[0]  # ascending token index
            idx = idxs[s][tokens]
            here = (idx >= lo) & (idx < hi)
            parts_x.append(xs[s][tokens])
            if scales is not None:
                parts_scales.append(scales[s][tokens])
            parts_idx.append(np.where(here, idx - lo, -1))
            parts_w.append(np.where(here, weights[s][tokens], np.float32(0)))
            parts_rank.append(np.full(len(tokens), s, dtype=np.int32))
            parts_src.append(tokens.astype(np.int32))
            offsets.append(offsets[-1] + len(tokens))

        recv_topk_idx = np.concatenate(parts_idx).astype(np.int64).reshape(-1, num_topk)
        counts = np.bincount(recv_topk_idx[recv_topk_idx >= 0], minlength=local)
        out.append(RankDispatch(
            recv_x=np.concatenate(parts_x).reshape(-1, hidden).astype(dtype, copy=False),
            recv_x_scales=(None if scales is None else
                           np.concatenate(parts_scales).reshape(-1, scales[0].shape[1])),
            recv_topk_idx=recv_topk_idx,
            recv_topk_weights=np.concatenate(parts_w).astype(np.float32).reshape(-1, num_topk),
            num_recv_tokens_per_expert=[_ceil_to(int(c), expert_alignment) for c in counts],
            recv_src_rank=np.concatenate(parts_rank).astype(np.int32),
            recv_src_idx=np.concatenate(parts_src).astype(np.int32),
            src_offsets=np.array(offsets, dtype=np.int64),
        ))
    return out


def _check_payloads(xs: list[np.ndarray]) -> tuple[list[np.ndarray], int, np.dtype]:
    xs = [np.asarray(x) for x in xs]
    for s, x in enumerate(xs):
        if x.ndim != 2:
            raise ValueError(f"xs[{s}] must be 2-D [num_tokens, hidden], got shape {x.shape}")
        if x.dtype not in _PAYLOAD_DTYPES:
            raise ValueError(f"xs[{s}] has dtype {x.dtype}; expected one of "
                             f"{[str(d) for d in _PAYLOAD_DTYPES]}")
    hidden, dtype = xs[0].shape[1], xs[0].dtype
    for s, x in enumerate(xs):
        if x.shape[1] != hidden or x.dtype != dtype:
            raise ValueError(f"xs[{s}] is {x.dtype}[*, {x.shape[1]}] but xs[0] is "
                             f"{dtype}[*, {hidden}]; all ranks must agree")
    return xs, hidden, dtype


def _check_fp8_scales(x_scales: list[np.ndarray] | None, xs: list[np.ndarray], hidden: int,
                      dtype: np.dtype) -> list[np.ndarray] | None:
    """The FP8 scales of every rank (None without FP8), checked against the payloads."""
    if x_scales is None:
        return None
    _check_rank_list("x_scales", x_scales, len(xs))
    if dtype != FLOAT8_E4M3:
        raise ValueError(f"x_scales are only meaningful with float8_e4m3fn x, got {dtype}")
    if hidden % FP8_BLOCK != 0:
        raise ValueError(f"hidden ({hidden}) must be a multiple of {FP8_BLOCK} for FP8")
    return _check_scales(x_scales, xs, hidden)


def _dispatch_without_topk(xs: list[np.ndarray], topk_weights: list[np.ndarray] | None,
                           num_experts: int, x_scales: list[np.ndarray] | None,
                           expert_alignment: int, is_token_in_rank: list[np.ndarray] | None,
                           num_tokens_per_expert: list[np.ndarray] | None
                           ) -> list[RankDispatch]:
    """``dispatch`` routed by is_token_in_rank alone (see there)."""
    num_ranks = len(xs)
    local = _check_experts(num_experts, num_ranks)
    if topk_weights is not None:
        raise ValueError("topk_weights without topk_idx")
    if is_token_in_rank is None or num_tokens_per_expert is None:
        raise ValueError("dispatch without top-k needs is_token_in_rank and "
                         "num_tokens_per_expert")
    _check_rank_list("is_token_in_rank", is_token_in_rank, num_ranks)
    _check_rank_list("num_tokens_per_expert", num_tokens_per_expert, num_ranks)
    if expert_alignment < 1:
        raise ValueError(f"expert_alignment must be >= 1, got {expert_alignment}")
    xs, hidden, dtype = _check_payloads(xs)
    in_rank = []
    for s, m in enumerate(is_token_in_rank):
        m = np.asarray(m)
        if m.shape != (xs[s].shape[0], num_ranks) or m.dtype != np.bool_:
            raise ValueError(f"is_token_in_rank[{s}] is {m.dtype}{list(m.shape)}, expected "
                             f"bool[{xs[s].shape[0]}, {num_ranks}]")
        in_rank.append(m)
    per_expert = []
    for s, c in enumerate(num_tokens_per_expert):
        c = np.asarray(c)
        if c.shape != (num_experts,) or not np.issubdtype(c.dtype, np.integer) or \
                (c.size and c.min() < 0):
            raise ValueError(f"num_tokens_per_expert[{s}] must be non-negative integers "
                             f"[{num_experts}], got {c.dtype}{list(c.shape)}")
        per_expert.append(c.astype(np.int64))
    scales = _check_fp8_scales(x_scales, xs, hidden, dtype)
    out: list[RankDispatch] = []
    for d in range(num_ranks):
        rows = [np.nonzero(in_rank[s][:, d])[0] for s in range(num_ranks)]  # ascending
        offsets = np.concatenate([[0], np.cumsum([len(t) for t in rows])]).astype(np.int64)
        counts = sum(c[d * local:(d + 1) * local] for c in per_expert)
        out.append(RankDispatch(
            recv_x=np.concatenate([xs[s][t] for s, t in enumerate(rows)]).reshape(-1, hidden)
            .astype(dtype, copy=False),
            recv_x_scales=(None if scales is None else np.concatenate(
                [scales[s][t] for s, t in enumerate(rows)]).reshape(-1, scales[0].shape[1])),
            recv_topk_idx=None, recv_topk_weights=None,
            num_recv_tokens_per_expert=[_ceil_to(int(c), expert_alignment) for c in counts],
            recv_src_rank=np.concatenate([np.full(len(t), s, np.int32)
                                          for s, t in enumerate(rows)]).astype(np.int32),
            recv_src_idx=np.concatenate(rows).astype(np.int32),
            src_offsets=offsets))
    return out


def pad_to_worst(rd: RankDispatch, num_worst_tokens: int) -> RankDispatch:
    """num_worst_tokens mode: pad every per-row output of ``rd`` to exactly that many rows.

    Padding rows have recv_x zero (scales zero), recv_topk_idx -1, recv_topk_weights 0 and
    recv_src_rank/recv_src_idx -1. ``num_recv_tokens_per_expert`` and ``src_offsets`` are kept
    (they describe the real rows, which stay first).
    """
    n = rd.recv_x.shape[0]
    if num_worst_tokens < 0:
        raise ValueError(f"num_worst_tokens must be >= 0, got {num_worst_tokens}")
    if n > num_worst_tokens:
        raise ValueError(f"received {n} tokens, more than num_worst_tokens ({num_worst_tokens})")

    def pad(arr: np.ndarray, fill: float | int) -> np.ndarray:
        res = np.full((num_worst_tokens, *arr.shape[1:]), fill, dtype=arr.dtype)
        res[:n] = arr
        return res

    recv_x = np.zeros((num_worst_tokens, *rd.recv_x.shape[1:]), dtype=rd.recv_x.dtype)
    recv_x[:n] = rd.recv_x
    return RankDispatch(
        recv_x=recv_x,
        recv_x_scales=None if rd.recv_x_scales is None else pad(rd.recv_x_scales, 0.0),
        recv_topk_idx=None if rd.recv_topk_idx is None else pad(rd.recv_topk_idx, -1),
        recv_topk_weights=(None if rd.recv_topk_weights is None else
                           pad(rd.recv_topk_weights, 0.0)),
        num_recv_tokens_per_expert=list(rd.num_recv_tokens_per_expert),
        recv_src_rank=pad(rd.recv_src_rank, -1),
        recv_src_idx=pad(rd.recv_src_idx, -1),
        src_offsets=rd.src_offsets.copy(),
    )


def combine(ys: list[np.ndarray], dispatched: list[RankDispatch], num_tokens: list[int], *,
            recv_topk_weights: list[np.ndarray] | None = None,
            bias_0: list[np.ndarray] | None = None, bias_1: list[np.ndarray] | None = None
            ) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Normal combine: the reverse of ``dispatch``; returns (out, combined_topk_weights) per rank.

    For token t of rank s: acc = fp32(bias_0) + fp32(bias_1) (zeros when absent), then add
    fp32(ys[d][row of t on d]) for d ascending, then cast to ys' dtype. No expert weights are
    applied. combined_topk_weights sums recv_topk_weights rows the same way (None if not given).
    Rows of ``dispatched`` with recv_src_rank == -1 (pad_to_worst padding) are ignored.
    """
    num_ranks = len(dispatched)
    if num_ranks == 0:
        raise ValueError("dispatched must have one entry per rank, got none")
    _check_rank_list("ys", ys, num_ranks)
    _check_rank_list("num_tokens", num_tokens, num_ranks)
    if recv_topk_weights is not None:
        _check_rank_list("recv_topk_weights", recv_topk_weights, num_ranks)
    ys = [np.asarray(y) for y in ys]
    hidden, dtype = None, None
    for d, (y, rd) in enumerate(zip(ys, dispatched, strict=True)):
        if y.ndim != 2 or y.shape[0] != rd.recv_x.shape[0]:
            raise ValueError(f"ys[{d}] has shape {y.shape}, expected [{rd.recv_x.shape[0]}, "
                             f"hidden] (one row per dispatched row)")
        if y.dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"ys[{d}] has dtype {y.dtype}; expected one of "
                             f"{[str(t) for t in _COMPUTE_DTYPES]}")
        if hidden is None:
            hidden, dtype = y.shape[1], y.dtype
        elif (y.shape[1], y.dtype) != (hidden, dtype):
            raise ValueError(f"ys[{d}] is {y.dtype}[*, {y.shape[1]}] but ys[0] is "
                             f"{dtype}[*, {hidden}]; all ranks must agree")
    weights = None
    if recv_topk_weights is not None:
        if dispatched[0].recv_topk_idx is not None:
            num_topk = dispatched[0].recv_topk_idx.shape[1]
        else:  # a dispatch without top-k: the weights say their own width
            num_topk = np.asarray(recv_topk_weights[0]).shape[1]
        weights = [_check_weights(recv_topk_weights[d], (ys[d].shape[0], num_topk),
                                  f"recv_topk_weights[{d}]") for d in range(num_ranks)]
    for s, t in enumerate(num_tokens):
        if t < 0:
            raise ValueError(f"num_tokens[{s}] must be >= 0, got {t}")
    for d, rd in enumerate(dispatched):
        for s in range(num_ranks):
            src = rd.recv_src_idx[rd.recv_src_rank == s]
            if src.size and (src.min() < 0 or src.max() >= num_tokens[s]):
                raise ValueError(f"dispatched[{d}] has a row from rank {s} with source index "
                                 f"outside [0, {num_tokens[s]})")
        if np.any((rd.recv_src_rank < -1) | (rd.recv_src_rank >= num_ranks)):
            raise ValueError(f"dispatched[{d}].recv_src_rank holds a rank outside [-1, "
                             f"{num_ranks})")

    def bias(which: list[np.ndarray] | None, name: str, s: int) -> np.ndarray | None:
        if which is None:
            return None
        _check_rank_list(name, which, num_ranks)
        b = np.asarray(which[s])
        if b.shape != (num_tokens[s], hidden):
            raise ValueError(f"{name}[{s}] has shape {b.shape}, expected "
                             f"{(num_tokens[s], hidden)}")
        return b.astype(np.float32)

    results: list[tuple[np.ndarray, np.ndarray | None]] = []
    for s in range(num_ranks):
        acc = np.zeros((num_tokens[s], hidden), dtype=np.float32)
        for b in (bias(bias_0, "bias_0", s), bias(bias_1, "bias_1", s)):
            if b is not None:
                acc = acc + b
        acc_w = None
        if weights is not None:
            acc_w = np.zeros((num_tokens[s], num_topk), dtype=np.float32)
        for d in range(num_ranks):  # ascending destination rank
            rows = np.nonzero(dispatched[d].recv_src_rank == s)[0]
            src = dispatched[d].recv_src_idx[rows]  # each token at most once per (s, d)
            acc[src] += ys[d][rows].astype(np.float32)
            if acc_w is not None:
                acc_w[src] += weights[d][rows]
        results.append((acc.astype(dtype), acc_w))
    return results


# --------------------------------------------------------------------------------------------
# normal mode over nodes, hierarchical: two flat stages (docs/DESIGN_NOTES.md, "hierarchical
# normal mode as two flat collectives"; the semantics a backend building it must match)
# --------------------------------------------------------------------------------------------

@dataclass
class HierarchicalDispatch:
    """A normal dispatch over `num_nodes` nodes of L ranks each (rank = node * L + local index)
    as two flat stages: the *rail* of local index i (one rank per node; rail rank b holds node
    b's experts) carries each token once to every node that holds one of its experts, then
    each *node* dispatches what arrived to its ranks."""

    num_nodes: int
    rail: list[list[RankDispatch]]  # [i][b]: what rank (b, i) received as rail rank b
    node: list[list[RankDispatch]]  # [b][j]: what rank (b, j) received: the outputs

    @property
    def ranks_per_node(self) -> int:
        return len(self.rail)

    def received(self, rank: int) -> RankDispatch:
        """Rank `rank`'s outputs. Rows are ordered by forwarder (the node rank that passed
        them on), then source node, then token; recv_src_rank / recv_src_idx name the
        forwarder and its row (`sources` gives the original rank and token)."""
        b, j = divmod(rank, self.ranks_per_node)
        return self.node[b][j]

    def sources(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(source rank, source token index) of each row `rank` received."""
        ln = self.ranks_per_node
        b = rank // ln
        rd = self.received(rank)
        src_rank = np.full(len(rd.recv_src_rank), -1, np.int32)
        src_idx = np.full(len(rd.recv_src_idx), -1, np.int32)
        for n, (i, u) in enumerate(zip(rd.recv_src_rank, rd.recv_src_idx, strict=True)):
            if i < 0:
                continue
            fwd = self.rail[i][b]  # what forwarder (b, i) received on its rail
            src_rank[n] = fwd.recv_src_rank[u] * ln + i
            src_idx[n] = fwd.recv_src_idx[u]
        return src_rank, src_idx


def hierarchical_dispatch(xs: list[np.ndarray], topk_idx: list[np.ndarray],
                          topk_weights: list[np.ndarray], num_experts: int, num_nodes: int, *,
                          x_scales: list[np.ndarray] | None = None,
                          expert_alignment: int = 1) -> HierarchicalDispatch:
    """Normal dispatch over nodes (see HierarchicalDispatch). Per rank, the same rows, top-k ids,
    weights, scales and per-expert counts as ``dispatch``, in the order above."""
    num_ranks = len(xs)
    if num_nodes < 1 or num_ranks % num_nodes:
        raise ValueError(f"{num_ranks} ranks cannot be split into {num_nodes} nodes of equal "
                         f"size")
    _check_experts(num_experts, num_ranks)
    ln = num_ranks // num_nodes

    def pick(values: list[np.ndarray] | None, i: int) -> list[np.ndarray] | None:
        return None if values is None else [values[a * ln + i] for a in range(num_nodes)]

    rail = [dispatch(pick(xs, i), pick(topk_idx, i), pick(topk_weights, i), num_experts,
                     x_scales=pick(x_scales, i)) for i in range(ln)]
    node = []
    for b in range(num_nodes):
        got = [rail[i][b] for i in range(ln)]
        node.append(dispatch(
            [g.recv_x for g in got], [g.recv_topk_idx for g in got],
            [g.recv_topk_weights for g in got], num_experts // num_nodes,
            x_scales=None if x_scales is None else [g.recv_x_scales for g in got],
            expert_alignment=expert_alignment))
    return HierarchicalDispatch(num_nodes, rail, node)


def hierarchical_combine(ys: list[np.ndarray], dispatched: HierarchicalDispatch,
                         num_tokens: list[int], *,
                         recv_topk_weights: list[np.ndarray] | None = None,
                         bias_0: list[np.ndarray] | None = None,
                         bias_1: list[np.ndarray] | None = None
                         ) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """The reverse of ``hierarchical_dispatch``: each node sums its ranks' rows of a token
    (fp32 from zero, local rank ascending) and rounds the partial to ys' dtype, then the source
    adds the biases and every node's partial (fp32, node ascending) and rounds once more:
    out = round(bias_0 + bias_1 + sum_b round(sum_j y)). Weights sum the same way (fp32)."""
    nn, ln = dispatched.num_nodes, dispatched.ranks_per_node
    num_ranks = nn * ln
    _check_rank_list("ys", ys, num_ranks)
    _check_rank_list("num_tokens", num_tokens, num_ranks)
    partials = []  # [b][i]: (partial rows, partial weights) of forwarder (b, i)
    for b in range(nn):
        partials.append(combine(
            [ys[b * ln + j] for j in range(ln)], dispatched.node[b],
            [dispatched.rail[i][b].recv_x.shape[0] for i in range(ln)],
            recv_topk_weights=(None if recv_topk_weights is None else
                               [recv_topk_weights[b * ln + j] for j in range(ln)])))
    out: list[tuple[np.ndarray, np.ndarray | None]] = [None] * num_ranks  # type: ignore[list-item]

    def pick(values: list[np.ndarray] | None, i: int) -> list[np.ndarray] | None:
        return None if values is None else [values[a * ln + i] for a in range(nn)]

    for i in range(ln):
        res = combine([partials[b][i][0] for b in range(nn)], dispatched.rail[i],
                      [num_tokens[a * ln + i] for a in range(nn)],
                      recv_topk_weights=(None if recv_topk_weights is None else
                                         [partials[b][i][1] for b in range(nn)]),
                      bias_0=pick(bias_0, i), bias_1=pick(bias_1, i))
        for a in range(nn):
            out[a * ln + i] = res[a]
    return out


# --------------------------------------------------------------------------------------------
# low-latency mode
# --------------------------------------------------------------------------------------------

def quantize_fp8(x: np.ndarray, round_scale: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per-token, per-128-channel FP8 quantisation; returns (q e4m3 [T, H], scales f32 [T, H/128]).

    DeepEP's low-latency arithmetic, float32 throughout (internode_ll.cu's FP8 cast, utils.cuh
    calculate_fp8_scales): amax = max|x| per block, clamped to >= 1e-4; scale = amax * fl(1/448)
    (a product with the float 1/448, not a division) and q = x * fl(448 / amax); with
    round_scale, scale = 2**ceil(log2(amax * fl(1/448))) and q = x / scale, exactly. q is cast to
    e4m3 (nearest even, saturating at 448), so x ~= q * scale.
    """
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [num_tokens, hidden], got shape {x.shape}")
    num_tokens, hidden = x.shape
    if hidden % FP8_BLOCK != 0:
        raise ValueError(f"hidden ({hidden}) must be a multiple of {FP8_BLOCK} for FP8")
    blocks = x.astype(np.float32).reshape(num_tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    amax = np.maximum(np.abs(blocks).max(axis=2, initial=0.0), np.float32(_FP8_AMAX_MIN))
    # DeepEP multiplies by the float constants 1/448.0f and 448.0f/amax; the correctly rounded
    # amax / 448 and x / scale differ from them in the last bit (about half the scales).
    scale = (amax * (np.float32(1.0) / np.float32(FP8_MAX))).astype(np.float32)
    multiplier = (np.float32(FP8_MAX) / amax).astype(np.float32)
    if round_scale:  # 2**ceil(log2(scale)) from the bits: float32 log2 rounds near powers of 2
        mant, expo = np.frexp(scale)  # scale = mant * 2**expo, mant in [0.5, 1)
        scale = np.ldexp(np.float32(1.0), np.where(mant == 0.5, expo - 1, expo)
                         ).astype(np.float32)
        multiplier = (np.float32(1.0) / scale).astype(np.float32)  # a power of two: exact
    q = np.clip((blocks * multiplier[:, :, None]).astype(np.float32), -FP8_MAX, FP8_MAX)
    return q.reshape(num_tokens, hidden).astype(FLOAT8_E4M3), scale


@dataclass
class LowLatencyDispatch:
    """What destination rank d receives in low-latency dispatch (one row per (token, k) pair)."""

    recv_x: np.ndarray           # [L, R*max_tokens, H]; rows beyond the count are zero
    recv_x_scales: np.ndarray | None  # [L, R*max_tokens, H/128] float32 when use_fp8
    recv_count: np.ndarray       # [L] int32 rows per local expert
    recv_src_rank: np.ndarray    # [L, R*max_tokens] int32 (-1 beyond count)
    recv_src_idx: np.ndarray     # [L, R*max_tokens] int32 (-1 beyond count)


def _check_low_latency_routing(topk_idx: list[np.ndarray], num_tokens: list[int],
                               num_experts: int, max_tokens: int) -> list[np.ndarray]:
    """Validate per-rank topk_idx for low-latency mode (shapes, range, no duplicate experts)."""
    idxs = []
    num_topk = None
    for s, raw in enumerate(topk_idx):
        idx = _check_topk_idx(raw, num_experts, f"topk_idx[{s}]")
        if num_topk is None:
            num_topk = idx.shape[1]
        if idx.shape != (num_tokens[s], num_topk):
            raise ValueError(f"topk_idx[{s}] has shape {idx.shape}, expected "
                             f"{(num_tokens[s], num_topk)}")
        if num_tokens[s] > max_tokens:
            raise ValueError(f"rank {s} has {num_tokens[s]} tokens, more than "
                             f"num_max_dispatch_tokens_per_rank ({max_tokens})")
        srt = np.sort(idx, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if dup.any():
            t = int(np.nonzero(dup.any(axis=1))[0][0])
            raise ValueError(f"topk_idx[{s}][{t}] names an expert twice ({idx[t].tolist()}); "
                             f"low-latency mode needs distinct experts per token")
        idxs.append(idx)
    return idxs


def low_latency_dispatch(xs: list[np.ndarray], topk_idx: list[np.ndarray], num_experts: int,
                         num_max_dispatch_tokens_per_rank: int, *, use_fp8: bool = False,
                         round_scale: bool = False) -> list[LowLatencyDispatch]:
    """Low-latency dispatch: per local expert, one row per (token, k) pair routed to it.

    Row order here is source rank ascending, then token ascending (implementations may
    differ). With use_fp8 each source token is quantised by ``quantize_fp8`` before sending.
    """
    num_ranks = len(xs)
    local = _check_experts(num_experts, num_ranks)
    _check_rank_list("topk_idx", topk_idx, num_ranks)
    max_tokens = num_max_dispatch_tokens_per_rank
    if max_tokens <= 0:
        raise ValueError(f"num_max_dispatch_tokens_per_rank must be positive, got {max_tokens}")
    xs = [np.asarray(x) for x in xs]
    for s, x in enumerate(xs):
        if x.ndim != 2:
            raise ValueError(f"xs[{s}] must be 2-D [num_tokens, hidden], got shape {x.shape}")
        if x.dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"xs[{s}] has dtype {x.dtype}; expected one of "
                             f"{[str(t) for t in _COMPUTE_DTYPES]}")
        if (x.shape[1], x.dtype) != (xs[0].shape[1], xs[0].dtype):
            raise ValueError(f"xs[{s}] is {x.dtype}[*, {x.shape[1]}] but xs[0] is "
                             f"{xs[0].dtype}[*, {xs[0].shape[1]}]; all ranks must agree")
    hidden = xs[0].shape[1]
    if use_fp8 and hidden % FP8_BLOCK != 0:
        raise ValueError(f"hidden ({hidden}) must be a multiple of {FP8_BLOCK} for FP8")
    idxs = _check_low_latency_routing(topk_idx, [x.shape[0] for x in xs], num_experts,
                                      max_tokens)

    if use_fp8:
        quantised = [quantize_fp8(x, round_scale) for x in xs]
        payloads = [q for q, _ in quantised]
        payload_scales: list[np.ndarray] | None = [sc for _, sc in quantised]
        out_dtype = FLOAT8_E4M3
    else:
        payloads, payload_scales, out_dtype = xs, None, xs[0].dtype

    slots = num_ranks * max_tokens
    out: list[LowLatencyDispatch] = []
    for d in range(num_ranks):
        recv_x = np.zeros((local, slots, hidden), dtype=out_dtype)
        recv_scales = (None if payload_scales is None else
                       np.zeros((local, slots, hidden // FP8_BLOCK), dtype=np.float32))
        recv_count = np.zeros(local, dtype=np.int32)
        recv_src_rank = np.full((local, slots), -1, dtype=np.int32)
        recv_src_idx = np.full((local, slots), -1, dtype=np.int32)
        for e in range(local):
            n = 0
            for s in range(num_ranks):
                tokens = np.nonzero((idxs[s] == d * local + e).any(axis=1))[0]
                m = len(tokens)
                recv_x[e, n:n + m] = payloads[s][tokens]
                if recv_scales is not None:
                    recv_scales[e, n:n + m] = payload_scales[s][tokens]
                recv_src_rank[e, n:n + m] = s
                recv_src_idx[e, n:n + m] = tokens
                n += m
            recv_count[e] = n
        out.append(LowLatencyDispatch(recv_x, recv_scales, recv_count, recv_src_rank,
                                      recv_src_idx))
    return out


def low_latency_combine(ys: list[np.ndarray], dispatched: list[LowLatencyDispatch],
                        topk_idx: list[np.ndarray], topk_weights: list[np.ndarray],
                        num_experts: int) -> list[np.ndarray]:
    """Low-latency combine: out[s][t] = cast(sum_k fp32(w[t,k]) * fp32(y[e_k][row of (s,t)])).

    ys[d] is [L, R*max_tokens, H]; rows are found by (src_rank, src_idx) in ``dispatched``, so
    any row order works. Accumulation is in fp32 in k order, skipping -1, each term added with
    one fused multiply-add (``fma_f32``, as DeepEP's kernel compiles); cast to ys' dtype.
    """
    num_ranks = len(dispatched)
    local = _check_experts(num_experts, num_ranks)
    _check_rank_list("ys", ys, num_ranks)
    _check_rank_list("topk_idx", topk_idx, num_ranks)
    _check_rank_list("topk_weights", topk_weights, num_ranks)
    ys = [np.asarray(y) for y in ys]
    slots = dispatched[0].recv_src_idx.shape[1]
    if slots % num_ranks != 0:
        raise ValueError(f"dispatched buffers have {slots} rows per expert, not a multiple of "
                         f"num_ranks ({num_ranks})")
    hidden, dtype = ys[0].shape[-1], ys[0].dtype
    for d, y in enumerate(ys):
        if y.shape != (local, slots, hidden) or y.dtype != ys[0].dtype:
            raise ValueError(f"ys[{d}] is {y.dtype}{list(y.shape)}, expected "
                             f"{dtype}{[local, slots, hidden]}")
        if y.dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"ys[{d}] has dtype {y.dtype}; expected one of "
                             f"{[str(t) for t in _COMPUTE_DTYPES]}")
    num_tokens = [np.asarray(i).shape[0] for i in topk_idx]
    idxs = _check_low_latency_routing(topk_idx, num_tokens, num_experts, slots // num_ranks)
    weights = [_check_weights(topk_weights[s], idxs[s].shape, f"topk_weights[{s}]")
               for s in range(num_ranks)]

    # row_of[s][e, t]: row of source token (s, t) in expert e's buffer on rank e // L, else -1
    row_of = [np.full((num_experts, n), -1, dtype=np.int64) for n in num_tokens]
    for d, dd in enumerate(dispatched):
        for e in range(local):
            count = int(dd.recv_count[e])
            for row in range(count):
                s, t = int(dd.recv_src_rank[e, row]), int(dd.recv_src_idx[e, row])
                if not (0 <= s < num_ranks and 0 <= t < num_tokens[s]):
                    raise ValueError(f"dispatched[{d}] expert {e} row {row} names token "
                                     f"({s}, {t}), which does not exist")
                row_of[s][d * local + e, t] = row

    out: list[np.ndarray] = []
    for s in range(num_ranks):
        acc = np.zeros((num_tokens[s], hidden), dtype=np.float32)
        for k in range(idxs[s].shape[1]):  # k order
            tokens = np.nonzero(idxs[s][:, k] >= 0)[0]
            experts = idxs[s][tokens, k]
            rows = row_of[s][experts, tokens]
            if np.any(rows < 0):
                t = int(tokens[np.argmax(rows < 0)])
                raise ValueError(f"token {t} of rank {s} was not dispatched to expert "
                                 f"{idxs[s][t, k]}")
            y = np.stack([ys[e // local][e % local, r] for e, r in
                          zip(experts, rows, strict=True)]) if len(tokens) else \
                np.zeros((0, hidden), dtype=dtype)
            acc[tokens] = fma_f32(weights[s][tokens, k][:, None], y.astype(np.float32),
                                  acc[tokens])
        out.append(acc.astype(dtype))
    return out


# --------------------------------------------------------------------------------------------
# workload generators
# --------------------------------------------------------------------------------------------

def random_routing(rng: np.random.Generator, num_tokens: int, num_experts: int, num_topk: int, *,
                   drop_prob: float = 0.0, hot_rank: int | None = None, hot_fraction: float = 0.0,
                   num_ranks: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Score-based router as in DeepEP's tests; returns (topk_idx int64, topk_weights float32).

    scores = |N(0,1)| + 1 per (token, expert); the top-k experts by score (distinct, highest
    first) are chosen and their scores normalised into weights. Then each entry is dropped
    (-1, weight 0) with probability drop_prob. With hot_rank, round(hot_fraction * T) tokens
    (chosen at random) pick all their experts among those on hot_rank.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if not 1 <= num_topk <= num_experts:
        raise ValueError(f"num_topk ({num_topk}) must lie in [1, num_experts={num_experts}]")
    if not 0.0 <= drop_prob <= 1.0:
        raise ValueError(f"drop_prob must lie in [0, 1], got {drop_prob}")
    if not 0.0 <= hot_fraction <= 1.0:
        raise ValueError(f"hot_fraction must lie in [0, 1], got {hot_fraction}")
    local = _check_experts(num_experts, num_ranks)

    scores = (np.abs(rng.standard_normal((num_tokens, num_experts))) + 1).astype(np.float32)
    if hot_rank is not None and hot_fraction > 0:
        if not 0 <= hot_rank < num_ranks:
            raise ValueError(f"hot_rank ({hot_rank}) must lie in [0, num_ranks={num_ranks})")
        if num_topk > local:
            raise ValueError(f"num_topk ({num_topk}) exceeds the {local} experts on hot_rank")
        hot = rng.permutation(num_tokens)[:round(hot_fraction * num_tokens)]
        off_rank = np.ones(num_experts, dtype=bool)
        off_rank[hot_rank * local:(hot_rank + 1) * local] = False
        scores[np.ix_(hot, off_rank)] = 0.0  # below every real score (>= 1)

    topk_idx = np.argsort(-scores, axis=1, kind="stable")[:, :num_topk].astype(np.int64)
    chosen = np.take_along_axis(scores, topk_idx, axis=1)
    topk_weights = (chosen / chosen.sum(axis=1, keepdims=True)).astype(np.float32)
    if drop_prob > 0:
        drop = rng.random(topk_idx.shape) < drop_prob
        topk_idx[drop] = -1
        topk_weights[drop] = 0.0
    return topk_idx, topk_weights


def random_x(rng: np.random.Generator, num_tokens: int, hidden: int,
             dtype: np.dtype | type) -> np.ndarray:
    """N(0,1) activations [num_tokens, hidden] cast to dtype (bf16/fp16/fp32), never all zeros."""
    dt = np.dtype(dtype)
    if dt not in _COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {[str(t) for t in _COMPUTE_DTYPES]}, got {dt}")
    if num_tokens < 0 or hidden <= 0:
        raise ValueError(f"need num_tokens >= 0 and hidden > 0, got {num_tokens}, {hidden}")
    x = rng.standard_normal((num_tokens, hidden)).astype(np.float32).astype(dt)
    if x.size and not np.any(x.astype(np.float32) != 0):
        x[0, 0] = dt.type(1.0)
    return x
