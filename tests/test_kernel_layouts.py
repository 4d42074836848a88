"""Host-side contracts of the CUDA kernels, checked without a GPU: the low-latency buffer layout
and the packed launches' argument positions against the kernel signatures in cuda/."""

from __future__ import annotations

import ast
import ctypes
import itertools
import re
import struct
from pathlib import Path

import pytest

from epd.proto import abi, dtypes
from epd.server.backends import cuda_kernels as ck
from epd.server.backends.base import GroupSpec

SOURCE = ck._source()


def _params(kernel: str) -> list[str]:
    """The parameter declarations of a kernel in the compiled source."""
    m = re.search(rf"\b{re.escape(kernel)}\s*\(([^)]*)\)\s*\{{", SOURCE)
    assert m, f"{kernel} not found in the kernel source"
    return [p.strip() for p in m.group(1).split(",")]


@pytest.mark.parametrize(("kernel", "index", "count"), [
    ("epd_ll_dispatch", ck.LL_DISPATCH_SEQ, 26),
    ("epd_ll_combine_push", ck.LL_PUSH_SEQ, 18),
    ("epd_ll_combine_reduce", ck.LL_REDUCE_SEQ, 16),
])
def test_packed_launch_sequence_argument(kernel: str, index: int, count: int) -> None:
    """`Launch.set(index, seq)` must hit the kernel's `u64 seq`, and the launch builders in
    cuda_kernels.py pack exactly as many arguments as the kernel takes."""
    params = _params(kernel)
    assert len(params) == count
    assert params[index].split()[-1] == "seq" and params[index].startswith("u64")
    builder, which = {"epd_ll_dispatch": ("ll_dispatch_launch", 0),
                      "epd_ll_combine_push": ("ll_combine_launches", 0),
                      "epd_ll_combine_reduce": ("ll_combine_launches", 1)}[kernel]
    tree = ast.parse(Path(ck.__file__).read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == builder)
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id == "Launch"]
    calls.sort(key=lambda n: n.lineno)
    packed = calls[which].args[3]
    assert isinstance(packed, ast.List) and len(packed.elts) == count, kernel
    seq = packed.elts[index]
    assert isinstance(seq, ast.Tuple) and ast.unparse(seq.elts[0]) == "_U64", kernel


def test_low_latency_layout_is_aligned_and_disjoint() -> None:
    lay = ck.LowLatencyLayout.build(1000, num_ranks=2, num_local_experts=128, hidden=7168,
                                    num_topk=8, max_tokens=128, itemsize=2)
    # every buffer of both receive buffers and the shared ones, each at least its size
    rows = 128 * 2 * 128
    # (hist: each source's counts and its verdict; topk: the header, then the ids)
    sizes = {"hist": 2 * (2 * 128 + abi.LL_HIST_VERDICT) * 4, "recv_x": rows * 7168 * 2,
             "scales": rows * 56 * 4, "src_rank": rows * 4, "src_idx": rows * 4,
             "src_k": rows * 4, "recv_count": 128 * 4,
             "topk": abi.LL_TOPK_HEADER + 128 * 8 * 8, "comb": 128 * 8 * 7168 * 2,
             "combined_x": 128 * 7168 * 2}
    spans = sorted((lay.offset(n, b), sizes[n], f"{n}/{b}") for n in sizes
                   for b in ((0, 1) if n in lay.PER_BUFFER else (0,)))
    assert spans[0][0] >= 1000 and len(spans) == 17
    for (a, size, name), (b, _, _) in itertools.pairwise(spans):
        assert a % ck.ALIGN == 0 and b >= a + size, name
    assert lay.end >= spans[-1][0] + spans[-1][1]
    assert lay.offset("recv_x", 1) - lay.offset("recv_x", 0) == lay.buffer_stride
    assert lay.offset("comb", 1) == lay.offset("comb", 0)  # shared
    with pytest.raises(ValueError, match="1024 local experts"):
        ck.LowLatencyLayout.build(0, num_ranks=1, num_local_experts=2048, hidden=128,
                                  num_topk=1, max_tokens=1, itemsize=2)


def test_low_latency_buffers_only_for_groups_that_ask() -> None:
    """The reason low_latency_mode is opt-in: at prefill sizes the [L, R*M, H] buffers alone
    would be ~15 GB per rank."""
    from epd.server.backends.cuda_plan import membership_layout

    def spec(tokens: int, ll: bool) -> GroupSpec:
        return GroupSpec("g", 2, 256, 7168, tokens, 8, dtypes.from_name("bfloat16"), ll)

    assert membership_layout(spec(4096, False)).low_latency is None
    small = membership_layout(spec(128, True))
    assert small.low_latency is not None
    assert small.slot_bytes > membership_layout(spec(128, False)).slot_bytes
    assert small.slot_bytes < 1 << 30  # config D: fits a rank slot of the default heap
    assert membership_layout(spec(4096, True)).slot_bytes > 14 << 30


