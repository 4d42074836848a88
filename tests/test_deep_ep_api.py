"""DeepEP V1's API surface on EPD's facade (issue 11, CPU part): signatures, Config size hints,
handles indexable as DeepEP's, events, the engine a Buffer picks, and the opt-in `deep_ep` shim.

The V1 names and defaults below were read from DeepEP's `deep_ep/buffer.py` at commit
567632dd59810d77b3cc05553df953cc0f779799 (github.com/deepseek-ai/DeepEP), the commit issue 11
names; Config's from `csrc/deep_ep.cpp` (its pybind11 bindings) and `csrc/config.hpp` there.
"""

from __future__ import annotations

import gc
import inspect
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from ranklib import Case, assert_exact, expert_out, reference

from epd.client import buffer as B
from epd.client import deep_ep_compat as C
from epd.proto import dtypes
from epd.proto.errors import InvalidArgument
from epd.server import reference as ref

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIM = os.path.join(REPO, "client", "deep_ep_shim")
REQ = inspect.Parameter.empty  # no default

# name -> [(parameter, default)], in V1's order (self omitted); deep_ep/buffer.py @ 567632d.
V1_SIGNATURES = {
    "__init__": [("group", REQ), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0),
                 ("low_latency_mode", False), ("num_qps_per_rank", 24),
                 ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                 ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False),
                 ("comm", None)],
    "get_dispatch_layout": [("topk_idx", REQ), ("num_experts", REQ), ("previous_event", None),
                            ("async_finish", False), ("allocate_on_comm_stream", False)],
    "dispatch": [("x", REQ), ("handle", None), ("num_tokens_per_rank", None),
                 ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None),
                 ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
                 ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
                 ("previous_event", None), ("async_finish", False),
                 ("allocate_on_comm_stream", False)],
    "combine": [("x", REQ), ("handle", REQ), ("topk_weights", None), ("bias", None),
                ("config", None), ("previous_event", None), ("async_finish", False),
                ("allocate_on_comm_stream", False)],
    "clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", REQ), ("hidden", REQ),
                                 ("num_experts", REQ)],
    "low_latency_dispatch": [("x", REQ), ("topk_idx", REQ),
                             ("num_max_dispatch_tokens_per_rank", REQ), ("num_experts", REQ),
                             ("cumulative_local_expert_recv_stats", None),
                             ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True),
                             ("round_scale", False), ("use_ue8m0", False),
                             ("async_finish", False), ("return_recv_hook", False)],
    "low_latency_combine": [("x", REQ), ("topk_idx", REQ), ("topk_weights", REQ),
                            ("handle", REQ), ("use_logfmt", False), ("zero_copy", False),
                            ("async_finish", False), ("return_recv_hook", False),
                            ("out", None), ("combine_wait_recv_cost_stats", None)],
    "low_latency_update_mask_buffer": [("rank_to_mask", REQ), ("mask", False)],
    "low_latency_query_mask_buffer": [("mask_status", REQ)],
    "low_latency_clean_mask_buffer": [],
    "get_next_low_latency_combine_buffer": [("handle", REQ)],
    "get_local_buffer_tensor": [("dtype", REQ), ("size", None), ("offset", 0),
                                ("use_rdma_buffer", False)],
    "get_comm_stream": [],
    "destroy": [],
}
V1_STATIC = {"is_sm90_compiled": [], "set_num_sms": [("new_num_sms", REQ)], "capture": [],
             "get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", REQ),
                                                ("hidden", REQ), ("num_ranks", REQ),
                                                ("num_experts", REQ)],
             "get_dispatch_config": [("num_ranks", REQ)],
             "get_combine_config": [("num_ranks", REQ)]}
