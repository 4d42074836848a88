"""Issue 11 on the GPU: the vLLM, SGLang and Megatron-LM call sequences of
tests/test_framework_replays.py, unchanged, with CUDA torch tensors (rank r on cuda:r) against
the CUDA engine, every output compared bit for bit with server/reference.py.

The replays' ranks are threads of this process with their own Buffer and Session each, as
there; they need one GPU per rank (two sessions of one process must not open the same engine's
heap twice), so this module runs on a machine with two or more GPUs."""

from __future__ import annotations

import pytest
import test_framework_replays as replays  # (tests/ is on sys.path, as for ranklib)
from test_framework_replays import *  # noqa: F403  (the replays, collected here again)

from .conftest import GPU_COUNT

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(GPU_COUNT < 2, reason="needs a GPU per rank (2 GPUs)")]


@pytest.fixture
def env(daemon, monkeypatch):
    """The user's environment with the CUDA daemon; the replays' tensors on the GPUs."""
    monkeypatch.setenv("EPD_SOCKET_DIR", daemon.socket_dir)
    for k in ("EPD_ENGINE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(replays, "DEVICES", [f"cuda:{i}" for i in range(GPU_COUNT)])
    return daemon
