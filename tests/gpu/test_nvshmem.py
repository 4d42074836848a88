"""Multi-process run: one NVSHMEM PE per GPU (UID bootstrap, no MPI), 1 and 2 ranks per PE."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import GPU_COUNT

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _has_nvshmem() -> bool:
    try:
        import nvshmem.core  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.parametrize("ranks_per_pe", [1, 2])
def test_nvshmem_multiprocess(tmp_path: Path, ranks_per_pe: int) -> None:
    if GPU_COUNT < 2 or not _has_nvshmem():
        pytest.skip("needs 2 GPUs and nvshmem4py")
    _run_pes(tmp_path, ranks_per_pe, {})


@pytest.mark.parametrize("ranks_per_pe", [1, 2])
def test_nvshmem_two_pes_on_one_gpu_under_mps(tmp_path: Path, ranks_per_pe: int) -> None:
    """NVSHMEM's multiple-processes-per-GPU mode: two PEs (two processes, as two engines of
    logical nodes would be) on GPU 0, sharing one MPS server with half the threads each (the
    NVSHMEM requirement), EPD's kernels between them over NVSHMEM peer pointers. What makes a
    logical-node cluster testable on a one-GPU machine (issue 13). Two ranks per PE: one
    thread drives both in lock-step (it deadlocked while kernels were loaded at their first
    launch: cuda_driver.load_function)."""
    if GPU_COUNT < 1 or not _has_nvshmem():
        pytest.skip("needs a GPU and nvshmem4py")
    with _two_pes_env() as env:
        _run_pes(tmp_path, ranks_per_pe, env)


@pytest.mark.parametrize("ranks_per_node", [1, 2, 8])
def test_low_latency_across_logical_nodes(tmp_path: Path, ranks_per_node: int) -> None:
    """Issue 13: two logical nodes (two PEs, each its own node with `ranks_per_node` ranks);
    a rank on the other node is reached only through NVSHMEM's device API (the kernels built
    with EPD_NVSHMEM, cuda_remote.py), ranks of one node by pointer. Low-latency dispatch
    (bf16, FP8, rounded scales, both receive buffers, dropped entries, an empty rank) and
    combine are bit-exact against the reference on every rank; a bad expert id on rank 0
    fails that call on every rank of both nodes alike (its verdict travels with the
    histogram) and the next call is exact. 8 ranks per node: a 16-rank group, more than one
    node's normal mode takes. On one GPU both PEs share it under MPS, so
    NVSHMEM's P2P transport carries the puts: not its network proxy."""
    _across_logical_nodes(tmp_path, ranks_per_node, "nvshmem_ll_worker.py")


@pytest.mark.parametrize("ranks_per_node", [1, 2, 4])
def test_normal_mode_across_logical_nodes(tmp_path: Path, ranks_per_node: int) -> None:
    """Issue 13: normal mode (notify, dispatch, cached dispatch, combine) on a group over two
    logical nodes (two PEs; 2, 4 and 8 ranks): rows, scales and metadata to a rank on the other
    node are staged in the sender's own buffer and put through NVSHMEM (never a pointer), its
    counts and flags likewise. The group is node-major, so it runs the hierarchical semantics:
    every output bit-exact against reference.hierarchical_dispatch / hierarchical_combine (and
    the flat semantics once, against the flat reference). On one GPU both PEs share it under
    MPS (NVSHMEM's P2P transport carries the puts, not a network)."""
    _across_logical_nodes(tmp_path, ranks_per_node, "nvshmem_normal_worker.py")