# deep_ep_cpp.Config (csrc/deep_ep.cpp, PYBIND11_MODULE) @ 567632d
V1_CONFIG = [("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6),
             ("num_max_nvl_chunked_recv_tokens", 256), ("num_max_rdma_chunked_send_tokens", 6),
             ("num_max_rdma_chunked_recv_tokens", 256)]
# The one deliberate difference: EPD's `group` may be omitted (EPD's rank=/num_ranks= instead).
EPD_DEFAULT_DIFFERENCES = {("__init__", "group"): None}


def _params(fn, skip_self: bool) -> list[inspect.Parameter]:
    ps = list(inspect.signature(fn).parameters.values())
    return ps[1:] if skip_self else ps


@pytest.mark.parametrize("name", sorted(V1_SIGNATURES) + sorted(V1_STATIC))
def test_v1_signatures(name: str) -> None:
    static = name in V1_STATIC
    want = (V1_STATIC if static else V1_SIGNATURES)[name]
    raw = inspect.getattr_static(B.Buffer, name)
    assert isinstance(raw, staticmethod) == static, f"{name}: static in V1: {static}"
    got = _params(getattr(B.Buffer, name), skip_self=not static)
    positional = [p for p in got if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert [p.name for p in positional[:len(want)]] == [n for n, _ in want], name
    for p, (n, d) in zip(positional, want, strict=False):
        d = EPD_DEFAULT_DIFFERENCES.get((name, n), d)
        assert p.default == d, f"{name}({n}): default {p.default!r}, V1 {d!r}"
    # anything EPD adds is keyword-only, so positional V1 calls cannot land on it
    assert len(positional) == len(want), f"{name}: extra positional parameters"


def test_v1_config_signature_and_validation() -> None:
    got = [(p.name, p.default) for p in _params(C.Config, skip_self=False)]
    assert got == V1_CONFIG
    c = C.Config(24, 8, 256)  # DeepEP's tests/test_intranode.py builds it with 3 arguments
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == \
        (24, 8, 256, 6, 258)  # RDMA receive chunk rounded up to a multiple of the send chunk
    with pytest.raises(InvalidArgument, match="send_tokens must be <"):
        C.Config(20, 256, 256)
    with pytest.raises(InvalidArgument, match="rdma_chunked_send_tokens must be <"):
        C.Config(20, 6, 256, 100, 100)
    with pytest.raises(InvalidArgument, match="even"):
        B.Buffer.set_num_sms(21)


def test_config_size_hints() -> None:
    """V1's formulas, evaluated by hand here for DeepSeek-V3 shapes (bf16 hidden 7168)."""
    c = C.Config()  # 20 SMs: 10 channels
    # 8 ranks: 10 channels * 8 peers = 80 slots; 80 * (2*1 + 3) ints of control, then per
    # token of 256 per slot: hidden + source meta 8 + 128 topk idx (8 B) + 128 weights + 128
    # scales (4 B each); aligned to 128.
    per_token = 14336 + 8 + 128 * 8 + 128 * 4 + 128 * 4
    n = 80 * 5 * 4 + 80 * 256 * per_token
    assert c.get_nvl_buffer_size_hint(14336, 8) == (n + 127) // 128 * 128 == 335709824
    # 2 ranks: 20 slots
    assert c.get_nvl_buffer_size_hint(14336, 2) == (20 * 5 * 4 + 20 * 256 * per_token + 127) \
        // 128 * 128
    assert c.get_rdma_buffer_size_hint(14336, 8) == 0  # one node: no RDMA buffer
    # 16 ranks: 2 RDMA ranks, 10 channels -> 20 slots of 258 tokens (256 rounded up to a
    # multiple of the send chunk 6), doubled
    per_rdma = 2 * (14336 + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16)
    want = 20 * 18 * 2 * 4 + 20 * 258 * per_rdma
    assert c.get_rdma_buffer_size_hint(14336, 16) == (want + 127) // 128 * 128
    with pytest.raises(InvalidArgument):
        c.get_nvl_buffer_size_hint(14336, 12)  # > 8 and not a multiple of 8
    # low latency: 128 tokens, hidden 7168, 8 ranks, 256 experts
    dispatch_msg = 16 + max(7168 * 2, 7168 + 56 * 4)
    combine_msg = 56 * 4 + 7168 * 2
    send = max(128 * dispatch_msg, 256 * 128 * combine_msg)
    recv = max(256 * 128 * dispatch_msg, 256 * 128 * combine_msg)
    total = 2 * (send + recv + 1024)
    assert B.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) == \
        (total + 128) // 128 * 128
    # recommended configs: V1's tables with Buffer.num_sms
    old = B.Buffer.num_sms
    try:
        B.Buffer.set_num_sms(24)
        d, k = B.Buffer.get_dispatch_config(8), B.Buffer.get_combine_config(8)
        assert (d.num_sms, d.num_max_nvl_chunked_send_tokens,
                d.num_max_nvl_chunked_recv_tokens) == (24, 6, 256)
        assert (k.num_sms, k.num_max_nvl_chunked_send_tokens) == (24, 4)
        assert B.Buffer.get_dispatch_config(2).num_max_nvl_chunked_send_tokens == 24
        assert B.Buffer.get_combine_config(2).num_max_nvl_chunked_send_tokens == 10
        with pytest.raises(InvalidArgument, match="Unsupported number of EP ranks: 3"):
            B.Buffer.get_dispatch_config(3)
    finally:
        B.Buffer.num_sms = old


def test_events_without_cuda() -> None:
    ev = B.Buffer.capture()
    assert isinstance(ev, C.EventOverlap) and isinstance(ev.event, C.EventHandle)
    ev.current_stream_wait()
    with ev:
        pass
    assert C.EventOverlap().extra_tensors is None
    res, ev = C.run_on_streams(C.HostStream, None, lambda: 7, None, True, False)
    assert res == 7 and ev.event is not None
    res, ev = C.run_on_streams(C.HostStream, None, lambda: 8, None, False, False)
    assert res == 8 and ev.event is None
    with pytest.raises(InvalidArgument, match="allocate_on_comm_stream"):
        C.run_on_streams(C.HostStream, None, lambda: 0, None, True, True)


def test_event_overlap_v2_methods() -> None:
    """DeepEP V2's EventOverlap: a hook after the next wait (once), release_handle, and
    `with event(release_handle=True):`."""
    ran = []
    ev = B.Buffer.capture()
    ev.register_hook_after_wait(lambda: ran.append(1))
    with pytest.raises(InvalidArgument, match="already registered"):
        ev.register_hook_after_wait(lambda: None)
    ev.current_stream_wait()
    ev.current_stream_wait()
    assert ran == [1] and ev.event is not None
    ev.current_stream_wait(release_handle=True)
    assert ev.event is None
    ev = B.Buffer.capture()
    with ev(release_handle=True):
        pass
    assert ev.event is None
    ev = B.Buffer.capture()
    with ev:
        pass
    assert ev.event is not None


def test_engine_choice(monkeypatch) -> None:
    """EPD_ENGINE wins; then the current CUDA device (physical, through CUDA_VISIBLE_DEVICES);
    then LOCAL_RANK; then 0."""
    import types
    for k in ("EPD_ENGINE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(k, raising=False)
    fake = types.SimpleNamespace(Tensor=type("Tensor", (), {}),  # (an imported torch)
                                 cuda=types.SimpleNamespace(is_available=lambda: True,
                                                            current_device=lambda: 1))
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setenv("LOCAL_RANK", "0")  # torch.multiprocessing.spawn's would be wrong
    assert C.default_engine() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert C.default_engine() == 5
    monkeypatch.setenv("EPD_ENGINE", "3")
    assert C.default_engine() == 3
    monkeypatch.delenv("EPD_ENGINE")
    fake.cuda.is_available = lambda: False
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert C.default_engine() == 2
    monkeypatch.delenv("LOCAL_RANK")
    assert C.default_engine() == 0


# ------------------------------------------------------------------------------------------------
# the opt-in `deep_ep` shim
# ------------------------------------------------------------------------------------------------
_PROBE = textwrap.dedent("""
    import deep_ep, deep_ep.utils
    import torch
    assert deep_ep.IS_EPD and deep_ep.topk_idx_t is torch.int64
    from epd.client.buffer import Buffer
    assert deep_ep.Buffer is Buffer and deep_ep.Config().num_sms == 20
    assert isinstance(deep_ep.Buffer.capture(), deep_ep.EventOverlap)
    assert deep_ep.utils.EventHandle().event is None  # no CUDA here
    # DeepEP's submodules, as code imports them (Mooncake's tests: deep_ep.buffer)
    from deep_ep.buffer import Buffer as from_buffer, Config, EventOverlap
    from deep_ep.utils import EventHandle, check_nvlink_connections
    assert from_buffer is Buffer and Config is deep_ep.Config
    assert EventOverlap is deep_ep.EventOverlap and deep_ep.buffer.EventHandle is EventHandle
    assert check_nvlink_connections(None) is None
    # DeepEP V2's names (deep_ep 2.1.0: from deep_ep import ElasticBuffer, EPHandle)
    from deep_ep import ElasticBuffer, EPHandle, EventHandle as V2EventHandle
    from epd.client import elastic_buffer
    assert ElasticBuffer is elastic_buffer.ElasticBuffer and EPHandle is elastic_buffer.EPHandle
    assert V2EventHandle is EventHandle

    class Group:
        def size(self):
            return 4
    assert deep_ep.get_logical_domain_size(Group()) == (1, 4)
    assert deep_ep.get_physical_domain_size(Group()) == (1, 4)
    assert ElasticBuffer.get_buffer_size_hint(Group(), 128, 7168, 8) % (2 << 20) == 0
    # DeepEP's extension module by name (xtuner: from deep_ep_cpp import EventHandle)
    from deep_ep_cpp import Config as CppConfig, EventHandle as CppEventHandle
    import deep_ep_cpp
    assert CppEventHandle is EventHandle and CppConfig is Config and deep_ep_cpp.IS_EPD
    assert deep_ep_cpp.topk_idx_t is torch.int64
    print("OK", deep_ep.__file__)
""")


def _python(code: str, path: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


def test_shim_is_opt_in() -> None:
    r = _python("import importlib.util; print(importlib.util.find_spec('deep_ep'))", [])
    assert r.returncode == 0 and r.stdout.strip() == "None", (r.stdout, r.stderr)
    r = _python(_PROBE, [SHIM])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OK") and SHIM in r.stdout


def test_shim_refuses_to_shadow_a_real_deepep(tmp_path) -> None:
    ext = tmp_path / "ext"
    ext.mkdir()
    (ext / "deep_ep_cpp.py").write_text("raise SystemExit('a real DeepEP must not be imported')")
    r = _python("import deep_ep", [SHIM, str(ext)])
    assert r.returncode != 0 and "ImportError" in r.stderr, r.stderr
    assert "deep_ep_cpp" in r.stderr and "epd-deep-ep-shim" in r.stderr, r.stderr
    dist = tmp_path / "dist"
    (dist / "deep_ep-1.2.1.dist-info").mkdir(parents=True)
    (dist / "deep_ep-1.2.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: deep_ep\nVersion: 1.2.1\n")
    r = _python("import deep_ep", [SHIM, str(dist)])
    assert r.returncode != 0 and "ImportError" in r.stderr, r.stderr
    assert "'deep_ep'" in r.stderr and "epd-deep-ep-shim" in r.stderr, r.stderr


@pytest.mark.slow
def test_shim_installs_and_works(tmp_path) -> None:
    """`pip install ./client/deep_ep_shim`, into a private target (never into the venv)."""
    import shutil
    src, target = tmp_path / "shim", tmp_path / "site"
    shutil.copytree(SHIM, src, ignore=shutil.ignore_patterns("__pycache__", "build",
                                                             "*.egg-info"))
    # built from a copy: setuptools writes build/ and *.egg-info beside the sources
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--no-build-isolation", "--target", str(target), str(src)],
                       capture_output=True, text=True, timeout=300,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    r = _python(_PROBE, [str(target)])
    assert r.returncode == 0, r.stderr
    assert str(target) in r.stdout


# ------------------------------------------------------------------------------------------------
# handles, events and the new kwargs against a CPU daemon
# ------------------------------------------------------------------------------------------------
LAYERS = [Case(f"api-layer{i}", num_ranks=2, num_experts=8, hidden=h, num_topk=k, tokens=t,
               seed=900 + i, cached=True)
          for i, (h, k, t) in enumerate([(128, 2, (12, 7)), (256, 3, (0, 9)), (128, 2, (16, 16))])]
LL_CASE = Case("api-ll", num_ranks=2, num_experts=8, hidden=256, num_topk=2, tokens=(5, 7),
               seed=77)
LL_MAX = 8


def v1_style_rank(endpoint: str, rank: int) -> dict:
    """One Buffer, built with every V1 constructor argument positionally, runs several layers
    the way DeepEP's tests/test_intranode.py does (capture() as previous_event, async_finish,
    a Config, handle[0]), then a low-latency round (handle[0][i], handle[1][i])."""
    from epd.client.buffer import Buffer
    from epd.client.deep_ep_compat import EventOverlap, HostStream, Unsupported
    buf = Buffer(None, int(2e9), 0, False, 1, True, False, False, True, True, None,
                 rank=rank, num_ranks=2, endpoint=endpoint, group_name="api",
                 max_tokens_per_rank=16)
    out: dict = {"attrs": (buf.group, buf.rank, buf.group_size, buf.num_nvl_bytes,
                           buf.num_rdma_bytes, buf.low_latency_mode, buf.explicitly_destroy,
                           buf.enable_shrink, hasattr(buf, "runtime"))}
    errors = []
    try:
        assert Buffer.is_sm90_compiled() is True
        assert isinstance(buf.get_comm_stream(), HostStream)
        try:
            buf.get_local_buffer_tensor(np.uint8)
        except Unsupported as e:
            errors.append(("local_buffer", str(e)))
        layers = []
        for c in LAYERS:
            inp = c.inputs(rank)
            n_rank, _, n_exp, in_rank, ev = buf.get_dispatch_layout(
                inp["topk_idx"], c.num_experts, previous_event=buf.capture(), async_finish=True,
                allocate_on_comm_stream=True)
            assert isinstance(ev, EventOverlap)
            ev.current_stream_wait()
            recv_x, recv_idx, recv_w, _, handle, ev = buf.dispatch(
                inp["x"], num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=n_exp, topk_idx=inp["topk_idx"],
                topk_weights=inp["topk_weights"], config=Buffer.get_dispatch_config(2),
                previous_event=buf.capture(), async_finish=True)
            with ev:
                pass
            got = {"recv_x": recv_x, "prefix": handle[0], "src_idx": handle[3],
                   "in_rank": handle[4], "in_rank_given": in_rank, "len": len(handle),
                   "slice": len(handle[0:1])}
            for pos in (1, 2, 5, -1):
                try:
                    handle[pos]
                except Unsupported as e:
                    errors.append((f"handle[{pos}]", str(e)))
            y = expert_out(recv_x, None, recv_idx, recv_w, rank, c.local_experts)
            cx, cw, ev = buf.combine(y, handle, topk_weights=recv_w,
                                     config=Buffer.get_combine_config(2), async_finish=True)
            ev.current_stream_wait()
            cached, *rest, ev = buf.dispatch(inp["x2"], handle=handle, async_finish=True)
            got.update(cx=cx, cw=cw, cached=cached, cached_rest=tuple(rest))
            layers.append(got)
        out["layers"] = layers
        # low latency on the same Buffer
        c = LL_CASE
        inp = c.inputs(rank)
        rx, count, handle, ev, _ = buf.low_latency_dispatch(
            inp["x"], inp["topk_idx"], LL_MAX, c.num_experts, use_fp8=False, async_finish=True)
        ev.current_stream_wait()
        out["ll"] = {"recv_x": rx, "count": count, "src_info": handle[0],
                     "layout_range": handle[1], "rest": tuple(handle[2:]),
                     "rows": [handle[0][i] for i in range(c.local_experts)]}
        y = rx.astype(np.float32).astype(rx.dtype)
        cx, ev, _ = buf.low_latency_combine(y, inp["topk_idx"], inp["topk_weights"], handle,
                                            async_finish=True)
        out["ll"]["cx"] = cx
        mask = np.ones(2, np.int32)
        buf.low_latency_query_mask_buffer(mask)
        out["mask"] = mask
        buf.low_latency_update_mask_buffer(1 - rank, False)
        buf.low_latency_clean_mask_buffer()  # (masking itself: tests/test_rank_masking.py)
        out["errors"] = errors
        return out
    finally:
        buf.destroy()


@pytest.mark.slow
def test_v1_call_sequence_handles_and_kwargs(daemon, ranks) -> None:
    results = ranks.run_ok([(v1_style_rank, daemon.socket(r), r) for r in range(2)],
                           timeout=240)
    ll_in = [LL_CASE.inputs(r) for r in range(2)]
    ll_want = ref.low_latency_dispatch([i["x"] for i in ll_in], [i["topk_idx"] for i in ll_in],
                                       LL_CASE.num_experts, LL_MAX)
    for r, res in enumerate(results):
        assert res["attrs"] == (None, r, 2, int(2e9), 0, False, True, True, False)
        for c_i, c in enumerate(LAYERS):
            want, got, tag = reference(c), res["layers"][c_i], f"layer {c_i} rank {r}"
            assert_exact(got["prefix"], want["prefix"], f"{tag} handle[0] rank_prefix_matrix")
            assert got["prefix"].dtype == np.int32 and got["prefix"].shape == (2, 2)
            assert_exact(got["src_idx"], want["disp"][r].recv_src_idx, f"{tag} handle[3]")
            assert_exact(got["in_rank"], want["layout"][r].is_token_in_rank, f"{tag} handle[4]")
            assert got["len"] == 6 and got["slice"] == 1
            assert_exact(got["recv_x"], want["disp"][r].recv_x, f"{tag} recv_x")
            assert_exact(got["cx"], want["comb"][r][0], f"{tag} combined_x")
            assert_exact(got["cw"], want["comb"][r][1], f"{tag} combined_w")
            assert_exact(got["cached"], want["cached"][r].recv_x, f"{tag} cached recv_x")
            assert got["cached_rest"] == (None, None, None, None)
        names = [e[0] for e in res["errors"]]
        assert names[0] == "local_buffer" and "daemon" in res["errors"][0][1]
        assert names.count("handle[1]") == len(LAYERS) and names.count("handle[-1]") == len(LAYERS)
        assert "send_head" in dict(res["errors"])["handle[-1]"]
        np.testing.assert_array_equal(res["mask"], [0, 0])
        # low-latency handle: src_info and layout_range as DeepEP's test reads them
        ll, want = res["ll"], ll_want[r]
        np.testing.assert_array_equal(ll["count"], want.recv_count)
        np.testing.assert_array_equal(ll["src_info"], want.recv_src_idx)
        assert ll["rest"] == (LL_MAX, LL_CASE.hidden, LL_CASE.num_experts)
        lr = ll["layout_range"]
        assert lr.dtype == np.int64 and lr.shape == (LL_CASE.local_experts, 2)
        for e in range(LL_CASE.local_experts):
            n = int(want.recv_count[e])
            assert int((lr[e] & 0xFFFFFFFF).sum()) == n
            for j in range(2):
                begin, cnt = int(lr[e, j] >> 32), int(lr[e, j] & 0xFFFFFFFF)
                np.testing.assert_array_equal(want.recv_src_rank[e, begin:begin + cnt], j)
                assert cnt == int((want.recv_src_rank[e, :n] == j).sum())


# Token growth: one Buffer of capacity 8, layers of growing token counts (different on each
# rank), handles of an earlier layer held across the growth. (capacity before, tokens per rank,
# num_worst_tokens, capacity after)
GROWTH = [(8, (6, 5), 0, 8), (8, (12, 5), 0, 16), (16, (3, 40), 0, 40), (40, (4, 4), 200, 100)]


def growth_case(i: int, tokens: tuple[int, int], worst: int) -> Case:
    return Case(f"api-grow{i}", num_ranks=2, num_experts=8, hidden=128, num_topk=2,
                tokens=tokens, seed=1200 + i, cached=True, num_worst_tokens=worst)


def growing_rank(endpoint: str, rank: int) -> dict:
    """Every layer: layout, dispatch, and a cached dispatch; the first layer's handle is
    combined only after the Buffer grew twice (its group is a retired one by then)."""
    from epd.client.buffer import Buffer
    buf = Buffer(rank=rank, num_ranks=2, endpoint=endpoint, group_name="api-grow",
                 max_tokens_per_rank=8)
    out: dict = {"layers": [], "caps": []}
    held = None
    try:
        for i, (_, tokens, worst, _) in enumerate(GROWTH):
            c = growth_case(i, tokens, worst)
            inp = c.inputs(rank)
            n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(inp["topk_idx"], 8)
            recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
                inp["x"], num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=n_exp, topk_idx=inp["topk_idx"],
                topk_weights=inp["topk_weights"], num_worst_tokens=worst)
            y = expert_out(recv_x, None, recv_idx, recv_w, rank, c.local_experts)
            got = {"layout": (n_rank, n_exp, in_rank), "recv_x": recv_x, "counts": counts}
            if i == 0:
                held = (handle, y, recv_w)
            else:
                got["cx"], got["cw"], _ = buf.combine(y, handle, topk_weights=recv_w)
            got["cached"], *_ = buf.dispatch(inp["x2"], handle=handle, num_worst_tokens=worst)
            out["layers"].append(got)
            out["caps"].append(buf.max_tokens_per_rank)
        handle, y, recv_w = held
        out["held_cx"], out["held_cw"], _ = buf.combine(y, handle, topk_weights=recv_w)
        out["groups"] = sorted(g.name for g in buf._groups.values())
        # Replaced groups stay while a handle made on them lives (the first layer's), and go
        # at the next dispatch once it is dropped.
        out["retired"] = [sorted(g.name for g in buf._retired)]
        del held, handle
        gc.collect()
        inp = growth_case(0, GROWTH[0][1], 0).inputs(rank)
        buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"],
                     num_tokens_per_expert=np.zeros(8, np.int32))
        out["retired"].append(sorted(g.name for g in buf._retired))
        return out
    finally:
        buf.destroy()


@pytest.mark.slow
def test_token_capacity_follows_the_calls(daemon, ranks) -> None:
    """No token cap below DeepEP's (issue 11): a dispatch with more tokens than the Buffer's
    groups hold, on any rank, makes every rank's group grow (at least doubling) and the call
    runs; a layout beyond the capacity is computed in the caller's process; num_worst_tokens
    grows the group before the call; a handle made before the growth still combines. Every
    output exact against the reference."""
    results = ranks.run_ok([(growing_rank, daemon.socket(r), r) for r in range(2)],
                           timeout=240)
    for r, res in enumerate(results):
        assert res["caps"] == [after for *_, after in GROWTH], res["caps"]
        assert res["groups"] == ["api-grow/h128-k2-bfloat16-e8-t100"], res["groups"]
        before, after = res["retired"]
        assert "api-grow/h128-k2-bfloat16-e8" in before and after == [], res["retired"]
        for i, (_, tokens, worst, _) in enumerate(GROWTH):
            c = growth_case(i, tokens, worst)
            want, got, tag = reference(c), res["layers"][i], f"layer {i} rank {r}"
            lay = want["layout"][r]
            assert_exact(got["layout"][0], lay.num_tokens_per_rank, f"{tag} num_tokens_per_rank")
            assert_exact(got["layout"][1], lay.num_tokens_per_expert,
                         f"{tag} num_tokens_per_expert")
            assert_exact(got["layout"][2], lay.is_token_in_rank, f"{tag} is_token_in_rank")
            assert_exact(got["recv_x"], want["disp"][r].recv_x, f"{tag} recv_x")
            assert_exact(got["cached"], want["cached"][r].recv_x, f"{tag} cached recv_x")
            if i:
                assert_exact(got["cx"], want["comb"][r][0], f"{tag} combined_x")
                assert_exact(got["cw"], want["comb"][r][1], f"{tag} combined_w")
        want = reference(growth_case(0, GROWTH[0][1], 0))
        assert_exact(res["held_cx"], want["comb"][r][0], f"rank {r} held handle combined_x")
        assert_exact(res["held_cw"], want["comb"][r][1], f"rank {r} held handle combined_w")


def test_capacity_from_the_environment(daemon, monkeypatch) -> None:
    """Frameworks build the Buffer themselves: EPD_MAX_TOKENS_PER_RANK sets the normal-mode
    capacity the Buffer starts with; a call beyond it grows the group (doubling) and runs."""
    from epd.client.buffer import Buffer

    monkeypatch.setenv("EPD_MAX_TOKENS_PER_RANK", "lots")
    with pytest.raises(InvalidArgument, match="EPD_MAX_TOKENS_PER_RANK='lots'"):
        Buffer(rank=0, num_ranks=1, socket_dir=daemon.socket_dir, engine=0)
    monkeypatch.setenv("EPD_MAX_TOKENS_PER_RANK", "8")
    buf = Buffer(rank=0, num_ranks=1, socket_dir=daemon.socket_dir, engine=0,
                 group_name="api-capacity")
    try:
        assert buf.max_tokens_per_rank == 8
        assert Buffer(rank=0, num_ranks=1, session=buf.session,
                      max_tokens_per_rank=16).max_tokens_per_rank == 16  # the keyword wins
        idx, w = np.zeros((8, 1), np.int64), np.ones((8, 1), np.float32)
        x = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
        n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(idx, 2)
        recv_x, *_ = buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                  num_tokens_per_expert=n_exp, topk_idx=idx, topk_weights=w)
        assert_exact(recv_x, x, "8 tokens")
        assert buf.max_tokens_per_rank == 8
        idx9, w9 = np.zeros((9, 1), np.int64), np.ones((9, 1), np.float32)
        x9 = np.arange(9 * 64, dtype=np.float32).reshape(9, 64)
        n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(idx9, 2)
        assert_exact(n_rank, np.array([9], np.int32), "layout beyond the capacity")
        recv_x, *_ = buf.dispatch(x9, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                  num_tokens_per_expert=n_exp, topk_idx=idx9, topk_weights=w9)
        assert_exact(recv_x, x9, "9 tokens")
        assert buf.max_tokens_per_rank == 16
    finally:
        buf.destroy()


