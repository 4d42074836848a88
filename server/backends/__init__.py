"""Backends: `cpu` (NumPy over shared memory) and `cuda` (CuPy kernels over NVLink)."""

from __future__ import annotations

from .base import Backend, GroupPlanner


def cuda_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def cuda_backend_present() -> bool:
    """The [cuda] extra is installed: CuPy, NVSHMEM's Python bindings and cuda-python."""
    import importlib.util
    return all(importlib.util.find_spec(m) is not None
               for m in ("cupy", "nvshmem", "cuda.bindings"))


BACKEND_NAMES = ("cpu", "cuda")  # what `--backend` takes, besides "auto"


def missing_requirements(name: str) -> str | None:
    """What backend `name` (resolved) needs and this machine lacks, as the fix to print; None
    when it can start. Checked by the supervisor before anything starts."""
    if name == "cuda" and not cuda_backend_present():
        return ("CuPy, NVSHMEM or cuda-python is not installed; install the [cuda] extra "
                "(pip install -e '.[cuda]') or use --backend cpu")
    return None


def resolve_backend_name(name: str) -> str:
    """`auto` is cuda where a GPU, CuPy and the cuda engine are all present, else cpu."""
    if name == "auto":
        return "cuda" if cuda_backend_present() and cuda_available() else "cpu"
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; one of auto, {', '.join(BACKEND_NAMES)}")
    return name


def class_engines_pay(name: str) -> bool:
    """Whether `--class-engines auto` turns class engines on for backend `name` (resolved):
    on cuda a latency group's launches queue behind a throughput group's driver calls in one
    engine process (docs/DESIGN_NOTES.md, "Class engines"); the cpu backend's collectives
    make no driver calls to separate."""
    return name == "cuda"


def make_planner(cfg) -> GroupPlanner:
    """The node side of the configured backend (supervisor, coordinator): no device needed."""
    name = resolve_backend_name(cfg.backend)
    if name == "cpu":
        from .cpu_plan import CpuPlanner
        return CpuPlanner(cfg.shm_dir)
    from .cuda_plan import CudaPlanner
    return CudaPlanner(cfg)


def make_backend(cfg, index: int, device: int | None = None) -> Backend:
    """The engine side of the configured backend, for engine `index` on `device` (default:
    the device of the same number; class engines share devices, engine_slots.py)."""
    name = resolve_backend_name(cfg.backend)
    if name == "cpu":
        from .cpu import CpuBackend
        return CpuBackend(index, allowed_dirs=(cfg.shm_dir, "/dev/shm", "/tmp"))
    from .cuda import CudaBackend  # needs the [cuda] extra
    return CudaBackend(cfg, index, index if device is None else device)
