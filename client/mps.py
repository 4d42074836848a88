"""The client's view of CUDA MPS, sent when a session opens: the engine compares it with its own
server and says whether this process shares it (`SessionOpened.client_on_engine_mps`).

A client off the daemon's MPS server still works, but its stream-ordered calls wait for GPU
time slices (hundreds of µs per call): it is warned once per process.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # CUDA's default
CONTROL = "control"  # the MPS control daemon's socket in the pipe folder


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