def test_receive_hook_holds_the_inputs_until_it_ran(monkeypatch) -> None:
    """A hook-mode low-latency call's engine reads the caller's tensors after the trigger, in
    another process: the hook keeps them alive until it has made the stream wait for the op
    (a caller that drops topk_idx at once must not see its block reused before the engine's
    read, as happened on 2x H200). The receive half and the work after it (the FP8 scales'
    re-layout) go on the stream the call was made on, not the one current when the hook is
    called (DeepEP fixes the stream at the call). The op is a stand-in recording signal/wait,
    the stream switch a stand-in recording where `after` ran."""
    import contextlib
    import gc
    import weakref

    from epd.client import buffer_low_latency as BLL

    calls: list = []
    current: list = ["hook caller's stream"]

    @contextlib.contextmanager
    def on_stream(handle, place):
        calls.append(("on_stream", handle))
        current.append(handle)
        yield
        current.pop()

    monkeypatch.setattr(BLL, "on_stream", on_stream)
    op = type("Op", (), {
        "signal": lambda self, buffer: calls.append(("signal", buffer)) or 0x51,
        "wait": lambda self, stream=None: calls.append(("wait", stream)) or 0x51})()
    x, idx = np.zeros((4, 8), np.float32), np.zeros((4, 2), np.int64)
    refs = [weakref.ref(a) for a in (x, idx)]
    after = lambda: calls.append(("after", current[-1]))  # noqa: E731
    hook, event = B.Buffer._trigger(None, op, x, True, False, after, buffer=1, inputs=(x, idx))
    assert calls == [("signal", 1)] and event.event is None
    del x, idx
    gc.collect()
    assert all(r() is not None for r in refs), "an input was dropped before the hook ran"
    hook()
    gc.collect()
    assert calls == [("signal", 1), ("wait", 0x51), ("on_stream", 0x51), ("after", 0x51)], calls
    assert all(r() is None for r in refs), "the hook kept the inputs after it ran"


