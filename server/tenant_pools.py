"""Tenant pools (`epd serve --tenant-pools`): tenants that get engines of their own.

On the CUDA engine every group's buffers and outputs lie in the engine's one NVSHMEM heap, and
each session that joined a group maps that whole heap (its outputs are views into it), so the
tenants of one engine can read and write each other's bytes on the GPU. A tenant pool is a set
of uids (and primary gids) whose sessions run only on the pool's own engines, one per device
and service class: its own processes, its own NVSHMEM world and heaps. No other uid's session
opens there, and no pool uid's session opens on another pool's engines or the shared ones, so a
pool's bytes are out of reach of every other tenant (the daemon's own uid excepted: it can read
everything anyway). A pool's uids share one namespace of group names, as the pool of
--allow-uids does.

The text: `NAME=ID[,ID...][;NAME=...]`, an ID a uid or `gid:N` (a primary gid: the kernel's
peer credentials carry no supplementary groups, so on systems with a private group per user a
team's group is no client's primary one, and its tenants are best listed by uid); a NAME is
lowercase letters, digits and '-' (it goes into socket file names and metric labels). The
daemon's own uid, which every client on the daemon's MPS server runs as, is served by the
shared engines, and by a pool's only where the pool lists it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,23}")
MAX_POOLS = 16  # each costs an engine process and a heap per device: more is a typo
_NO_ID = 2**32 - 1  # the kernel's "no id" (uid_t / gid_t)


@dataclass(frozen=True)
class TenantPool:
    name: str
    uids: frozenset[int]
    gids: frozenset[int]  # primary gids (SO_PEERCRED's): a supplementary group does not count


def parse(text: str) -> tuple[TenantPool, ...]:
    """The pools of `text` (see the module); ValueError naming what is wrong."""
    pools: list[TenantPool] = []
    for part in (p.strip() for p in str(text).split(";")):
        if not part:
            continue
        name, eq, ids = part.partition("=")
        name = name.strip()
        if not eq or not NAME.fullmatch(name):
            raise ValueError(f"tenant_pools: expected NAME=ID[,ID...] with NAME of lowercase "
                             f"letters, digits and '-' (at most 24), got {part!r}")
        if any(p.name == name for p in pools):
            raise ValueError(f"tenant_pools: pool {name!r} is named twice")
        uids, gids = set(), set()
        for token in (t.strip() for t in ids.split(",")):
            if not token:
                continue
            kind, _, number = token.rpartition(":")
            if kind not in ("", "gid") or not number.isdigit() or int(number) >= _NO_ID:
                raise ValueError(f"tenant_pools: pool {name!r}: an id is a uid or gid:N in "
                                 f"[0, {_NO_ID - 1}], got {token!r}")
            (gids if kind else uids).add(int(number))
        if not uids and not gids:
            raise ValueError(f"tenant_pools: pool {name!r} lists no uid or gid")
        pools.append(TenantPool(name, frozenset(uids), frozenset(gids)))
    if len(pools) > MAX_POOLS:
        raise ValueError(f"tenant_pools: at most {MAX_POOLS} pools (each has an engine and a "
                         f"heap per device), got {len(pools)}")
    for i, a in enumerate(pools):
        for b in pools[i + 1:]:
            shared = sorted(a.uids & b.uids) + [f"gid:{g}" for g in sorted(a.gids & b.gids)]
            if shared:
                raise ValueError(f"tenant_pools: pools {a.name!r} and {b.name!r} both list "
                                 f"{shared}: a tenant belongs to one pool")
    return tuple(pools)


def pool_of(pools: Sequence[TenantPool], uid: int, gid: int) -> str:
    """The pool whose engines a client of `uid` (primary `gid`) uses: "" for the shared
    engines. A uid listed by a pool wins over a gid listed by another (a uid names one tenant,
    a gid may hold several)."""
    for p in pools:
        if uid in p.uids:
            return p.name
    for p in pools:
        if gid in p.gids:
            return p.name
    return ""


def check_apart(pools: Sequence[TenantPool], allow_uids: frozenset[int],
                allow_gids: frozenset[int]) -> None:
    """A tenant pool's ids may not be in the shared pool of --allow-uids / --allow-gids: that
    pool's groups run on the shared engines, where a pool's sessions never open."""
    for p in pools:
        both = sorted(p.uids & allow_uids) + [f"gid:{g}" for g in sorted(p.gids & allow_gids)]
        if both:
            raise ValueError(f"tenant_pools: pool {p.name!r} lists {both}, which --allow-uids / "
                             f"--allow-gids put in the shared engines' pool")
