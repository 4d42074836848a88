"""EPD_CHAIN_LOOP=graph|require (experimental, an A/B switch): a member's low-latency chain
as one CUDA graph that repeats itself on the GPU, so the engine's host enqueues nothing per
call.

Why: the chain's host keeps instances enqueued ahead of the ring's head. On the H200 that
top-up sometimes stayed 10-13 ms inside its driver calls while a prefill pool's calls ran in
the same engine, and the chain ran dry (docs/BENCHMARKS.md, nineteenth session; the options
are in docs/DESIGN_NOTES.md, "The engine host's stalls under a prefill pool").

How: a graph with one WHILE conditional node (its handle's default value 1). The node's body
is captured from the chain's ordinary launches on a side stream:
- `epd_ll_loop_gate` waits for the tail to pass instance k and fetches its entry;
- exec, reduce and finish run with k = CHAIN_K_LOOP, which they read from the member's state
  (`LLS_K`);
- `epd_ll_loop_next` (cuda/epd_chain_loop.cu) advances k and keeps the loop going unless the
  stop word is set.
`epd_ll_loop_next` calls the device runtime's `cudaGraphSetConditional`, so it is built apart
from the NVRTC module: relocatable code linked against `libcudadevrt.a` with cuda.core, as
cuda_remote.py links NVSHMEM's device library. The graph is launched once on the chain's
stream and runs until `close` sets the stop word and lets one last round through.

Nothing here has run on a GPU yet (gpu_s19_run.sh). The chain falls back to its host top-up
if anything in the build fails.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import Any

from ...proto import abi
from . import cuda_kernels as ck

log = logging.getLogger("epd.engine")

# graph: the loop where it can be built, else the host's top-up (a warning); require: the
# chain fails to start without it (the GPU tests' setting, so a fallback cannot pass for it)
LOOP = os.environ.get("EPD_CHAIN_LOOP", "") in ("graph", "require")
REQUIRED = os.environ.get("EPD_CHAIN_LOOP", "") == "require"
SOURCE = Path(__file__).resolve().parents[2] / "cuda" / "epd_chain_loop.cu"
DEVRT = ("nvidia/cu13/lib/libcudadevrt.a", "nvidia/cuda_runtime/lib/libcudadevrt.a")


def _devrt() -> Path:
    """The CUDA device runtime library: the nvidia-cuda-runtime wheel's, else the toolkit's."""
    from .cuda_remote import find_installed

    for rel in DEVRT:
        p = find_installed(rel)
        if p is not None:
            return p
    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    for p in (home / "lib64" / "libcudadevrt.a", home / "lib" / "libcudadevrt.a"):
        if p.exists():
            return p
    raise RuntimeError("EPD_CHAIN_LOOP=graph needs libcudadevrt.a (the nvidia-cuda-runtime "
                       "wheel, or a CUDA toolkit under CUDA_HOME)")


@functools.cache
def loop_next_kernel(device_id: int) -> tuple[Any, Any]:
    """(epd_ll_loop_next as a launchable kernel, the linked module kept alive) for a device."""
    import cupy as cp

    from .cuda_remote import LinkedKernel, link_relocatable, loaded_kernel

    arch = "sm_" + cp.cuda.Device(device_id).compute_capability
    text = f"#define LLS_K {abi.LLS_K}\n" + SOURCE.read_text()
    linked = link_relocatable(text, arch, _devrt())
    name = "epd_ll_loop_next"
    return LinkedKernel(name, loaded_kernel(linked, name)), linked


def _ok(result: Any, what: str) -> Any:
    """A cuda.bindings call's values after its error code; RuntimeError naming the call."""
    from cuda.bindings import runtime as rt

    err, *values = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what}: {err}")
    return values[0] if len(values) == 1 else values


