"""One ABI source: every number the CUDA sources share with Python is defined in proto/abi.py;
this test parses the CUDA text (header + kernel files, as NVRTC compiles it) and fails when a
#define drifts. It also checks every launch the Python driver makes (normal and low-latency
kernels) against the kernel's parameter list: count and kind of every argument."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from epd.proto import abi, counter_page
from epd.server.backends import cuda_kernels as ck

SOURCE = re.sub(r"//[^\n]*", "", ck._source())  # (comments may hold parentheses)
DEFINES = dict(re.findall(r"^\s*#define\s+(\w+)\s+([^\s/]+)", SOURCE, re.M))

# header name -> abi value (same name unless listed)
RENAMED = {"EPD_MAX_RANKS": abi.MAX_RANKS}
NOT_ABI = {"FULL_MASK"}  # CUDA-only


def _c_value(text: str) -> float:
    t = text.rstrip("uUlLfF") if not text.lower().startswith("0x") else text.rstrip("uU")
    return float(int(t, 0)) if re.fullmatch(r"0[xX][0-9a-fA-F]+|\d+", t) else float(t)


def test_every_define_matches_abi() -> None:
    checked = 0
    for name, text in DEFINES.items():
        if name in NOT_ABI:
            continue
        want = RENAMED.get(name, getattr(abi, name, None))
        assert want is not None, f"#define {name} has no definition in proto/abi.py"
        assert _c_value(text) == float(want), f"{name}: CUDA says {text}, abi.py {want}"
        checked += 1
    assert checked >= 40


def test_python_users_take_the_abi() -> None:
    assert counter_page.SLOT_BYTES == abi.SLOT_BYTES
    assert counter_page.HEADER_WORDS == abi.SLOT_HEADER
    assert (counter_page.SEQ, counter_page.NUM_RECV, counter_page.NUM_EXPERTS,
            counter_page.STATUS) == (abi.SLOT_SEQ, abi.SLOT_NUM_RECV, abi.SLOT_NUM_EXPERTS,
                                     abi.SLOT_STATUS)
    assert ck.MAX_RANKS == abi.MAX_RANKS and ck.ERR_ABORTED == abi.ERR_ABORTED
    # the abort word and stream done word layouts the kernels build from these shifts
    assert "<< ABORT_RANK_SHIFT" in SOURCE and "<< DONE_CODE_SHIFT" in SOURCE
    for path in ("client/stream_ops.py", "server/engine/stream_ops.py"):
        text = (Path(__file__).resolve().parents[1] / path).read_text()
        m = re.search(r"^DONE_OK, DONE_FAILED, DONE_RELEASED = (\d), (\d), (\d)", text, re.M)
        if m:  # a local copy must at least agree (one import from proto/abi.py is the goal)
            assert tuple(map(int, m.groups())) == (abi.DONE_OK, abi.DONE_FAILED,
                                                   abi.DONE_RELEASED), path


def _params(kernel: str) -> list[str]:
    m = re.search(rf"\b{re.escape(kernel)}\s*\(([^)]*)\)\s*\{{", SOURCE)
    assert m, f"{kernel} not found in the kernel source"
    return [" ".join(p.split()) for p in m.group(1).split(",")]


def _c_kind(param: str) -> str:
    if "*" in param:
        return "ptr"
    ctype = param.rsplit(" ", 1)[0].replace("const ", "")
    return {"int": "i32", "i64": "i64", "u64": "u64", "unsigned": "u32"}[ctype]


_STRUCT_KINDS = {"Q": "u64", "q": "i64", "i": "i32", "I": "u32"}


def _constant_name(arg: ast.AST) -> str | None:
    """"name" / f"name<{...}>" -> the kernel's name."""
    if isinstance(arg, ast.Constant):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and isinstance(arg.values[0], ast.Constant):
        return arg.values[0].value.split("<")[0]
    return None


