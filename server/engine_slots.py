"""Which engine processes a daemon runs: one per device, with class engines (`--class-engines`)
two per device, one per service class, and the same again for each tenant pool
(`--tenant-pools`, tenant_pools.py).

An engine's `index` is its identity (metrics label, files, the coordinator's placement); its
`device` is the GPU it drives. The shared engines come first, as without pools: the throughput
engines (index = device, socket gpu<D>.sock), then with class engines the latency engines
(index = devices + device, gpu<D>.latency.sock); then each pool's engines in the same order
(gpu<D>[.latency].tenant-<pool>.sock). Engines of one `world` form one NVSHMEM world on the
cuda backend: each class of each pool its own, so no two of them share a GPU with a PE of one
world (NVSHMEM would then want MPS thread limits), a lost engine restarts only its world's
engines, and no pool's heap is mapped by another pool's sessions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .service_classes import LATENCY, THROUGHPUT


@dataclass(frozen=True)
class EngineSlot:
    index: int
    device: int
    service_class: str = ""  # "": every class; LATENCY / THROUGHPUT: only groups of that class
    world: int = 0  # engines of one world form one NVSHMEM world (cuda)
    pe: int = 0  # its place in that world
    tenant_pool: str = ""  # "": the shared engines; else only that pool's sessions

    def describe(self) -> str:
        what = f"engine {self.index} (device {self.device}"
        if self.tenant_pool:
            what += f", tenant pool {self.tenant_pool}"
        return what + (f", {self.service_class} groups)" if self.service_class else ")")


def engine_slots(devices: int, class_engines: bool = False,
                 tenant_pools: Sequence[str] = ()) -> list[EngineSlot]:
    classes = (THROUGHPUT, LATENCY) if class_engines else ("",)
    slots: list[EngineSlot] = []
    for pool in ("", *tenant_pools):
        for cls in classes:
            first = len(slots)
            world = first // devices if devices else 0  # (one per set of engines)
            slots += [EngineSlot(first + d, d, cls, world, d, pool) for d in range(devices)]
    return slots


def world_is_latency(world: int, class_engines: bool) -> bool:
    """Whether `world`'s engines run the latency class (their heap: --latency-heap-bytes)."""
    return class_engines and world % 2 == 1
