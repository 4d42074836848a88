"""Refuse to stand in for DeepEP when a real DeepEP is installed too: one of the two would
silently shadow the other, depending on sys.path order."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os
import sys

SHIM_DISTRIBUTION = "epd-deep-ep-shim"
_DEEPEP_NAMES = {"deep-ep", "deepep"}


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _ours(origin: str | None) -> bool:
    """Whether a `deep_ep_cpp` found is this shim's own module (beside the package)."""
    mine = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "deep_ep_cpp.py")
    return origin is not None and os.path.realpath(origin) == os.path.realpath(mine)


def real_deepep() -> str | None:
    """Where a real DeepEP is installed (its extension module, or a distribution other than
    this shim named deep_ep / providing the `deep_ep` package), else None."""
    for entry in sys.path:  # (every one: the shim's own deep_ep_cpp may come first)
        spec = importlib.machinery.PathFinder.find_spec("deep_ep_cpp", [entry or "."])
        if spec is not None and not _ours(spec.origin):
            return f"its extension deep_ep_cpp at {spec.origin}"
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name") or ""
        if _normalize(name) == SHIM_DISTRIBUTION:
            continue
        top = (dist.read_text("top_level.txt") or "").split()
        if _normalize(name) in _DEEPEP_NAMES or "deep_ep" in top:
            where = getattr(dist, "_path", None)
            return f"the distribution {name!r}" + (f" at {where}" if where else "")
    return None


def check() -> None:
    other = real_deepep()
    if other is not None:
        here = os.path.dirname(os.path.abspath(__file__))
        raise ImportError(
            f"deep_ep: both EPD's deep_ep shim ({here}, distribution {SHIM_DISTRIBUTION!r}) and "
            f"a real DeepEP ({other}) are installed; refusing to shadow one with the other. "
            f"Uninstall one of them (`pip uninstall {SHIM_DISTRIBUTION}` to use DeepEP), or "
            f"import EPD's facade directly: `from epd.client import buffer as deep_ep`.")
