"""Which array libraries the calling process has loaded.

An object can only be a torch tensor once torch is imported, so the client asks `sys.modules`
and never pays for the import (seconds in a fresh process) on behalf of a NumPy or CuPy caller.
"""

from __future__ import annotations

import sys
from types import ModuleType


def torch_if_loaded() -> ModuleType | None:
    """torch if this process has imported it, else None. A torch another thread is still
    importing (in sys.modules from the import's start, without its names yet) is not loaded:
    no object can be one of its tensors yet (a fuzzer's NumPy calls raised AttributeError on
    `torch.Tensor` meanwhile)."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and hasattr(torch, "Tensor") else None