def two_buffers_rank(endpoint: str, rank: int, port: int) -> dict:
    """Two Buffers on one torch.distributed group (gloo), as a framework with two EP groups of
    the same shape (or two models) makes them: each must get a daemon group of its own."""
    import torch.distributed as dist

    from epd.client.buffer import Buffer
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    bufs = []
    try:
        out: dict = {"names": [], "recv_x": []}
        for i in range(2):
            buf = Buffer(dist.group.WORLD, int(1e9), 0, endpoint=endpoint, max_tokens_per_rank=16)
            bufs.append(buf)
            c = TWO_BUFFERS[i]
            inp = c.inputs(rank)
            n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(inp["topk_idx"],
                                                                   c.num_experts)
            recv_x, *_ = buf.dispatch(inp["x"], num_tokens_per_rank=n_rank,
                                      is_token_in_rank=in_rank, num_tokens_per_expert=n_exp,
                                      topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"])
            out["names"].append(sorted(g.spec.name for g in buf._groups.values()))
            out["recv_x"].append(np.asarray(recv_x).copy())
        return out
    finally:
        for buf in bufs:
            buf.destroy()
        dist.destroy_process_group()


TWO_BUFFERS = [Case(group="unused", num_ranks=2, num_experts=8, hidden=128, num_topk=2,
                    tokens=(6, 9), max_tokens=16, seed=s) for s in (71, 72)]


def test_buffers_of_one_group_get_groups_of_their_own(daemon, ranks) -> None:
    """The default group name is agreed by a Buffer's ranks over its torch group at
    construction (rank 0's token): two Buffers of one shape on one group (or two jobs on one
    node) no longer meet in one daemon group (the second one's join was refused, "rank 0 ...
    is already taken", or worse, ranks of two jobs formed one group)."""
    from epd.server.demo import _free_port
    port = _free_port()
    results = ranks.run_ok([(two_buffers_rank, daemon.socket(r), r, port) for r in range(2)],
                           timeout=120)
    names = [res["names"] for res in results]  # per Buffer, its daemon groups' names
    assert names[0] == names[1], names  # (agreed by the ranks)
    tags = [{n.split("@")[1] for n in buf_names} for buf_names in names[0]]
    assert all(len(t) == 1 for t in tags) and tags[0] != tags[1], names
    assert all(n.startswith("deep_ep/h128-") for buf_names in names[0] for n in buf_names)
    for i, c in enumerate(TWO_BUFFERS):
        want = reference(c)
        for r, res in enumerate(results):
            assert_exact(res["recv_x"][i], want["disp"][r].recv_x, f"buffer {i} rank {r}")


def test_a_growth_that_fails_changes_nothing(daemon) -> None:
    """A dispatch whose num_worst_tokens the daemon cannot hold (a group of 2**30 tokens per
    rank: refused at its join), or that no int32 carries, raises InvalidArgument and leaves the
    Buffer as it was: its capacity, its group, and the next call of the shape runs (it kept
    asking for the huge group, and failed, for the life of the process)."""
    from epd.client.buffer import Buffer

    buf = Buffer(rank=0, num_ranks=1, socket_dir=daemon.socket_dir, engine=0,
                 group_name="api-failed-growth", max_tokens_per_rank=8)
    try:
        idx, w = np.zeros((4, 1), np.int64), np.ones((4, 1), np.float32)
        x = np.arange(4 * 64, dtype=np.float32).reshape(4, 64)

        def dispatch(**kw):
            n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(idx, 2)
            return buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=n_exp, topk_idx=idx, topk_weights=w,
                                **kw)[0]
        assert_exact(dispatch(), x, "before")
        groups = dict(buf._groups)
        with pytest.raises(InvalidArgument, match="num_worst_tokens=4294967296"):
            dispatch(num_worst_tokens=2**32)
        with pytest.raises(InvalidArgument, match="out of range"):
            dispatch(num_worst_tokens=2**30)
        assert buf.max_tokens_per_rank == 8 and buf._groups == groups and not buf._retired
        assert_exact(dispatch(), x, "after")
    finally:
        buf.destroy()