def _kernel_name(node: ast.AST) -> str | None:
    """`self.fn("name")` / `self.fn(f"name<{...}>")` -> the kernel's name."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "fn" and node.args):
        return _constant_name(node.args[0])
    return None


def _py_kind(node: ast.AST) -> str:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "np":
        return {"int32": "i32", "int64": "i64", "uint64": "u64"}[node.func.attr]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_ptr":
        return "ptr"
    if isinstance(node, ast.Name) and node.id in ("_P", "_I64", "_I32", "_U64", "_U32"):
        return {"_P": "ptr", "_I64": "i64", "_I32": "i32", "_U64": "u64", "_U32": "u32"}[node.id]
    return "ptr"  # a CuPy array: CuPy passes its device pointer


def _launches() -> list[tuple[str, list[str], int]]:
    """(kernel, argument kinds, line) of every launch in cuda_kernels.py: CuPy calls
    `self.fn(name)(grid, block, (args...))`, packed `Launch(self.fn(name), g, b, [...])` and
    `self._packed(name, FMT)(grid, block, shared, stream, *args)` (FMT: struct codes)."""
    tree = ast.parse(Path(ck.__file__).read_text())
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Call) and isinstance(f.func, ast.Attribute)
                and f.func.attr == "_packed"):
            name = _constant_name(f.args[0])
            fmt = getattr(ck, f.args[1].id)
            out.append((name, [_STRUCT_KINDS[c] for c in fmt], node.lineno))
            continue
        name = _kernel_name(node.func)
        if name is not None and len(node.args) >= 3 and isinstance(node.args[2], ast.Tuple):
            out.append((name, [_py_kind(a) for a in node.args[2].elts], node.lineno))
        if isinstance(node.func, ast.Name) and node.func.id == "Launch":
            name = _kernel_name(node.args[0])
            packed = node.args[3]
            assert isinstance(packed, ast.List)
            out.append((name, [_py_kind(t.elts[0]) for t in packed.elts], node.lineno))
    return out


LAUNCHES = _launches()


def test_every_engine_kernel_is_launched_and_checked() -> None:
    launched = {name for name, _, _ in LAUNCHES}
    for name in (*ck.Kernels.NAMES, *(t.split("<")[0] for t in ck.Kernels.TEMPLATES)):
        assert name in launched, f"{name} is compiled but never launched from cuda_kernels.py"
    assert {"epd_layout", "epd_notify", "epd_dispatch", "epd_combine_push",
            "epd_combine_reduce"} <= launched


@pytest.mark.parametrize(("kernel", "kinds", "line"), LAUNCHES,
                         ids=[f"{k}:{ln}" for k, _, ln in LAUNCHES])
def test_launch_matches_signature(kernel: str, kinds: list[str], line: int) -> None:
    params = _params(kernel)
    assert len(kinds) == len(params), (f"{kernel} (cuda_kernels.py:{line}) passes "
                                       f"{len(kinds)} arguments; the kernel takes {len(params)}")
    for i, (got, param) in enumerate(zip(kinds, params, strict=True)):
        want = _c_kind(param)
        ok = got == want or (got == "u64" and want == "ptr") or (got == "ptr" and want == "u64")
        assert ok, f"{kernel} argument {i} ({param!r}): Python passes {got}"


@pytest.mark.parametrize(("kernel", "index"), [
    ("epd_ll_dispatch", ck.LL_DISPATCH_SEQ),
    ("epd_ll_combine_push", ck.LL_PUSH_SEQ),
    ("epd_ll_combine_reduce", ck.LL_REDUCE_SEQ),
])
def test_packed_launch_sequence_argument(kernel: str, index: int) -> None:
    """`Launch.set(index, seq)` must hit the kernel's `u64 seq`."""
    param = _params(kernel)[index]
    assert param.split()[-1] == "seq" and param.startswith("u64")


def test_call_done_sequence_argument() -> None:
    """The stream-ordered call's done word is a u32 (cuStreamWaitValue32 compares 32 bits)."""
    param = _params("epd_call_done")[ck.CALL_DONE_SEQ]
    assert param.split()[-1] == "seq" and param.startswith("unsigned")
