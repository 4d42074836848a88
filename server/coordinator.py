"""The node's group registry: rendezvous of ranks into groups, and their teardown.

Lives in the supervisor, the one process that sees every engine. Each rank's spec is checked
against the backend's limits as it arrives (`GroupPlanner.validate_spec`). A group forms when all
`num_ranks` ranks have arrived with the same spec; the backend's planner then decides, once and for
all members, the shared resources (an opaque plan every engine of the group receives). A failure
while forming is told to every waiting rank. A group whose member went away is aborted: its
remaining members fail with ABORTED, and the next rendezvous under the same name starts a fresh
instance.

In cluster mode (--num-nodes > 1) node 0's coordinator forms every group: the other nodes'
supervisors forward their engines' rendezvous here (server/cluster.py), so a member is
(node, engine, session) and a node whose lease ends is lost like an engine.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..proto.errors import (
    DeadlineExceeded,
    EpdError,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from ..proto.v1 import epd_pb2
from . import metrics, service_classes, tenant_pools
from .backends.base import GroupPlanner, GroupSpec
from .config import in_pool
from .engine.state import spec_from_proto
from .tenant_pools import TenantPool

log = logging.getLogger("epd.coordinator")
# A formed group's rank that has neither attached nor been released this long after its peers'
# attach deadline is released by the coordinator: its engine never got the placement (its
# Rendezvous call was cancelled after the answer was sent: the client went away mid-join) and
# so will never release it, which kept the instance and its plan (a heap range on the GPU)
# until that engine was lost. Long after the deadline, so that a slow attach (which writes
# the rank's control blocks in the plan's range) is over before the range can be reused.
LATE_ATTACH_SECONDS = 60.0
# The namespace of the names that --allow-uids / --allow-gids sessions join (shared pools);
# a tenant pool's (--tenant-pools) is TENANT_POOLS - its place in the list; every other uid's
# names are its own (`Coordinator._scope`).
SHARED = -1
TENANT_POOLS = -2
# A name's scope: (the world of the engines its groups run on, its namespace). Engines of two
# worlds (class engines, tenant pools: engine_slots.py) never share a group: their heaps are
# apart. A group's ranks all come to engines of one world anyway (a class engine refuses the
# other class's groups, a pool's engines other uids' sessions), except for the daemon's own uid,
# which any engine takes: its joins of one name on two worlds make two groups.
Scope = tuple[int, int]


@dataclass
class GroupInstance:
    group_id: str
    spec: GroupSpec
    spec_proto: epd_pb2.GroupSpec
    members: dict[int, tuple[int, str]] = field(default_factory=dict)  # rank -> (engine, session)
    nodes: dict[int, int] = field(default_factory=dict)  # rank -> node rank (cluster mode)
    uids: dict[int, int] = field(default_factory=dict)  # rank -> its client's uid
    formed: asyncio.Event = field(default_factory=asyncio.Event)
    attached: set[int] = field(default_factory=set)
    all_attached: asyncio.Event = field(default_factory=asyncio.Event)
    plan: bytes = b""  # from the planner once formed
    planned: bool = False
    failure: EpdError | None = None  # forming failed: every waiting rank gets this
    aborted: str | None = None
    released: set[int] = field(default_factory=set)
    scope: Scope = (0, 0)  # the name's world and namespace (`Coordinator._scope`)
    reaping: bool = False  # a release of the ranks that never attached is scheduled


class Coordinator:
    def __init__(self, planner: GroupPlanner, default_timeout: float = 10.0, *,
                 allow_uids: frozenset[int] = frozenset(),
                 allow_gids: frozenset[int] = frozenset(),
                 tenant_pools: Sequence[TenantPool] = (),
                 world_of: Callable[[int], int] | None = None) -> None:
        """`world_of`: the world of an engine index (engine_slots.py), where the engines form
        several; None: one world, or the planner decides by the group's class (tests)."""
        self.planner = planner
        # Admission: a uid's group names are its own; these uids / primary gids share one
        # namespace (--allow-uids / --allow-gids: pools shared by several users).
        self.allow_uids, self.allow_gids = allow_uids, allow_gids
        self.tenant_pools = tuple(tenant_pools)
        self._pool_namespace = {p.name: TENANT_POOLS - i for i, p in enumerate(tenant_pools)}
        self.world_of = world_of
        # Engines always send their deadline; this covers a request that names none.
        self.default_timeout = default_timeout
        # (scope, name) -> the live instance: names are each uid's own, so that one tenant
        # cannot take a name another will ask for (nor learn from a join that it exists; the
        # metrics' group label names the owner's uid, metrics.owned_label: /metrics is the
        # operator's).
        self.by_name: dict[tuple[Scope, str], GroupInstance] = {}
        self.by_id: dict[str, GroupInstance] = {}
        self.closing: str | None = None  # the daemon drains: no group forms any more

    async def rendezvous(self, req: epd_pb2.RendezvousRequest,
                         node: int = 0) -> epd_pb2.RendezvousResponse:
        """`node`: the node rank of the joining engine (engine_index is local to it)."""
        if not (math.isfinite(req.timeout_seconds) and req.timeout_seconds >= 0):
            # (engines check their clients' deadlines; a node holding the cluster token
            # forwards its own: NaN failed as UNKNOWN with a traceback)
            raise InvalidArgument(f"timeout_seconds must be a finite number >= 0, not "
                                  f"{req.timeout_seconds!r}")
        if req.attached:
            return await self._attached(req, node)
        if self.closing is not None:
            raise Unavailable(f"no group forms any more: {self.closing}")
        spec = spec_from_proto(req.spec)
        if not 0 <= req.rank < spec.num_ranks:
            raise InvalidArgument(f"rank {req.rank} is out of range for num_ranks="
                                  f"{spec.num_ranks}")
        self.planner.validate_spec(spec)  # every rank learns at once, none waits for the rest
        if not req.has_peer:  # (before a new instance is registered under the name: refused,
            # it would stay there, empty, and fail the next join of another spec)
            raise PermissionDenied(f"group {spec.name!r}: the joining session's credentials "
                                   f"are unknown (its descriptor channel is not connected)")
        g = self.by_name.get((self._scope(req), spec.name))
        if g is None or g.aborted is not None:
            g = self._new_instance(spec, req.spec, self._scope(req))
        elif g.spec != spec:
            # (only a join of the same namespace reaches it: another tenant's join of the name
            # with another spec is another group's)
            err = FailedPrecondition(f"group {spec.name!r} exists with a different spec: "
                                     f"{_spec_text(g.spec)}; rank {req.rank} asked for "
                                     f"{_spec_text(spec)}")
            if not g.formed.is_set():
                # The group cannot form as specified: every rank waiting on it fails now with
                # the mismatch (not at its deadline), and the name is free for a fresh start.
                log.warning("group %r (%s) cannot form: %s", spec.name, g.group_id, err.message)
                g.failure, g.aborted = err, err.message
                g.formed.set()
                self._remove(g)
            raise err
        if g.formed.is_set() and req.rank in g.released and self._shrinks(g):
            return self._rejoin(g, req, node)
        if req.rank in g.members:
            # (the holder's session id for a join of its own uid; in a shared pool another
            # uid's is not the joiner's to know)
            holder = (f"session {g.members[req.rank][1]}"
                      if g.uids.get(req.rank) == req.peer_uid else "a session of another uid")
            raise FailedPrecondition(f"rank {req.rank} of group {spec.name!r} is already "
                                     f"taken (by {holder})")
        if g.formed.is_set():
            raise FailedPrecondition(f"group {spec.name!r} is already formed")
        g.members[req.rank] = (req.engine_index, req.session_id)
        g.nodes[req.rank], g.uids[req.rank] = node, req.peer_uid
        if len(g.members) == spec.num_ranks:
            self._form(g)
        try:
            # (Not asyncio.wait_for: on Python 3.11 a cancellation that lands as the wait ends
            # is lost, and a rank whose engine gave up stayed in the formed group, its peers
            # waiting out the attach deadline: the release below never ran.)
            async with asyncio.timeout(req.timeout_seconds or self.default_timeout):
                await g.formed.wait()
            # One turn before the placement: a peer whose join was cancelled as the group
            # formed (its client went away) is released then, aborting the group, and this
            # rank is told here rather than at the attach barrier. (An already-set event
            # returns without yielding; wait_for's inner task gave this turn.)
            await asyncio.sleep(0)
        except TimeoutError:
            # The deadline and the last rank's arrival can land in one turn of the event loop:
            # the timer fires, then the last rank forms the group before this task wakes. The
            # group then holds this rank (its peers have its placement and wait for it at the
            # attach barrier): it goes on as formed. (Dropped here, it failed naming no missing
            # rank, "rank(s) [] did not join", the last rank's _placement raised KeyError, and
            # the instance, released by nobody, held the name for good: "already formed".)
            if not g.formed.is_set():
                missing = sorted(set(range(spec.num_ranks)) - set(g.members))
                g.members.pop(req.rank, None)
                g.nodes.pop(req.rank, None)
                self._drop_if_empty(g)
                raise DeadlineExceeded(f"group {spec.name!r}: rank(s) {missing} did not join "
                                       f"within {req.timeout_seconds:g} s") from None
        except asyncio.CancelledError:  # the joining client went away
            if not g.formed.is_set():
                g.members.pop(req.rank, None)
                g.nodes.pop(req.rank, None)
                self._drop_if_empty(g)
            elif g.group_id in self.by_id:  # formed, but its engine never learns the group's
                # id to release the rank: released here (before every rank attached, that
                # aborts a shrink group too: _shrinks).
                self.release(g.group_id, req.rank,
                             f"rank {req.rank} went away while the group formed")
            raise
        if g.failure is not None or g.aborted is not None:
            if g.group_id in self.by_id:  # (formed, then aborted: this rank, told so, is done
                self.release(g.group_id, req.rank, "")  # with it; its engine never attached)
            if g.failure is not None:
                raise EpdError(g.failure.code, g.failure.message)
            raise FailedPrecondition(f"group {spec.name!r} was aborted while forming: "
                                     f"{g.aborted}")
        return self._placement(g)

    @staticmethod
    def _placement(g: GroupInstance) -> epd_pb2.RendezvousResponse:
        """What a member learns of a formed group: its id, plan and where every rank is."""
        n = g.spec.num_ranks
        return epd_pb2.RendezvousResponse(
            group_id=g.group_id, plan=g.plan, rank_engines=[g.members[r][0] for r in range(n)],
            rank_nodes=[g.nodes.get(r, 0) for r in range(n)])

    def _rejoin(self, g: GroupInstance, req: epd_pb2.RendezvousRequest,
                node: int) -> epd_pb2.RendezvousResponse:
        """A replacement for a rank of a shrink group that went away: it takes the rank's place
        (still gone for its peers until the Rejoin collective brings it in)."""
        if not self.planner.supports_rejoin:
            raise FailedPrecondition(
                f"rank {req.rank} of group {g.spec.name!r} went away and this backend cannot "
                f"take a rank back into a group: a replacement joins a group of a new name")
        old_engine, old_node = g.members[req.rank][0], g.nodes.get(req.rank, 0)
        if self.planner.rejoin_on_same_engine and (req.engine_index, node) != (old_engine,
                                                                               old_node):
            raise FailedPrecondition(
                f"rank {req.rank} of group {g.spec.name!r} lived on engine {old_engine} of node "
                f"{old_node}: its replacement must join there (the other ranks reach its "
                f"buffers on that engine), not on engine {req.engine_index} of node {node}")
        g.members[req.rank] = (req.engine_index, req.session_id)
        g.nodes[req.rank], g.uids[req.rank] = node, req.peer_uid
        g.released.discard(req.rank)
        log.warning("group %r (%s): rank %d rejoins (session %s); it takes part after the "
                    "group's Rejoin call", g.spec.name, g.group_id, req.rank, req.session_id)
        resp = self._placement(g)
        resp.rejoining = True
        return resp

    def _scope(self, req: epd_pb2.RendezvousRequest) -> Scope:
        """The world of the joining engine, and the namespace of the joining session's group
        names: a tenant pool's for its uids and gids (--tenant-pools), SHARED for the uids and
        primary gids of --allow-uids / --allow-gids (a pool's members meet by name), else
        its own uid. So a name taken first by one uid holds nothing against another's join
        (PERMISSION_DENIED for as long as it held the name, before names were scoped), and a
        join tells nothing of other tenants' names. A pool lists every uid it has: one left
        out forms its groups alone."""
        world = self.world_of(req.engine_index) if self.world_of is not None else 0
        pool = tenant_pools.pool_of(self.tenant_pools, req.peer_uid, req.peer_gid)
        if pool:
            return world, self._pool_namespace[pool]
        if in_pool(req.peer_uid, req.peer_gid, self.allow_uids, self.allow_gids):
            return world, SHARED
        return world, req.peer_uid

    async def _attached(self, req: epd_pb2.RendezvousRequest,
                        node: int) -> epd_pb2.RendezvousResponse:
        g = self.by_id.get(req.group_id)
        if g is None:
            raise FailedPrecondition(f"group {req.group_id!r} is gone")
        # Only the session that holds a rank attaches it: an attach naming another rank (or
        # one out of range) would open the barrier before that rank's control blocks are clean.
        if (g.members.get(req.rank) != (req.engine_index, req.session_id)
                or g.nodes.get(req.rank, 0) != node):
            raise PermissionDenied(f"group {g.spec.name!r}: rank {req.rank} is not held by "
                                   f"session {req.session_id} on engine {req.engine_index} of "
                                   f"node {node}")
        g.attached.add(req.rank)
        if len(g.attached) == g.spec.num_ranks:
            g.all_attached.set()
        try:
            async with asyncio.timeout(req.timeout_seconds or self.default_timeout):
                await g.all_attached.wait()  # (not wait_for: as in rendezvous)
        except TimeoutError:
            # (as in rendezvous: the last attach may come in the turn the deadline fired; the
            # barrier is then open and this rank goes on with its peers, rather than failing
            # "rank(s) [] did not attach" and aborting the group they just started)
            if not g.all_attached.is_set():
                missing = sorted(set(range(g.spec.num_ranks)) - g.attached)
                self._reap_unattached(g)
                raise DeadlineExceeded(f"group {g.spec.name!r}: rank(s) {missing} did not "
                                       f"attach within {req.timeout_seconds:g} s") from None
        if g.aborted is not None:
            raise FailedPrecondition(f"group {g.spec.name!r} was aborted while forming: "
                                     f"{g.aborted}")
        return epd_pb2.RendezvousResponse(group_id=g.group_id)

    def _reap_unattached(self, g: GroupInstance) -> None:
        """Once, at a formed group's first attach deadline: LATE_ATTACH_SECONDS later, release
        every rank that has neither attached nor been released by then (see the constant)."""
        if g.reaping:
            return
        g.reaping = True

        def reap() -> None:
            if self.by_id.get(g.group_id) is not g:
                return  # (removed meanwhile)
            for rank in sorted(set(g.members) - g.attached - g.released):
                log.warning("group %r (%s): rank %d never attached nor was released; "
                            "released by the coordinator", g.spec.name, g.group_id, rank)
                self.release(g.group_id, rank, f"rank {rank} never attached")
        asyncio.get_running_loop().call_later(LATE_ATTACH_SECONDS, reap)

    def _new_instance(self, spec: GroupSpec, proto: epd_pb2.GroupSpec,
                      scope: Scope) -> GroupInstance:
        g = GroupInstance("g" + secrets.token_hex(6), spec, proto, scope=scope)
        self.by_name[(scope, spec.name)] = g
        self.by_id[g.group_id] = g
        return g

    def _form(self, g: GroupInstance) -> None:
        try:
            worlds = {"world": g.scope[0]} if self.world_of is not None else {}
            g.plan = self.planner.plan_group(
                g.group_id, g.spec, [g.nodes.get(r, 0) for r in range(g.spec.num_ranks)]
                if g.nodes else (), **worlds)
            g.planned = True
        except Exception as e:  # every waiting rank is told, not just the last one
            if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
                # (a precise code: the daemon is out of descriptors, not broken; a fuzzer)
                e = ResourceExhausted(f"group {g.spec.name!r} could not be formed: the daemon "
                                      f"has no descriptor left ({e.strerror}); raise its "
                                      f"LimitNOFILE or lower its session budgets")
            if not isinstance(e, EpdError):
                log.exception("group %r (%s): planning failed", g.spec.name, g.group_id)
                e = Internal(f"group {g.spec.name!r} could not be formed: {e}")
            g.failure = e
            g.aborted = e.message
            g.formed.set()
            self._remove(g)  # nothing was allocated; the next rendezvous starts afresh
            return
        g.formed.set()
        log.info("group %r (%s) formed: %d ranks on engines %s", g.spec.name, g.group_id,
                 g.spec.num_ranks, [g.members[r][0] for r in range(g.spec.num_ranks)])

    def release(self, group_id: str, rank: int, reason: str, left: bool = False,
                node: int | None = None) -> None:
        """A rank's engine is done with the group (`reason`: it went away). `node`: the node
        the release came from, when another node forwards it (it may release its own ranks
        only)."""
        g = self.by_id.get(group_id)
        if g is None:
            return
        if node is not None and (rank not in g.members or g.nodes.get(rank, 0) != node):
            log.warning("group %r (%s): node %d released rank %d, which is not its own; "
                        "ignored", g.spec.name, group_id, node, rank)
            return
        if reason and g.aborted is None and len(g.released) < g.spec.num_ranks - 1:
            if self._shrinks(g):
                self._mark_gone(g, [rank], reason)
            else:
                self._abort(g, reason, left=left)
        g.released.add(rank)
        if len(g.released) >= len(g.members):
            self._remove(g)

    def engine_lost(self, engine: int, node: int = 0) -> None:
        """An engine died: every group with a rank there is aborted for its other members."""
        where = f"engine {engine}" if not node else f"engine {engine} of node {node}"
        for g in list(self.by_id.values()):
            ranks = sorted(r for r, (e, _) in g.members.items()
                           if e == engine and g.nodes.get(r, 0) == node)
            if ranks:
                self._lose_ranks(g, ranks, "engine_lost",
                                 f"{where} holding rank(s) {ranks} exited")

    def node_lost(self, node: int, why: str) -> list[str]:
        """Cluster mode: a node's lease ended. Every group with a rank there is aborted for its
        other members (groups without one keep working); returns the aborted group names."""
        names = []
        for g in list(self.by_id.values()):
            ranks = sorted(r for r in g.members if g.nodes.get(r, 0) == node)
            if not ranks:
                continue
            if (g.formed.is_set() and g.aborted is None and len(ranks) == g.spec.num_ranks
                    and len(g.members) == g.spec.num_ranks):
                # Every rank on that node: it keeps serving the group on its own (its lease
                # ended on its side too, or will), so this node lets go of it without an
                # abort, which would reach the memory the node's engines still use (a review:
                # a node 0 resumed after a pause aborted a member's working node-local group,
                # blaming the member)
                log.info("group %r (%s): every rank on node %d, whose lease ended; left to it",
                         g.spec.name, g.group_id, node)
                self._remove(g)
                continue
            names.append(g.spec.name)
            self._lose_ranks(g, ranks, "node_lost",
                             f"node {node} holding rank(s) {ranks} went away ({why})")
        return names

    def _lose_ranks(self, g: GroupInstance, ranks: list[int], kind: str, reason: str) -> None:
        if self._shrinks(g) and g.aborted is None:
            self._mark_gone(g, ranks, reason)
        else:
            metrics.ABORTS.labels(kind).inc()
            self._abort(g, reason)
        g.released.update(ranks)
        if not g.formed.is_set():
            for r in ranks:
                g.members.pop(r, None)
                g.nodes.pop(r, None)
            # (aborted above: the ranks waiting for it to form fail now, naming why, instead
            # of at their deadline naming the lost rank as one that "did not join")
            g.formed.set()
        if len(g.released) >= len(g.members):
            self._remove(g)

    def _shrinks(self, g: GroupInstance) -> bool:
        """Whether the group masks a rank that goes away rather than aborting (DeepEP's shrink
        mode: a low-latency group joined with spec.shrink, on a backend that can, once every
        rank attached: before that the group cannot start without the rank, and its peers
        waiting at the attach barrier must learn it now, not at their deadline)."""
        return (g.spec.shrink and g.planned and g.formed.is_set() and g.all_attached.is_set()
                and self.planner.supports_rank_masking)

    def _mark_gone(self, g: GroupInstance, ranks: list[int], reason: str) -> None:
        for r in ranks:
            if r not in g.released:
                self.planner.mark_gone(g.plan, r, reason)
                metrics.RANKS_MASKED.labels("gone").inc()
        log.warning("group %r (%s): rank(s) %s masked, the others go on: %s", g.spec.name,
                    g.group_id, ranks, reason)

    def _abort(self, g: GroupInstance, reason: str, left: bool = False) -> None:
        if g.aborted is not None:
            return
        g.aborted = reason
        g.all_attached.set()  # nobody waits for an attach that will not come
        log.log(logging.INFO if left else logging.WARNING, "group %r (%s) %s: %s", g.spec.name,
                g.group_id, "ended (a member left)" if left else "aborted", reason)
        if g.planned:
            self.planner.abort_group(g.plan, reason)

    def _drop_if_empty(self, g: GroupInstance) -> None:
        if not g.members and not g.formed.is_set():
            self._remove(g)

    def _remove(self, g: GroupInstance) -> None:
        self.by_id.pop(g.group_id, None)
        if self.by_name.get((g.scope, g.spec.name)) is g:
            del self.by_name[(g.scope, g.spec.name)]
        if g.planned:
            g.planned = False
            self.planner.free_group(g.plan)
        log.info("group %r (%s) removed", g.spec.name, g.group_id)

    def groups_by_class(self) -> dict[str, int]:
        """How many live groups (formed or forming, not aborted) each service class has."""
        out = dict.fromkeys(service_classes.CLASS_NAMES, 0)
        for g in self.by_id.values():
            if g.aborted is None:
                cls = service_classes.name(g.spec.service_class)
                out[cls] = out.get(cls, 0) + 1
        return out

    def stop_forming(self, reason: str) -> None:
        """The daemon drains: a group still forming never will (the engines refuse its other
        ranks' joins), so the ranks waiting for it fail now with UNAVAILABLE instead of at
        their deadline, which held the drain that long; later joins are refused alike.
        Formed groups are left to their members and the drain."""
        self.closing = reason
        for g in list(self.by_id.values()):
            if not g.formed.is_set():
                g.failure = Unavailable(f"group {g.spec.name!r} cannot form: {reason}")
                g.aborted = g.failure.message
                g.formed.set()
                self._remove(g)

    def close(self) -> None:
        for g in list(self.by_id.values()):
            self._abort(g, "daemon shutting down")
            self._remove(g)


def _spec_text(s: GroupSpec) -> str:
    return (f"num_ranks={s.num_ranks} num_experts={s.num_experts} hidden={s.hidden} "
            f"max_tokens_per_rank={s.max_tokens_per_rank} num_topk={s.num_topk} "
            f"x_dtype={s.x_dtype} low_latency_mode={s.low_latency_mode} "
            f"service_class={service_classes.name(s.service_class)}")