def test_bad_facade_arguments_change_nothing(daemon) -> None:
    """Arguments DeepEP refuses are refused before the call changes anything (no group joined,
    no statistics added, the low-latency double buffer not flipped, the layout's expert count
    not kept), with InvalidArgument (some raised ValueError, from a tuple unpacked or from
    protobuf)."""
    from epd.client.buffer import Buffer

    buf = Buffer(rank=0, num_ranks=1, socket_dir=daemon.socket_dir, engine=0,
                 group_name="api-bad-args", max_tokens_per_rank=8, low_latency_mode=True)
    try:
        x = np.ones((4, 256), dtypes.BFLOAT16)
        idx, w = np.zeros((4, 1), np.int64), np.ones((4, 1), np.float32)
        stats = np.zeros(2, np.int32)
        bad = [
            (lambda: buf.low_latency_dispatch(
                x, idx, 8, 2, cumulative_local_expert_recv_stats=stats, use_fp8=True,
                use_ue8m0=True), "multiple of 512"),
            (lambda: buf.low_latency_dispatch(x, idx, 0, 2), "num_max_dispatch_tokens_per_rank"),
            (lambda: buf.get_dispatch_layout(np.zeros(4, np.int64), 99), "must be 2-D"),
            (lambda: buf.get_dispatch_layout(idx, 2, allocate_on_comm_stream=True),
             "allocate_on_comm_stream"),
            (lambda: buf.dispatch((x, x, x), topk_idx=idx, topk_weights=w,
                                  num_tokens_per_expert=np.zeros(2, np.int32)), "tuple of 3"),
            (lambda: buf.dispatch(x, is_token_in_rank=np.ones((4, 1), bool),
                                  num_tokens_per_expert=np.zeros((2, 1), np.int32)),
             "must be 1-D"),
            (lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, expert_alignment=2**31,
                                  num_tokens_per_expert=np.zeros(2, np.int32)),
             "does not fit in 32 bits"),
        ]
        for i, (call, text) in enumerate(bad):
            with pytest.raises(InvalidArgument, match=text):
                call()
            assert not buf._groups, (i, list(buf._groups))
        assert not stats.any() and buf._ll_buffer == 0 and buf._num_experts is None
    finally:
        buf.destroy()


