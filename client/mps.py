"""The client's view of CUDA MPS, sent when a session opens: the engine compares it with its own
server and says whether this process shares it (`SessionOpened.client_on_engine_mps`).

A client off the daemon's MPS server still works, but its stream-ordered calls wait for GPU
time slices (hundreds of µs per call): it is warned once per process, and with
EPD_HOST_WAIT_US=auto its host looks for an eager call's end (up to 2 ms; normal mode and the
facade's low-latency calls) before a stream would wait (`host_wait_seconds`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ..proto.errors import InvalidArgument

PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # CUDA's default
CONTROL = "control"  # the MPS control daemon's socket in the pipe folder


HOST_WAIT_ENV = "EPD_HOST_WAIT_US"  # "auto" or microseconds, 0 = off (the default)
HOST_WAIT_DEFAULT = "0"  # off: slower with ranks sharing a GPU (docs/DESIGN_NOTES.md)
HOST_WAIT_AUTO_US = 2000


class MpsWarning(RuntimeWarning):
    """This process is not on the daemon's CUDA MPS server (filter it with `warnings`)."""


_warned = False


def request_fields() -> dict[str, Any]:
    """OpenSessionRequest's MPS fields for this process: the pipe folder its CUDA context would
    use and whether an MPS control socket is there."""
    folder = os.environ.get(PIPE_ENV) or DEFAULT_PIPE_DIRECTORY
    return {"mps_pipe_directory": folder,
            "mps_pipe_present": os.path.exists(os.path.join(folder, CONTROL))}


def warn_if_off_engine_mps(opened: Any) -> None:
    """Given the engine's SessionOpened: warn (MpsWarning, once per process) when the engine
    runs on an MPS server this process is not on."""
    global _warned
    if opened.mps_pipe_directory and not opened.client_on_engine_mps and not _warned:
        _warned = True
        warnings.warn(
            f"EPD engine {opened.engine_index} runs on the CUDA MPS server of "
            f"{opened.mps_pipe_directory} and this process does not (CUDA_MPS_PIPE_DIRECTORY="
            f"{os.environ.get(PIPE_ENV, '')!r}): its calls share the GPU by time slices, much "
            f"slower. Start it under eval \"$(epd env)\" (before CUDA initialises).",
            MpsWarning, stacklevel=4)


def host_wait_setting() -> float | None:
    """EPD_HOST_WAIT_US as seconds (unset or empty: 0, off), None for `auto`;
    INVALID_ARGUMENT for anything else than `auto` or 0-1000000 µs (read before a session
    opens)."""
    v = os.environ.get(HOST_WAIT_ENV, "").strip().lower() or HOST_WAIT_DEFAULT
    if v == "auto":
        return None
    try:
        us = int(v)
    except ValueError:
        raise InvalidArgument(f"{HOST_WAIT_ENV}={v!r}: 'auto' or a number of "
                              f"microseconds") from None
    if not 0 <= us <= 1_000_000:
        raise InvalidArgument(f"{HOST_WAIT_ENV}={us}: between 0 (off) and 1000000 µs")
    return us * 1e-6


def host_wait_seconds(setting: float | None, on_engine_mps: bool | None) -> float:
    """How long the host of an eager stream-ordered call looks for the call's end in the
    mapped counter page before it makes the stream wait for it instead (0: never): the
    setting, or for `auto` (None) 2 ms where this process is not on the engine's MPS server
    and 0 where it is. Off by default: built in the forty-ninth session, whose device time
    ran out before it ran on a GPU (`benchmarks/device/gpu_s49_run.sh host49` measures it).

    Why: without MPS the client's and the engine's CUDA contexts time-slice the GPU, and a
    stream waiting on a memory word is work of the client's context, so the engine's kernels
    wait for a time slice (the project's first runs on 2x H200: a low-latency call 507 µs,
    110 µs with a prototype's host waiting instead; this code has no GPU figures yet:
    docs/BENCHMARKS.md, forty-ninth session; docs/DESIGN_NOTES.md "Off MPS the host waits"
    says how it works). Under MPS the contexts run side by side and the stream wait costs
    nothing, so the host goes on."""
    if setting is not None:
        return setting
    return 0.0 if on_engine_mps else HOST_WAIT_AUTO_US * 1e-6
