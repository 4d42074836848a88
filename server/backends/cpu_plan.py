"""The cpu backend's planner: a group's shared state is one communication memfd created and
held by the supervisor (node 0's, adopted by the other logical nodes through /proc)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ...proto.errors import FailedPrecondition
from ...proto.v1 import epd_pb2
from .base import GroupPlanner, GroupSpec
from .cpu_comm_file import (
    abort_comm_file,
    check_spec,
    create_comm_file,
    mark_gone_in_comm_file,
)


def comm_path(plan: bytes) -> str:
    """The group's communication memfd, from its plan: /proc/<supervisor pid>/fd/<n>."""
    return plan.decode()


class CpuPlanner(GroupPlanner):
    """A group's shared state is one communication memfd, created and held by the supervisor
    (sealed: no one can truncate it); engines open it through /proc/<pid>/fd/<n>, which only
    processes of the daemon's uid can. Nothing is created in the shm folder."""

    name = "cpu"
    proto_kind = epd_pb2.CPU
    # Logical nodes only (several daemons on one host, one uid): a node adopts node 0's memfd
    # through /proc, so a spanning group's memory is shared. There is no network data path.
    cluster_capable = True

    def __init__(self, shm_dir: str = "/dev/shm") -> None:
        self.shm_dir = shm_dir  # unused: kept for callers that pass it
        self._fds: dict[bytes, int] = {}  # plan -> the memfd's descriptor

    def validate_spec(self, spec: GroupSpec) -> None:
        check_spec(spec)

    def plan_group(self, group_id: str, spec: GroupSpec, rank_nodes: Sequence[int] = (),
                   world: int | None = None) -> bytes:
        fd = create_comm_file(group_id, spec)
        plan = f"/proc/{os.getpid()}/fd/{fd}".encode()
        self._fds[plan] = fd
        return plan

    def adopt_plan(self, group_id: str, plan: bytes) -> bytes:
        """Open node 0's memfd through its /proc path and hold it: this node's engines open
        this supervisor's descriptor, and the memory outlives node 0's supervisor. The path
        must name this group's memfd: on another host it is some other process's descriptor."""
        path = comm_path(plan)
        hint = ("logical nodes of the cpu backend must run on one host as one uid (there is "
                "no network data path)")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise FailedPrecondition(f"cannot open the group's memory planned by node 0 "
                                     f"({path}: {e.strerror or e}); {hint}") from None
        try:
            name = os.readlink(path)
        except OSError:
            name = ""
        if not name.startswith(f"/memfd:epd-{group_id}.comm"):
            os.close(fd)
            raise FailedPrecondition(f"{path} is not group {group_id}'s memory on this host "
                                     f"(it is {name or 'gone'}); {hint}")
        local = f"/proc/{os.getpid()}/fd/{fd}".encode()
        self._fds[local] = fd
        return local

    def free_group(self, plan: bytes) -> None:
        fd = self._fds.pop(plan, None)
        if fd is not None:
            os.close(fd)

    def abort_group(self, plan: bytes, reason: str) -> None:
        abort_comm_file(comm_path(plan), reason)

    supports_rank_masking = True
    supports_rejoin = True

    def mark_gone(self, plan: bytes, rank: int, reason: str) -> None:
        mark_gone_in_comm_file(comm_path(plan), rank)