def test_branch_keywords_are_taken_off_and_refused_on(daemon) -> None:
    """SGLang and vLLM pass the keywords of DeepEP's hybrid-ep / antgroup-opt builds by name
    when they find one (NVFP4 dispatch: use_nvfp4, with x_global_scale, use_ue8m0_for_sf; the
    single-batch-overlap combine: overlap, with its signals, which SGLang passes even with
    overlap off). With the switch off the call is V1's (the same outputs as without them),
    whatever the other keywords hold; on, Unsupported naming the feature, before anything
    changes (no group joined, the double buffer not flipped)."""
    from epd.client.buffer import Buffer

    buf = Buffer(rank=0, num_ranks=1, socket_dir=daemon.socket_dir, engine=0,
                 group_name="api-branch-kw", max_tokens_per_rank=8, low_latency_mode=True)
    try:
        rng = np.random.default_rng(5)
        x = ref.random_x(rng, 4, 256, dtypes.BFLOAT16)
        idx, w = ref.random_routing(rng, 4, 4, 2)
        with pytest.raises(C.Unsupported, match="use_nvfp4=True asks for NVFP4 dispatch"):
            buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False, use_nvfp4=True,
                                     x_global_scale=np.ones(1, np.float32))
        assert not buf._groups and buf._ll_buffer == 0
        plain = buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
        recv, count, handle, _, _ = buf.low_latency_dispatch(
            x, idx, 8, 4, use_fp8=False, use_nvfp4=False,
            x_global_scale=np.ones(1, np.float32), use_ue8m0_for_sf=True)
        np.testing.assert_array_equal(np.asarray(count), np.asarray(plain[1]))
        for le in range(len(count)):
            c = int(count[le])
            np.testing.assert_array_equal(np.asarray(recv[le][:c]).view(np.uint16),
                                          np.asarray(plain[0][le][:c]).view(np.uint16))
        want = np.asarray(buf.low_latency_combine(recv, idx, w, handle)[0]).copy()
        flipped = buf._ll_buffer
        with pytest.raises(C.Unsupported, match="overlap=True asks for the overlapped combine"):
            buf.low_latency_combine(recv, idx, w, handle, overlap=True,
                                    packed_recv_count=np.asarray(count))
        assert buf._ll_buffer == flipped
        for kw in ({"packed_recv_count": np.asarray(count), "comp_signal": None, "block_m": 64,
                    "threshold": 0, "num_sms": 3},  # (SGLang on Hopper, overlap off)
                   {"src_signals": None, "src_signal_expect_value": 0}):  # (Blackwell)
            cx, _, _ = buf.low_latency_combine(recv, idx, w, handle, overlap=False, **kw)
            np.testing.assert_array_equal(np.asarray(cx).view(np.uint16),
                                          want.view(np.uint16))
        assert want.any()
    finally:
        buf.destroy()