@pytest.mark.parametrize(("kernel", "args"), [
    ("epd_ll_dispatch", ck.LL_DISPATCH_BUFFER_ARGS),
    ("epd_ll_combine_push", ck.LL_PUSH_BUFFER_ARGS),
    ("epd_ll_combine_reduce", ck.LL_REDUCE_BUFFER_ARGS),
])
def test_receive_buffer_arguments(kernel: str, args: dict[int, str]) -> None:
    """`Launch.set_buffer` rewrites the offsets that pick a receive buffer: each index must be
    the kernel's `i64 o_<name>` parameter, and every per-buffer offset the kernel takes must be
    in the table (a missed one would read buffer 0 while the rest reads buffer 1)."""
    params = _params(kernel)
    for index, name in args.items():
        assert params[index] == f"i64 o_{name}", (kernel, index, params[index])
    per_buffer = {f"i64 o_{n}" for n in ck.LowLatencyLayout.PER_BUFFER}
    assert {i for i, p in enumerate(params) if p in per_buffer} == set(args), kernel



def test_packed_offsets_follow_native_alignment() -> None:
    """Each argument's pointer lands on its own bytes: an int between 8-byte values is padded."""
    from epd.proto.cuda_driver import PackedArguments

    p = PackedArguments("iqiQ")
    base = ctypes.addressof(p._buf)
    assert [a - base for a in p._argv] == [0, 8, 16, 24]
    assert p.pack(-3, -(1 << 40), 7, (1 << 63) + 5) == p.argv == ctypes.addressof(p._argv)
    raw = bytes(p._buf)
    assert struct.unpack_from("<i", raw, 0)[0] == -3
    assert struct.unpack_from("<q", raw, 8)[0] == -(1 << 40)
    assert struct.unpack_from("<i", raw, 16)[0] == 7
    assert struct.unpack_from("<Q", raw, 24)[0] == (1 << 63) + 5


def _declared(source: str, kernel: str) -> list[str]:
    """A kernel's parameter declarations in `source`: comments removed, up to the parenthesis
    that closes its parameter list, where the body follows."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", source, flags=re.S)
    for m in re.finditer(rf"\b{re.escape(kernel)}\s*\(", text):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        if re.match(r"\s*\{", text[i:]):
            return [p.strip() for p in text[m.end():i - 1].split(",")]
    raise AssertionError(f"{kernel} not defined in the source")


def _codes(params: list[str]) -> str:
    """A kernel's parameter declarations as struct codes: a pointer Q, 64-bit q or Q, int i,
    unsigned I."""
    codes = []
    for p in params:
        decl = p.split("=")[0].strip()
        if "*" in decl:
            codes.append("Q")
            continue
        words = decl.replace("const", "").split()[:-1]  # (the type, without the name)
        kind = " ".join(words)
        codes.append({"i64": "q", "long long": "q", "u64": "Q", "unsigned long long": "Q",
                      "int": "i", "unsigned": "I", "unsigned int": "I", "u32": "I"}[kind])
    return "".join(codes)


@pytest.mark.parametrize(("module", "kernel", "codes"), [
    ("received_rows", "epd_copy_received", "COPY_ARGS"),
    ("ll_trigger", "epd_ll_trigger", "TRIGGER_ARGS"),
    ("local_layout", "epd_layout", None),
])
def test_client_packed_launches_match_their_kernels(module: str, kernel: str,
                                                    codes: str | None) -> None:
    """The struct codes a client launch packs are its kernel's parameters, in order and size
    (a wrong code shifts every argument after it)."""
    import importlib

    from epd.proto import kernel_sources

    m = importlib.import_module(f"epd.client.{module}")
    source = m.source() if hasattr(m, "source") else m._SOURCE
    fmt = getattr(m, codes) if codes else kernel_sources.LAYOUT_ARGS
    assert _codes(_declared(source, kernel)) == fmt


@pytest.mark.parametrize(("kernel", "codes"), [
    ("epd_layout", "LAYOUT_ARGS"), ("epd_notify", "NOTIFY_ARGS"),
    ("epd_wide_notify", "WIDE_NOTIFY_ARGS"), ("epd_stage_errors", "STAGE_ERRORS_ARGS"),
    ("epd_dispatch", "DISPATCH_ARGS"), ("epd_combine_push", "COMBINE_PUSH_ARGS"),
    ("epd_combine_reduce", "COMBINE_REDUCE_ARGS"), ("epd_combine_refused", "COMBINE_REFUSED_ARGS"),
])
def test_engine_packed_launches_match_their_kernels(kernel: str, codes: str) -> None:
    """The engine's packed launches (cuda_kernels.Packed) against the kernels they launch."""
    params = _declared(SOURCE, kernel)
    assert _codes(params) == getattr(ck, codes), (kernel, params)