@pytest.mark.parametrize("ranks_per_node", [1, 2, 4, 8])
def test_two_stage_normal_mode_across_logical_nodes(tmp_path: Path, ranks_per_node: int) -> None:
    """Issue 13, DeepEP's hierarchical traffic: a node-major group over two logical nodes
    (2, 4, 8 and 16 ranks) runs normal mode in two stages (server/backends/cuda_stages.py, as
    the engine builds them): the whole group's notify (beyond MAX_RANKS = 8 ranks,
    epd_wide_notify), the rail stage (a token once per destination node, through NVSHMEM) and
    the node stage (by pointer), and combine backwards.
    Every output bit-exact against reference.hierarchical_dispatch / hierarchical_combine over
    repeated calls on the same buffers, poisoned before each (bf16 with bias, FP8 with
    alignment, cached, worst-token padding, empty and hot ranks); the cases must tell the flat
    semantics apart. Then a call over capacity and one with a bad expert id fail on every rank
    alike, both stages skipping them (nothing forwarded), and the group goes on.
    EPD_STAGES_TIMING=1 also prints the wall clock against direct puts."""
    _across_logical_nodes(tmp_path, ranks_per_node, "nvshmem_stages_worker.py",
                          ["--timing"] if os.environ.get("EPD_STAGES_TIMING") == "1"
                          and ranks_per_node <= 2 else [])


def _across_logical_nodes(tmp_path: Path, ranks_per_node: int, worker: str,
                          args: list[str] | None = None) -> None:
    """Two PEs as two logical nodes running `worker`: one per GPU on two GPUs, else both on
    GPU 0 under one MPS server; skipped without NVSHMEM's device build toolchain."""
    if GPU_COUNT < 1 or not _has_nvshmem():
        pytest.skip("needs a GPU and nvshmem4py")
    from epd.server.backends.cuda_remote import toolchain_paths

    try:
        toolchain_paths()
    except RuntimeError as e:
        pytest.skip(str(e))
    if GPU_COUNT >= 2:
        _run_pes(tmp_path, ranks_per_node, {}, worker=worker, args=args)
        return
    with _two_pes_env() as env:
        _run_pes(tmp_path, ranks_per_node, env, worker=worker, args=args)


@contextlib.contextmanager
def _two_pes_env() -> Iterator[dict[str, str]]:
    """An MPS server for two PEs on GPU 0 (half the threads each), stopped afterwards."""
    import shutil
    import tempfile

    from epd.proto.v1 import epd_pb2
    from epd.server.mps import Mps, MpsError

    root = tempfile.mkdtemp(prefix="epd-mpg-")  # short: the MPS pipe path is a socket path
    mps = Mps("on", root, "cuda", epd_pb2.CUDA)
    try:
        try:
            mps.start()
        except MpsError as e:
            pytest.skip(f"needs MPS: {e}")
        env = {k: v for k, v in mps.env().items() if k.startswith("CUDA_MPS")}
        env.update(CUDA_VISIBLE_DEVICES="0", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="50")
        yield env
    finally:
        mps.stop()
        shutil.rmtree(root, ignore_errors=True)


def _run_pes(tmp_path: Path, ranks_per_pe: int, extra_env: dict[str, str],
             worker: str = "nvshmem_worker.py", args: list[str] | None = None) -> None:
    env = dict(os.environ, NVSHMEM_DISABLE_NVLS="1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_REMOTE_TRANSPORT="none",
               NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="lo",
               NVSHMEM_SYMMETRIC_SIZE="8G" if ranks_per_pe >= 8 else "4G",
               PYTHONUNBUFFERED="1",
               # Several ranks' kernels of one PE spin on each other's flags: each stream its
               # own hardware queue, or a waiting kernel can hold up the one it waits for (two
               # PEs under MPS: 64 of the GPU's pool, well inside it).
               CUDA_DEVICE_MAX_CONNECTIONS="32", **extra_env)
    # Not the repository root on sys.path: its cuda/ folder would shadow the `cuda` package.
    uid = tmp_path / "uid"
    worker = str(Path(__file__).with_name(worker))
    procs = [subprocess.Popen([sys.executable, worker, str(pe), "2", str(uid),
                               str(ranks_per_pe), *(args or [])], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pe in range(2)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outs.append(out)
    for pe, out in enumerate(outs):  # every PE's output first: the first failure may be a peer's
        print(f"--- PE {pe} ---\n{out}")
    for pe, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"PE {pe} failed:\n{out[-4000:]}"