def test_a_hook_releases_the_op_it_held() -> None:
    """The receive hook of a call on a held armed op (hook mode) lets the cache evict it once
    the hook's receive half is on the stream: an event recorded there (stand-ins for the op
    and the CUDA event)."""
    from types import SimpleNamespace

    from epd.client.stream_op_cache import StreamOpCache

    class Event:
        def __init__(self, device: int) -> None:
            self.streams: list = []

        def record(self, stream: int) -> None:
            self.streams.append(stream)

    calls: list = []
    op = type("Op", (), {"signal": lambda self, buffer: calls.append(("signal", buffer)) or 7,
                         "wait": lambda self, stream: calls.append(("wait", stream)) or 42,
                         "armed": True, "op_id": 1})()
    cache = StreamOpCache(0, 2, new_event=Event)
    e = cache.arm(("k",), lambda: op, pin=False, capturing=False, hold=True)
    me = SimpleNamespace(_stream_ops=cache)
    hook, _ = B.Buffer._trigger(me, op, np.zeros(4), True, False, inputs=(), entry=e)
    assert e.holds == 1 and e.event is None
    hook()
    # (the receive half on the stream the send half went on; the event recorded there)
    assert calls == [("signal", 0), ("wait", 7)] and e.holds == 0 and e.event.streams == [7]
    # a hook called twice enqueues nothing again and releases no other call's hold
    assert cache.get(("k",), pin=False, hold=True) is e and e.holds == 1
    hook()
    assert e.holds == 1 and len(calls) == 2
    # a call that fails before returning its hook gives its hold back
    with pytest.raises(RuntimeError), B.Buffer._held_until_hook(me, e, "hook"):
        raise RuntimeError("the trigger failed")
    assert e.holds == 0