class ChainLoop:
    """The graph of one member's chain loop: built once, launched once, destroyed after its
    stream is done."""

    def __init__(self, device_id: int, launches: list[ck.Launch], state: Any,
                 stop: Any) -> None:
        """`launches`: one round, in order (the loop gate, then exec, reduce and finish with
        k = CHAIN_K_LOOP); `state`: the member's device state; `stop`: a device uint32 word,
        0 while the loop should go on."""
        import cupy as cp
        from cuda.bindings import runtime as rt

        next_fn, self._linked = loop_next_kernel(device_id)
        graph = _ok(rt.cudaGraphCreate(0), "cudaGraphCreate")
        self.graph, self.exec = graph, None
        try:
            assign_default = getattr(rt, "cudaGraphCondAssignDefault", 1)
            handle = _ok(rt.cudaGraphConditionalHandleCreate(graph, 1, assign_default),
                         "cudaGraphConditionalHandleCreate")
            params = rt.cudaGraphNodeParams()
            params.type = rt.cudaGraphNodeType.cudaGraphNodeTypeConditional
            params.conditional.handle = handle
            params.conditional.type = rt.cudaGraphConditionalNodeType.cudaGraphCondTypeWhile
            params.conditional.size = 1
            try:  # CUDA 13's signature (edge data), else 12.x's
                _ok(rt.cudaGraphAddNode(graph, None, None, 0, params), "cudaGraphAddNode")
            except TypeError:
                _ok(rt.cudaGraphAddNode(graph, None, 0, params), "cudaGraphAddNode")
            body = params.conditional.phGraph_out[0]
            side = cp.cuda.Stream(non_blocking=True)  # (capture only: never runs work)
            mode = rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
            _ok(rt.cudaStreamBeginCaptureToGraph(side.ptr, body, None, None, 0, mode),
                "cudaStreamBeginCaptureToGraph")
            try:
                for launch in launches:
                    launch(side)
                u64 = ctypes.c_uint64  # (state, the loop's handle, stop: as the kernel takes)
                ck.Launch(next_fn, 1, 32, [(u64, state.data.ptr), (u64, int(handle)),
                                          (u64, stop.data.ptr)])(side)
            finally:
                _ok(rt.cudaStreamEndCapture(side.ptr), "cudaStreamEndCapture")
            self.exec = _ok(rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        except BaseException:
            self.destroy()
            raise

    def launch(self, stream: Any) -> None:
        from cuda.bindings import runtime as rt

        _ok(rt.cudaGraphLaunch(self.exec, stream.ptr), "cudaGraphLaunch")

    def destroy(self) -> None:
        """Free the graph (call once the stream that ran it is done)."""
        from cuda.bindings import runtime as rt

        if self.exec is not None:
            rt.cudaGraphExecDestroy(self.exec)
            self.exec = None
        if self.graph is not None:
            rt.cudaGraphDestroy(self.graph)
            self.graph = None


def preload(device_id: int) -> None:
    """Link and load epd_ll_loop_next before the engine serves (EPD_CHAIN_LOOP set): loading
    a module into the context waits for the kernels running in it, and a member's loop
    spins until its chain closes, so a second member loading it then hung (twentieth
    session). A failure now is the loop's failure later: `require` refuses to start."""
    if not LOOP:
        return
    try:
        loop_next_kernel(device_id)
    except Exception as e:
        if REQUIRED:
            raise
        log.warning("EPD_CHAIN_LOOP=graph: cannot load the chain loop's kernel (%s); chains "
                    "will be topped up from the host", e)


def build(device_id: int, launches: list[ck.Launch], state: Any, stop: Any) -> ChainLoop | None:
    """The loop, or None with a warning (the chain then tops itself up from the host)."""
    try:
        return ChainLoop(device_id, launches, state, stop)
    except Exception as e:  # (an older driver or bindings, no device runtime library)
        if REQUIRED:
            raise
        log.warning("EPD_CHAIN_LOOP=graph: cannot build the chain's graph loop (%s); the host "
                    "tops the chain up instead", e)
        return None
