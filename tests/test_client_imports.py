"""A client that uses NumPy never pays for importing torch (seconds on a small machine: enough
to miss a collective's deadline on its first call, which is how this was found)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import sys
import numpy as np
from epd.client import Session
with Session(sys.argv[1], timeout=10) as s:
    g = s.join("no-torch", rank=0, num_ranks=1, num_experts=4, hidden=64,
               max_tokens_per_rank=8, num_topk=2, dtype="float32")
    idx = np.array([[0, 1], [2, 3], [1, -1]], np.int64)
    x = np.ones((3, 64), np.float32)
    g.get_dispatch_layout(idx)
    out = g.dispatch(x, idx, np.ones((3, 2), np.float32))
    g.combine(out.recv_x, out.handle)
print("torch" in sys.modules)
"""


def test_numpy_client_does_not_import_torch(daemon) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, daemon.socket(0)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False", "the client imported torch for a NumPy caller"


def test_a_torch_still_being_imported_is_not_loaded(monkeypatch) -> None:
    """Another thread's `import torch` puts the module in sys.modules before its names exist:
    a NumPy caller's call meanwhile must not look for `torch.Tensor` (a fuzzer's calls raised
    AttributeError: partially initialized module 'torch')."""
    import sys
    import types

    import numpy as np

    from epd.client import frameworks, tensors

    partial = types.ModuleType("torch")  # (as sys.modules holds it mid-import: no names yet)
    monkeypatch.setitem(sys.modules, "torch", partial)
    assert frameworks.torch_if_loaded() is None
    assert tensors.is_torch(np.zeros(2)) is False