def test_shrink_buffers_tag_their_groups_by_job(monkeypatch) -> None:
    """A shrink Buffer's instance tag is recomputed by a replacement (no collective with peers
    that went away): the job's identity and the group's ranks; none without a job identity
    (the caller names its Buffers); '@' is refused in a name (it starts the tag)."""
    for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert B.job_instance_tag(None) == ""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    a = B.job_instance_tag(None)
    assert a.startswith("s") and len(a) == 13 and a == B.job_instance_tag(None)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    assert B.job_instance_tag(None) != a
    with pytest.raises(InvalidArgument, match="starts the instance tag"):
        B.Buffer(rank=0, num_ranks=1, group_name="job@exp1")


def test_growth_after_an_earlier_worst_case_failure() -> None:
    """The facade's dispatch (`_dispatch_growing`) with a worst-case dispatch's failure found
    after that call returned (CUDA engine: raised by the next dispatch, every rank alike): it
    grows the group once and raises, without making the call; a failure raised outside a
    dispatch (`capacity_owed`) grows before the next; a growth by num_worst_tokens settles the
    old group first (its failure would be lost with it); a failure of the call itself grows
    and calls again, as before."""
    import types

    from epd.client.buffer import Buffer
    from epd.proto.errors import TokenCapacityExceeded

    grown: list[tuple[str, int]] = []

    def group(name: str, failure: Exception | None = None, owed: int = 0):
        def settle() -> None:
            events.append(("settle", name))
            if failure is not None:
                raise failure
        return types.SimpleNamespace(name=name, num_ranks=2, capacity_owed=owed,
                                     spec=types.SimpleNamespace(max_tokens_per_rank=16),
                                     settle_dispatches=settle)

    def grow(old, needed: int):
        grown.append((old.name, needed))
        events.append(("grow", old.name))
        return group(f"{old.name}+")
    buf = Buffer.__new__(Buffer)
    buf._retired = []
    buf._grow = grow
    calls: list[str] = []

    def run(g):
        calls.append(g.name)
        events.append(("run", g.name))
        return "out"

    events: list[tuple[str, str]] = []
    earlier = TokenCapacityExceeded("dispatch #3 ... no data", tokens_needed=70)
    earlier.earlier = True
    with pytest.raises(TokenCapacityExceeded) as e:
        buf._dispatch_growing(group("a", earlier), 0, run)
    assert e.value is earlier and grown == [("a", 70)] and calls == []

    grown.clear()
    g, out = buf._dispatch_growing(group("b", owed=70), 0, run)
    assert out == "out" and g.name == "b+" and grown == [("b", 70)] and calls == ["b+"]

    grown.clear()
    calls.clear()
    events.clear()
    g, out = buf._dispatch_growing(group("c"), 64, run)  # 64 > 2 ranks x 16: grown first
    assert out == "out" and g.name == "c+" and grown == [("c", 32)]
    assert events == [("settle", "c"), ("grow", "c"), ("run", "c+")]

    grown.clear()
    calls.clear()
    now = TokenCapacityExceeded("dispatch #4", tokens_needed=40)
    attempts = iter([now, None])

    def run_once_failing(g):
        calls.append(g.name)
        err = next(attempts)
        if err is not None:
            raise err
        return "again"
    g, out = buf._dispatch_growing(group("d"), 0, run_once_failing)
    assert out == "again" and grown == [("d", 40)] and calls == ["d", "d+"]


def shrink_job_rank(endpoint: str, job: int, rank: int, port: int) -> dict:
    """A rank of a two-rank job whose processes rendezvous by init_method="tcp://..." and set
    none of TORCHELASTIC_RUN_ID, MASTER_ADDR, MASTER_PORT (vLLM's workers), with a shrink
    Buffer: its low-latency dispatch of x filled with job + 1."""
    import torch
    import torch.distributed as dist

    from epd.client.buffer import Buffer
    for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    buf = Buffer(dist.group.WORLD, 0, 1 << 20, low_latency_mode=True, num_qps_per_rank=1,
                 enable_shrink=True, endpoint=endpoint)
    try:
        gen = torch.Generator().manual_seed(100 * job + rank)
        idx = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(4)])
        x = torch.full((4, 128), float(job + 1)).to(torch.bfloat16)
        recv, count, *_ = buf.low_latency_dispatch(x, idx, 8, 8, use_fp8=False)
        seen = {float(recv[e, i, 0]) for e in range(recv.shape[0]) for i in range(int(count[e]))}
        return {"names": sorted(g.spec.name for g in buf._groups.values()), "seen": sorted(seen)}
    finally:
        buf.destroy()
        dist.destroy_process_group()


def test_shrink_buffers_of_two_jobs_without_a_job_identity_stay_apart(daemon, ranks) -> None:
    """Two jobs whose ranks rendezvous by a tcp:// init method, with none of the job variables
    set, each with a shrink Buffer: each job's groups carry a tag of its own (from the default
    store's address, which a replacement recomputes), so each rank receives its own job's rows
    only (a review: both jobs' tag was "", job 0's rank 1 and job 1's rank 0 formed one group
    and swapped tokens)."""
    from epd.server.demo import _free_port
    ports = [_free_port(), _free_port()]
    results = ranks.run_ok([(shrink_job_rank, daemon.socket(r), job, r, ports[job])
                            for job in (0, 1) for r in range(2)], timeout=120)
    names = [res["names"] for res in results]
    assert names[0] == names[1] and names[2] == names[3] and names[0] != names[2], names
    for job in (0, 1):
        for r in range(2):
            assert results[2 * job + r]["seen"] == [float(job + 1)], (job, r, results)
