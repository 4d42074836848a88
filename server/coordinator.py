"""The node's group registry: rendezvous of ranks into groups, and their teardown.

Lives in the supervisor, the one process that sees every engine. A group forms when all
`num_ranks` ranks have arrived with the same spec; the coordinator then decides, once and for all
members, the shared resources (the communication file on the CPU backend, the heap offset on the
CUDA backend). A group whose member went away is aborted: its remaining members fail with ABORTED,
and the next rendezvous under the same name starts a fresh instance.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from ..proto.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from ..proto.v1 import epd_pb2
from . import metrics
from .backends import cpu
from .backends.base import GroupSpec
from .engine.state import spec_from_proto

log = logging.getLogger("epd.coordinator")


@dataclass
class GroupInstance:
    group_id: str
    spec: GroupSpec
    spec_proto: epd_pb2.GroupSpec
    members: dict[int, tuple[int, str]] = field(default_factory=dict)  # rank -> (engine, session)
    formed: asyncio.Event = field(default_factory=asyncio.Event)
    attached: set[int] = field(default_factory=set)
    all_attached: asyncio.Event = field(default_factory=asyncio.Event)
    comm_path: str = ""
    heap_offset: int = 0
    heap_bytes: int = 0
    aborted: str | None = None
    released: set[int] = field(default_factory=set)


class Coordinator:
    def __init__(self, shm_dir: str, backend: str, heap_bytes: int = 0) -> None:
        self.shm_dir = shm_dir
        self.backend = backend
        self.by_name: dict[str, GroupInstance] = {}
        self.by_id: dict[str, GroupInstance] = {}
        self.nvshmem_uid = b""
        self.heap = HeapAllocator(heap_bytes)

    async def rendezvous(self, req: epd_pb2.RendezvousRequest) -> epd_pb2.RendezvousResponse:
        if req.attached:
            return await self._attached(req)
        spec = spec_from_proto(req.spec)
        if not 0 <= req.rank < spec.num_ranks:
            raise InvalidArgument(f"rank {req.rank} is out of range for num_ranks="
                                  f"{spec.num_ranks}")
        g = self.by_name.get(spec.name)
        if g is None or g.aborted is not None:
            g = self._new_instance(spec, req.spec)
        elif g.spec != spec:
            raise FailedPrecondition(f"group {spec.name!r} exists with a different spec: "
                                     f"{_spec_text(g.spec)}; this rank asked for "
                                     f"{_spec_text(spec)}")
        if req.rank in g.members:
            raise FailedPrecondition(f"rank {req.rank} of group {spec.name!r} is already "
                                     f"taken (by session {g.members[req.rank][1]})")
        if g.formed.is_set():
            raise FailedPrecondition(f"group {spec.name!r} is already formed")
        g.members[req.rank] = (req.engine_index, req.session_id)
        if len(g.members) == spec.num_ranks:
            self._form(g)
        try:
            await asyncio.wait_for(g.formed.wait(), timeout=req.timeout_seconds or 10.0)
        except TimeoutError:
            missing = sorted(set(range(spec.num_ranks)) - set(g.members))
            g.members.pop(req.rank, None)
            self._drop_if_empty(g)
            raise DeadlineExceeded(f"group {spec.name!r}: rank(s) {missing} did not join "
                                   f"within {req.timeout_seconds:g} s") from None
        except asyncio.CancelledError:  # the joining client went away
            if not g.formed.is_set():
                g.members.pop(req.rank, None)
                self._drop_if_empty(g)
            raise
        if g.aborted is not None:
            raise FailedPrecondition(f"group {spec.name!r} was aborted while forming: "
                                     f"{g.aborted}")
        return epd_pb2.RendezvousResponse(
            group_id=g.group_id, comm_path=g.comm_path,
            rank_engines=[g.members[r][0] for r in range(spec.num_ranks)],
            nvshmem_uid=self.nvshmem_uid, heap_offset=g.heap_offset)

    async def _attached(self, req: epd_pb2.RendezvousRequest) -> epd_pb2.RendezvousResponse:
        g = self.by_id.get(req.group_id)
        if g is None:
            raise FailedPrecondition(f"group {req.group_id!r} is gone")
        g.attached.add(req.rank)
        if len(g.attached) == g.spec.num_ranks:
            g.all_attached.set()
        try:
            await asyncio.wait_for(g.all_attached.wait(), timeout=req.timeout_seconds or 10.0)
        except TimeoutError:
            missing = sorted(set(range(g.spec.num_ranks)) - g.attached)
            raise DeadlineExceeded(f"group {g.spec.name!r}: rank(s) {missing} did not attach "
                                   f"within {req.timeout_seconds:g} s") from None
        if g.aborted is not None:
            raise FailedPrecondition(f"group {g.spec.name!r} was aborted while forming: "
                                     f"{g.aborted}")
        return epd_pb2.RendezvousResponse(group_id=g.group_id)

    def _new_instance(self, spec: GroupSpec, proto: epd_pb2.GroupSpec) -> GroupInstance:
        g = GroupInstance("g" + secrets.token_hex(6), spec, proto)
        self.by_name[spec.name] = g
        self.by_id[g.group_id] = g
        return g

    def _form(self, g: GroupInstance) -> None:
        if self.backend == "cpu":
            g.comm_path = os.path.join(self.shm_dir, f"epd-{g.group_id}.comm")
            cpu.create_comm_file(g.comm_path, g.spec)
        else:
            # Every engine sub-allocates the group's buffers at the same heap offset: one rank
            # buffer per rank of the group, whichever engine holds it.
            from .backends.cuda import membership_layout
            size = membership_layout(g.spec).slot_bytes * g.spec.num_ranks
            offset = self.heap.alloc(size)
            if offset is None:
                g.aborted = (f"the symmetric heap has no room for {size} bytes "
                             f"(raise --nvshmem-heap-bytes or lower max_tokens_per_rank)")
                g.formed.set()
                raise ResourceExhausted(f"group {g.spec.name!r}: {g.aborted}")
            g.heap_offset, g.heap_bytes = offset, size
        g.formed.set()
        log.info("group %r (%s) formed: %d ranks on engines %s", g.spec.name, g.group_id,
                 g.spec.num_ranks, [g.members[r][0] for r in range(g.spec.num_ranks)])

    def release(self, group_id: str, rank: int, reason: str) -> None:
        g = self.by_id.get(group_id)
        if g is None:
            return
        if reason and g.aborted is None and len(g.released) < g.spec.num_ranks - 1:
            self._abort(g, reason)
        g.released.add(rank)
        if len(g.released) >= len(g.members):
            self._remove(g)

    def engine_lost(self, engine: int) -> None:
        """An engine died: every group with a rank there is aborted for its other members."""
        for g in list(self.by_id.values()):
            ranks = [r for r, (e, _) in g.members.items() if e == engine]
            if not ranks:
                continue
            metrics.ABORTS.labels("engine_lost").inc()
            self._abort(g, f"engine {engine} holding rank(s) {ranks} exited")
            g.released.update(ranks)
            if not g.formed.is_set():
                for r in ranks:
                    g.members.pop(r, None)
            if len(g.released) >= len(g.members):
                self._remove(g)

    def _abort(self, g: GroupInstance, reason: str) -> None:
        if g.aborted is not None:
            return
        g.aborted = reason
        g.all_attached.set()  # nobody waits for an attach that will not come
        log.warning("group %r (%s) aborted: %s", g.spec.name, g.group_id, reason)
        if g.comm_path:
            cpu.abort_comm_file(g.comm_path, reason)

    def _drop_if_empty(self, g: GroupInstance) -> None:
        if not g.members and not g.formed.is_set():
            self._remove(g)

    def _remove(self, g: GroupInstance) -> None:
        self.by_id.pop(g.group_id, None)
        if self.by_name.get(g.spec.name) is g:
            del self.by_name[g.spec.name]
        if g.comm_path:
            Path(g.comm_path).unlink(missing_ok=True)
        if g.heap_bytes:
            self.heap.free(g.heap_offset)
        log.info("group %r (%s) removed", g.spec.name, g.group_id)

    def close(self) -> None:
        for g in list(self.by_id.values()):
            self._abort(g, "daemon shutting down")
            self._remove(g)


def _spec_text(s: GroupSpec) -> str:
    return (f"num_ranks={s.num_ranks} num_experts={s.num_experts} hidden={s.hidden} "
            f"max_tokens_per_rank={s.max_tokens_per_rank} num_topk={s.num_topk} "
            f"x_dtype={s.x_dtype}")



def rank_buffer_layout(layout_cls, spec: GroupSpec):
    """The per-rank buffer layout of a group on the CUDA backend: recv_x sized for the group's
    dtype (FP8 payloads are smaller), scales whenever FP8 dispatch is possible."""
    from ..proto import dtypes
    item = spec.x_numpy_dtype.itemsize
    return layout_cls.build(num_ranks=spec.num_ranks, num_experts=spec.num_experts,
                            hidden=spec.hidden, num_topk=spec.num_topk,
                            max_tokens_per_rank=spec.max_tokens_per_rank, x_itemsize=item,
                            y_itemsize=item, with_scales=spec.hidden % dtypes.FP8_BLOCK == 0)


class HeapAllocator:
    """First-fit allocation of group buffers in the engines' symmetric heaps (256-byte aligned).
    Decided here, once, so that every engine uses the same offsets."""

    ALIGN = 256

    def __init__(self, size: int) -> None:
        self.size = size
        self.used: dict[int, int] = {}  # offset -> bytes

    def alloc(self, nbytes: int) -> int | None:
        nbytes = -(-nbytes // self.ALIGN) * self.ALIGN
        cur = 0
        for off in sorted(self.used):
            if off - cur >= nbytes:
                break
            cur = off + self.used[off]
        if cur + nbytes > self.size:
            return None
        self.used[cur] = nbytes
        return cur

    def free(self, offset: int) -> None:
        self.used.pop(offset, None)
