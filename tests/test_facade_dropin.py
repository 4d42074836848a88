"""Drop-in gaps of the DeepEP facade that the replays did not reach (CPU daemon, ranks as threads).

Each case is a DeepEP V1 behaviour a caller can rely on, read from DeepEP's source
(deep_ep/buffer.py, csrc/deep_ep.cpp's pybind11 bindings): the public `internode_dispatch` /
`internode_combine` methods of its Python `Buffer`, and its `Config`, a pybind11 class and so
hashable. Outputs exact against server/reference.py.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from ranklib import assert_exact, facade_env, run_rank_threads

from epd.client.buffer import Buffer
from epd.client.deep_ep_compat import Config
from epd.proto import dtypes
from epd.server import reference as ref

BF16 = dtypes.BFLOAT16
NUM_RANKS, EXPERTS, TOPK, HIDDEN = 2, 8, 2, 128
TOKENS = (7, 5)


@pytest.fixture
def env(daemon, monkeypatch):
    return facade_env(daemon, monkeypatch, "dropin")


def run_ranks(fn) -> list:
    return run_rank_threads(fn, NUM_RANKS)


def times2(a) -> np.ndarray:
    """The expert stand-in: bf16(2 x), exact."""
    return (np.asarray(a).astype(np.float32) * np.float32(2)).astype(BF16)


def test_config_is_hashable_as_deepeps() -> None:
    """deep_ep.Config is a pybind11 class (csrc/deep_ep.cpp, `pybind11::class_<Config>`), so
    `hash(config)` works and a config can key a dict or an lru_cache (a framework caching its
    tuned configs). The facade's Config compares by value (`__eq__`), which made it unhashable;
    equal configs must hash alike."""
    a, b = Config(24, 8, 256), Config(24, 8, 256)
    assert hash(a) == hash(b)
    cache = {Buffer.get_dispatch_config(2): "dispatch", a: "tuned"}
    assert cache[Config(Buffer.num_sms, 24, 256, 6, 128)] == "dispatch"
    assert cache[b] == "tuned" and len({a, b, Config()}) == 2


def test_internode_entry_points_are_dispatch_and_combine(env) -> None:
    """DeepEP V1's Buffer has public `internode_dispatch` and `internode_combine`
    (deep_ep/buffer.py: `def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None,
    ...)`, the method `dispatch` calls when the group spans nodes), with `dispatch`'s and
    `combine`'s parameters in the same order. A caller that calls them directly (the internode
    path, config given, as `dispatch` passes it) must get the same results as `dispatch` /
    `combine`: EPD's dispatch serves every placement. Positional V1 calls, cached form too."""
    for name, like in (("internode_dispatch", "dispatch"), ("internode_combine", "combine")):
        got = inspect.signature(getattr(Buffer, name, None) or (lambda: None)).parameters
        want = inspect.signature(getattr(Buffer, like)).parameters
        assert [(p.name, p.default) for p in got.values()] == \
            [(p.name, p.default) for p in want.values()], name

    rng = np.random.default_rng(71)
    xs = [ref.random_x(rng, t, HIDDEN, BF16) for t in TOKENS]
    rt = [ref.random_routing(rng, t, EXPERTS, TOPK, num_ranks=NUM_RANKS) for t in TOKENS]
    idx, w = [r[0] for r in rt], [r[1] for r in rt]
    grads = [ref.random_x(rng, t, HIDDEN, BF16) for t in TOKENS]

    def rank(r, group):
        buf = Buffer(group, int(1e9))
        try:
            n_rank, n_rdma, n_exp, in_rank, _ = buf.get_dispatch_layout(idx[r], EXPERTS)
            recv_x, recv_idx, recv_w, counts, handle, event = buf.internode_dispatch(
                xs[r], None, n_rank, n_rdma, in_rank, n_exp, idx[r], w[r], 1, 0,
                Buffer.get_dispatch_config(NUM_RANKS), None, False, False)
            cx, cw, _ = buf.internode_combine(times2(recv_x), handle, recv_w, None,
                                              Buffer.get_combine_config(NUM_RANKS))
            cached, *rest = buf.internode_dispatch(grads[r], handle,
                                                   config=Buffer.get_dispatch_config(NUM_RANKS))
            return {"recv_x": np.asarray(recv_x).copy(), "counts": counts,
                    "recv_idx": np.asarray(recv_idx).copy(),
                    "cx": np.asarray(cx).copy(), "cw": np.asarray(cw).copy(),
                    "cached": np.asarray(cached).copy(), "rest": rest[:4],
                    "event": event.event}
        finally:
            buf.destroy()

    res = run_ranks(rank)
    disp = ref.dispatch(xs, idx, w, EXPERTS)
    comb = ref.combine([times2(d.recv_x) for d in disp], disp, list(TOKENS),
                       recv_topk_weights=[d.recv_topk_weights for d in disp])
    cached = ref.dispatch(grads, idx, w, EXPERTS)
    for r, out in enumerate(res):
        assert_exact(out["recv_x"], disp[r].recv_x, f"rank {r} recv_x")
        assert_exact(out["recv_idx"], disp[r].recv_topk_idx, f"rank {r} recv_topk_idx")
        assert out["counts"] == disp[r].num_recv_tokens_per_expert
        assert out["event"] is None  # (no async_finish: DeepEP's EventOverlap(None))
        assert_exact(out["cx"], comb[r][0], f"rank {r} combined_x")
        assert_exact(out["cw"], comb[r][1], f"rank {r} combined weights")
        assert_exact(out["cached"], cached[r].recv_x, f"rank {r} cached recv_x")
        assert out["rest"] == [None, None, None, None]
