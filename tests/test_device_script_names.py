"""The scripts that run only on a GPU machine (benchmarks/*.py, tests/gpu/*.py) name EPD's
modules, functions and private helpers that CI never calls from them: a rename leaves them
broken until a device call finds out, at the price of its device time (the fiftieth session
lost a call to `probe_calls.py` naming `stream_calls._stream`, gone since). This reads them
without running them and checks that every `epd.*` name they import, and every attribute
they take of an imported `epd` module, exists."""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("tests/gpu/*.py")])


def _module(name: str) -> types.ModuleType | None:
    """The module, or None where it needs what this machine lacks (cupy, a GPU)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if (e.name or "").startswith("epd"):
            raise  # (an epd module that is gone: the finding itself)
        return None


def _names(tree: ast.AST) -> tuple[list[tuple[str, str, int]], dict[str, str]]:
    """(module, name, line) of every `from epd... import name`, and the local names bound to
    epd modules (`import epd.x.y as m`, `from epd.x import y` where y is a module)."""
    imported: list[tuple[str, str, int]] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "epd" or node.module.startswith("epd.")):
            for a in node.names:
                imported.append((node.module, a.name, node.lineno))
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("epd.") and a.asname:
                    aliases[a.asname] = a.name
    return imported, aliases


def _missing(source: str) -> list[str]:
    """What a script's text names of EPD that does not exist, a line each."""
    tree = ast.parse(source)
    imported, aliases = _names(tree)
    missing = []
    for mod, name, line in imported:
        m = _module(mod)
        if m is None:
            continue
        if not hasattr(m, name):
            try:  # (a submodule not imported by its package)
                importlib.import_module(f"{mod}.{name}")
            except ModuleNotFoundError:
                missing.append(f"line {line}: from {mod} import {name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            full = aliases[node.value.id]
            try:
                m = _module(full)
            except ImportError:
                continue  # (a function or class imported by name: reported above if gone)
            if m is not None and not hasattr(m, node.attr):
                missing.append(f"line {node.lineno}: {node.value.id}.{node.attr} "
                               f"({full} has no {node.attr!r})")
    return missing


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_epd_names_a_device_script_uses_exist(path: Path) -> None:
    missing = _missing(path.read_text())
    assert not missing, f"{path.relative_to(ROOT)} names what EPD no longer has:\n" + \
        "\n".join(missing)


def test_the_check_finds_a_name_that_is_gone() -> None:
    """The check above can fail: the fiftieth session's stale probe, a helper imported by name
    that is gone, and names that exist."""
    assert _missing("from epd.client import stream_calls as sc\n"
                    "sc._stream(1)\nsc.StreamSlot\n") == [
        "line 2: sc._stream (epd.client.stream_calls has no '_stream')"]
    assert _missing("from epd.client.stream_calls import no_such_helper\n") == [
        "line 1: from epd.client.stream_calls import no_such_helper"]
    assert _missing("from epd.client import Session, stream_calls\n"
                    "stream_calls.StreamSlot\n") == []
