"""The structure the docs promise, checked: imports follow the tree without cycles, the backend
is the only place that knows its own name, and the code cites nothing outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"server": "epd.server", "client": "epd.client", "proto": "epd.proto"}
# A separate, opt-in distribution (`import deep_ep` -> EPD's facade): not part of epd.client.
OTHER_DISTRIBUTIONS = ("client/deep_ep_shim/",)


def _ours(path: Path) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return not any(rel.startswith(d) for d in OTHER_DISTRIBUTIONS)


def _modules() -> dict[str, Path]:
    mods = {}
    for top, pkg in PACKAGES.items():
        for f in (ROOT / top).rglob("*.py"):
            if "_pb2" in f.name or not _ours(f):
                continue
            rel = f.relative_to(ROOT / top).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = f
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every epd module `name` imports at run time, at module level or inside functions (a
    lazy import that breaks a cycle at run time is still a cycle to a reader)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and ast.unparse(block.test).endswith("TYPE_CHECKING")
                   for stmt in block.body for n in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:  # annotations only: no import at run time
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                out.add(full if full in known else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in known and m != name}


def test_server_client_proto_use_relative_imports():
    offenders = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and \
                    (node.module or "").startswith("epd."):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module}")
    assert not offenders, "absolute epd.* imports (use relative ones):\n" + "\n".join(offenders)


def test_no_import_cycles():
    mods = _modules()
    known = set(mods)
    graph = {m: _imports(m, p, known) for m, p in mods.items()}
    # A package's __init__ importing its own submodules is not a cycle to a reader.
    for m in graph:
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append([*stack[stack.index(d):], d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# Outside server/backends/ only the CLI chooses a backend by name (a torch device's type is
# not a backend).
NAME_CHECK = re.compile(r"""(==|!=)\s*["'](cpu|cuda)["']|["'](cpu|cuda)["']\s*(==|!=)""")


def test_no_backend_name_branches_outside_the_backends():
    offenders = []
    for path in _modules().values():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("server/backends/") or rel == "server/cli.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if NAME_CHECK.search(line) and "device.type" not in line:
                offenders.append(f"{rel}:{i}: {line.strip()}")
    assert not offenders, "branches on a backend's name:\n" + "\n".join(offenders)


def test_code_cites_nothing_outside_the_repository():
    pattern = re.compile(r"DESIGN\.md|STACK\.md|\.\./shared|seeds/")
    offenders = []
    for path in [*ROOT.glob("server/**/*.py"), *ROOT.glob("client/**/*.py"),
                 *ROOT.glob("proto/*.py"), *ROOT.glob("cuda/*.cu*")]:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) and "DESIGN_NOTES" not in line:
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "citations of files outside the repository:\n" + "\n".join(offenders)


def test_readme_layout_table_names_every_module():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Layout of the repository"):]
    table = table[:table.index("\n## ", 3)]
    missing = []
    for top in ("server", "client", "proto"):
        for f in (ROOT / top).rglob("*.py"):
            if f.name == "__init__.py" or "_pb2" in f.name or "generate" in f.name:
                continue
            if not _ours(f):
                if f.parts[-3] not in table:  # the shim is named by its folder
                    missing.append(f.relative_to(ROOT).as_posix())
                continue
            if f.name not in table and f.stem not in table:
                missing.append(f.relative_to(ROOT).as_posix())
    for f in (ROOT / "cuda").glob("*.cu*"):
        if f.name not in table:
            missing.append(f.relative_to(ROOT).as_posix())
    assert not missing, "modules the README's layout table does not mention:\n" + \
        "\n".join(sorted(missing))


def test_host_threads_spin_without_timed_sleeps():
    """A spin that lets other threads run calls spin.relax(), never time.sleep(0): a timed
    sleep is rounded up by Linux's timer slack (~60 µs per look, every hop of a call paid it
    for sessions; proto/spin.py)."""
    found = []
    for top in ("server", "client", "proto"):
        for f in (ROOT / top).rglob("*.py"):
            if f == ROOT / "proto" / "spin.py":  # (its fallback, and why it is not used)
                continue
            for n, line in enumerate(f.read_text().splitlines(), 1):
                # (asyncio.sleep(0) is a bare yield to the event loop, no timer: allowed)
                if re.search(r"(?<!asyncio\.)\bsleep\(\s*0(\.0*)?\s*\)", line):
                    found.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "timed zero sleeps (use spin.relax()):\n" + "\n".join(found)


def test_kernels_read_host_words_only_after_long_waits():
    """The kernels reach the engine's host control words only through wait_flag's branch
    after HOST_POLL_AFTER_NS and host_gone() right after such a wait: reads on a kernel's fast
    path made every call several times slower for three sessions (docs/GPU_NOTES.md)."""
    text = "\n".join(f.read_text() for f in sorted((ROOT / "cuda").glob("*.cu*")))
    calls = [m.start() for m in re.finditer(r"\bhost_words\(", text)]
    # the definition, wait_flag's caller (block_wait_all) and host_gone: nothing else
    owners = set()
    for pos in calls:
        head = text.rfind("__device__", 0, pos)
        owners.add(re.search(r"(\w+)\(", text[head:]).group(1))
    assert owners <= {"host_words", "block_wait_all", "host_gone"}, owners
    body = text[text.index("int wait_flag("):]
    body = body[:body.index("\n}\n")]
    assert re.search(r"host != nullptr && waited > HOST_POLL_AFTER_NS", body), \
        "wait_flag reads the host words before HOST_POLL_AFTER_NS"
    uses = [m.start() for m in re.finditer(r"\bhost_gone\(", text)]
    for pos in uses[1:]:  # (uses[0]: its definition)
        line = text[text.rfind("\n", 0, pos):text.find("\n", pos)]
        assert "HOST_POLL_AFTER_NS" in line, f"host_gone() outside a long wait: {line.strip()}"
