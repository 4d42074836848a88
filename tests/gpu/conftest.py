"""GPU tests: collected everywhere, skipped unless CuPy sees an NVIDIA GPU."""

from __future__ import annotations

import os
import time

import pytest


def _gpu_count() -> int:
    try:
        import cupy as cp

        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


GPU_COUNT = _gpu_count()
DAEMON_TIMEOUT = 4.0  # the daemon's collective deadline in the GPU daemon tests


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPU_COUNT:
        return
    skip = pytest.mark.skip(reason="needs CuPy and an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """EPD_GPU_INSTAFAIL=1 (the device scripts' steps): a failure's report at once, since a
    step cut at its time limit never reaches pytest's summary (twenty-first session)."""
    if report.failed and os.environ.get("EPD_GPU_INSTAFAIL") == "1":
        print(f"\n--- FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}",
              flush=True)


@pytest.fixture(scope="module")
def daemon():
    """`epd serve --backend cuda`, one engine per GPU, for one test module."""
    yield from cuda_daemon()


def cuda_daemon(extra: tuple[str, ...] = ()):
    """Start `epd serve --backend cuda` (one engine per GPU, `extra` flags), point spawned
    clients at its MPS server, yield it, stop it (a generator for module fixtures)."""
    from epd.server.demo import Daemon

    # EPD_GPU_LOG_DIR (the device scripts set it to $OUT): the whole daemon log survives a run
    # that is cut short, its teardown watchdog's stacks included.
    log_dir = os.environ.get("EPD_GPU_LOG_DIR")
    log_path = (os.path.join(log_dir, f"daemon-{os.getpid()}-{time.monotonic_ns()}.log")
                if log_dir else None)
    d = Daemon(backend="cuda", engines=GPU_COUNT, timeout_seconds=DAEMON_TIMEOUT,
               extra=["--nvshmem-heap-bytes", str(6 << 30), *extra], log_path=log_path)
    saved = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    try:
        d.wait_ready(180)
        os.environ.update(d.client_env())  # spawned clients share the daemon's MPS server
    except Exception:
        print(d.log())
        d.stop()
        raise
    yield d
    if saved is None:
        os.environ.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    else:
        os.environ["CUDA_MPS_PIPE_DIRECTORY"] = saved
    print(d.log()[-4000:])
    assert d.stop() == 0
