"""Which engine processes a daemon runs: one per device, or with class engines
(`--class-engines`) two per device, one per service class.

An engine's `index` is its identity (metrics label, files, the coordinator's placement); its
`device` is the GPU it drives. Class engines: the throughput engines come first (index = device,
socket gpu<D>.sock), then the latency engines (index = devices + device, gpu<D>.latency.sock).
Engines of one `world` form one NVSHMEM world on the cuda backend: each class its own, so
neither class's engines share a GPU with a PE of their world (NVSHMEM would then want MPS
thread limits) and a lost engine restarts only its class's engines.
"""

from __future__ import annotations

from dataclasses import dataclass

from .service_classes import LATENCY, THROUGHPUT


@dataclass(frozen=True)
class EngineSlot:
    index: int
    device: int
    service_class: str = ""  # "": every class; LATENCY / THROUGHPUT: only groups of that class
    world: int = 0  # engines of one world form one NVSHMEM world (cuda)
    pe: int = 0  # its place in that world

    def describe(self) -> str:
        what = f"engine {self.index} (device {self.device}"
        return what + (f", {self.service_class} groups)" if self.service_class else ")")


def engine_slots(devices: int, class_engines: bool = False) -> list[EngineSlot]:
    if not class_engines:
        return [EngineSlot(d, d, pe=d) for d in range(devices)]
    return ([EngineSlot(d, d, THROUGHPUT, 0, d) for d in range(devices)]
            + [EngineSlot(devices + d, d, LATENCY, 1, d) for d in range(devices)])

