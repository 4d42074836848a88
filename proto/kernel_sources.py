"""The CUDA sources of cuda/ as NVRTC compiles them: the common header inlined once before the
kernel files, so that CuPy's compile cache keys on all of it. The engine compiles its kernel
families from here (server/backends/cuda_kernels.py) and a client its local layout
(client/local_layout.py): the same text, not a copy."""

from __future__ import annotations

from pathlib import Path

# The repository checkout (<root>/cuda) and the installed package (epd/cuda) alike: next to proto/.
CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"
HEADER = "epd_common.cuh"
# The parameters of cuda/epd_layout.cu's kernel as struct codes (proto/cuda_driver.py
# PackedArguments), which the engine and a client's local layout both launch.
LAYOUT_ARGS = "QiiiiQQQQ"


def source(files: tuple[str, ...]) -> str:
    """`files` (names in cuda/) with their `#include "epd_common.cuh"` replaced by one copy of
    the header at the top."""
    header = (CUDA_DIR / HEADER).read_text().replace("#pragma once", "")
    bodies = [(CUDA_DIR / f).read_text().replace(f'#include "{HEADER}"', "") for f in files]
    return header + "\n".join(bodies)
