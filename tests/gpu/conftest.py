"""GPU tests: collected everywhere, skipped unless CuPy sees an NVIDIA GPU."""

from __future__ import annotations

import pytest


def _gpu_count() -> int:
    try:
        import cupy as cp

        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


GPU_COUNT = _gpu_count()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPU_COUNT:
        return
    skip = pytest.mark.skip(reason="needs CuPy and an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
