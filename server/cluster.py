"""Cluster mode (--num-nodes > 1): supervisors of several nodes form one EP world.

Node 0's supervisor serves the Cluster service on TCP at --cluster-address (`ClusterHub`); every
other node's supervisor (`ClusterMember`) holds a lease there (a stream: heartbeats up, the
cluster view down) and forwards its engines' rendezvous and releases, so that node 0's
coordinator forms every group over all nodes' engines (a member is (node, engine, session)).
Every call carries the cluster's shared secret, compared in constant time; with
--cluster-tls-cert/-key/-ca the port speaks mutual TLS as well (`ClusterTls`: encrypted, and
each side's certificate must chain to the cluster's CA).

Where a group's memory lives is the backend's business (`GroupPlanner.adopt_plan`): on the CPU
backend, logical nodes on one host share node 0's memfd, which each node's supervisor holds
open so that it outlives node 0. Failure rules: node 0 aborts every group with a rank on a node
whose lease ended (groups without one keep working); a node that loses node 0 aborts its groups
that span nodes and keeps serving (and, until node 0 is back, forming) node-local groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import grpc

from ..proto.errors import EpdError
from ..proto.v1 import epd_pb2, epd_pb2_grpc
from .cluster_world import NodeState, WorldKeeper
from .config import CLUSTER_TOKEN_METADATA, MAX_ENGINES, Config, parse_ids, read_pem
from .rate_limited_log import RateLimitedLog

if TYPE_CHECKING:
    from .supervisor import Supervisor

log = logging.getLogger("epd.cluster")
WRONG_TOKEN = RateLimitedLog(log)  # Cluster calls refused for a wrong token
MISSED_HEARTBEATS = 3  # a lease ends after this many heartbeat periods without one
FORWARD_MARGIN_SECONDS = 5.0  # a forwarded call's deadline beyond the rendezvous's own
# What node 0 takes of a node's heartbeat (heartbeat_problem), and the lease events a node
# takes from node 0 (every node's engines: MAX_NODES heartbeats' worth fit)
MAX_NODE_NAME_BYTES, MAX_HEARTBEAT_BYTES = 255, 64 << 10
CLUSTER_MESSAGE_BYTES = 128 << 20
RELEASE_TIMEOUT_SECONDS = 5.0
RELEASE_RETRY_SECONDS, RELEASE_RETRY_MAX_SECONDS = 0.2, 5.0  # backoff of a lost release
# Settings every node must share: how a group spanning nodes is planned (node 0) and laid out
# and run (every node's engines). One that differs would hang or corrupt such groups. The
# heartbeat too: a node beating slower than node 0 waits (3 of node 0's periods) lost its
# lease after every registration, each loss aborting its groups; and the number of nodes.
# And the shared pool of group names (--allow-uids / --allow-gids): node 0 scopes every
# forwarded join by its own, a member by its own while node 0 is away, so uids a member's
# operator never pooled shared names through node 0 (a review).
AGREED_SETTINGS = ("cuda_cluster", "cuda_hierarchical", "nvshmem_heap_bytes",
                   "cluster_heartbeat_seconds", "num_nodes")
AGREED_ID_SETTINGS = ("allow_uids", "allow_gids")  # (compared as sets of ids)


def agreed_settings(sup: Supervisor) -> str:
    """This node's agreed settings (and resolved backend) as "name=value;...". """
    items = [f"backend={sup.backend}"]
    items += [f"{name}={getattr(sup.cfg, name, '')}" for name in AGREED_SETTINGS]
    items += [f"{name}={','.join(map(str, sorted(parse_ids(name, getattr(sup.cfg, name, '')))))}"
              for name in AGREED_ID_SETTINGS]
    return ";".join(items)


def settings_difference(mine: str, theirs: str) -> str:
    """The settings that differ, "name: node 0's value vs the node's" (empty: none; an older
    node that sends none is not refused)."""
    if not theirs:
        return ""
    a = dict(i.split("=", 1) for i in mine.split(";") if "=" in i)
    b = dict(i.split("=", 1) for i in theirs.split(";") if "=" in i)
    return ", ".join(f"{k}: {a.get(k)} on node 0, {b.get(k)} there"
                     for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


T = TypeVar("T")


async def within(aw: Awaitable[T], seconds: float) -> T:
    """`await aw`, TimeoutError after `seconds`. Not asyncio.wait_for: up to Python 3.11 it
    swallows a cancellation that comes just as `aw` completes (it returns the result instead),
    so a stop's cancellation of a lease loop was lost and the daemon never exited."""
    async with asyncio.timeout(seconds):
        return await aw


def current_task_cancelling() -> bool:
    """Whether this task was asked to stop, even where a library swallowed the CancelledError."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def heartbeat_problem(hb: epd_pb2.ClusterHeartbeat) -> str | None:
    """Why node 0 refuses a heartbeat, or None. Every node's engines go into every lease's
    events: unbounded, one token-holding node's 2.5 MB name cut every other node's lease
    (events past gRPC's message limit) and node 0's topology."""
    name = len(hb.node_name.encode())
    if name > MAX_NODE_NAME_BYTES:
        return f"node_name of {name} bytes: at most {MAX_NODE_NAME_BYTES}"
    if len(hb.engines) > MAX_ENGINES:
        return f"{len(hb.engines)} engines: a node runs at most {MAX_ENGINES}"
    # (less its agreed settings: compared with node 0's own, never passed on, and as long as
    # every node's --allow-uids list; a long one must not keep the cluster from forming)
    size = hb.ByteSize() - len(hb.agreed_settings.encode())
    if size > MAX_HEARTBEAT_BYTES:
        return f"a heartbeat of {size} bytes: at most {MAX_HEARTBEAT_BYTES}"
    return None


def cluster_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((CLUSTER_TOKEN_METADATA, token),)


@dataclass(frozen=True)
class ClusterTls:
    """Mutual TLS on the Cluster port: this node's certificate chain and key, and the CA
    certificates a peer's must chain to (PEM bytes, read once at start)."""

    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def of(cls, cfg: Config) -> ClusterTls | None:
        """The configured files (None without them); ValueError naming a bad one."""
        if not cfg.cluster_tls_cert:
            return None
        tls = cls(read_pem("cluster_tls_cert", cfg.cluster_tls_cert),
                  read_pem("cluster_tls_key", cfg.cluster_tls_key),
                  read_pem("cluster_tls_ca", cfg.cluster_tls_ca))
        # gRPC reports a key that does not match its certificate, or a block that is not one,
        # only as "Failed to bind" (node 0) or a peer it cannot reach (the others): checked
        # here, naming the settings, on every node.
        import ssl
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            # (no passphrase: an encrypted key is refused here, as gRPC cannot use one,
            # instead of OpenSSL prompting for it on the daemon's terminal)
            ctx.load_cert_chain(cfg.cluster_tls_cert, cfg.cluster_tls_key, password=lambda: b"")
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"cluster_tls_cert {cfg.cluster_tls_cert} and cluster_tls_key "
                             f"{cfg.cluster_tls_key}: not a certificate and its private key "
                             f"({e})") from None
        try:
            ctx.load_verify_locations(cfg.cluster_tls_ca)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"cluster_tls_ca {cfg.cluster_tls_ca}: no CA certificate in it "
                             f"({e})") from None
        return tls

    def server_credentials(self) -> grpc.ServerCredentials:
        """Node 0: present our certificate, require one from every client node."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Other nodes: verify node 0's certificate, present ours."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def engine_infos(sup: Supervisor) -> list[epd_pb2.EngineInfo]:
    """This node's engines as the cluster sees them (no metrics read: sent every heartbeat)."""
    return [epd_pb2.EngineInfo(index=e.index, socket_path=e.socket_path,
                               backend=sup.planner.proto_kind, ready=e.ready,
                               pid=e.proc.pid if e.proc else 0, restarts=e.restarts)
            for e in sup.engines]


def world_fields(sup: Supervisor) -> dict[str, int]:
    """ClusterInfo's view of the world this node's engines run in (cluster_world.py)."""
    world = getattr(sup.planner, "world", None) if sup.world_generation else None
    return {"world_generation": sup.world_generation,
            "world_num_pes": world.num_pes if world is not None else 0}


@dataclass
class NodeLease:
    node_rank: int
    incarnation: str
    node_name: str
    engines: list[epd_pb2.EngineInfo]
    last_seen: float = field(default_factory=time.monotonic)
    live: bool = True
    world_generation: int = 0  # the world its engines run in (heartbeat)
    world_left: int = 0  # the latest world it left (heartbeat)


class ClusterHub(epd_pb2_grpc.ClusterServicer):
    """Node 0: the registry of the other nodes' leases and the entry of their rendezvous."""

    def __init__(self, sup: Supervisor, token: str) -> None:
        self.sup = sup
        self.token = token
        self.heartbeat = sup.cfg.cluster_heartbeat_seconds
        self.nodes: dict[int, NodeLease] = {}
        self.keeper = WorldKeeper(sup.cfg.num_nodes)  # (backends with a world over all nodes)
        self.world: epd_pb2.ClusterWorld | None = None
        self._tending = False  # (tend_world is not re-entered: see there)

    async def _check_token(self, context, method: str) -> None:
        sent = dict(context.invocation_metadata() or ()).get(CLUSTER_TOKEN_METADATA)
        if not sent:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"Cluster.{method} needs the cluster token "
                                f"(metadata {CLUSTER_TOKEN_METADATA!r})")
        if not (isinstance(sent, str)
                and hmac.compare_digest(sent.encode(), self.token.encode())):
            # (rate-limited: any peer reaching the port could write thousands a second)
            WRONG_TOKEN.warning("wrong-token", f"Cluster.{method} from {context.peer()} "
                                               f"refused: wrong cluster token")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"Cluster.{method}: wrong cluster token")

    def info(self) -> epd_pb2.ClusterInfo:
        cfg, now = self.sup.cfg, time.monotonic()
        nodes = [epd_pb2.ClusterNodeInfo(node_rank=0, node_name=socket.gethostname(),
                                         healthy=True, engines=engine_infos(self.sup),
                                         incarnation=self.sup.incarnation)]
        for rank in range(1, cfg.num_nodes):
            n = self.nodes.get(rank)
            nodes.append(epd_pb2.ClusterNodeInfo(node_rank=rank) if n is None else
                         epd_pb2.ClusterNodeInfo(node_rank=rank, node_name=n.node_name,
                                                 healthy=n.live, engines=n.engines,
                                                 last_seen_seconds=now - n.last_seen,
                                                 incarnation=n.incarnation))
        return epd_pb2.ClusterInfo(node_rank=0, num_nodes=cfg.num_nodes,
                                   cluster_address=cfg.cluster_address, nodes=nodes,
                                   coordinator_reachable=True, **world_fields(self.sup),
                                   tls=self.sup.cluster_tls is not None)

    def _event(self) -> epd_pb2.ClusterLeaseEvent:
        ev = epd_pb2.ClusterLeaseEvent(heartbeat_seconds=self.heartbeat, cluster=self.info())
        if self.world is not None:
            ev.world.CopyFrom(self.world)
        return ev

    def _node_states(self) -> dict[int, NodeState]:
        sup = self.sup
        nodes = {0: NodeState(sup.incarnation, len(sup.engines), sup.world_generation,
                              sup.world_left)}
        for rank, n in self.nodes.items():
            if n.live:
                nodes[rank] = NodeState(n.incarnation, len(n.engines), n.world_generation,
                                        n.world_left)
        return nodes

    def tend_world(self) -> None:
        """After any change of the leases or of node 0's engines: lose the world if a node
        left it, form the next once every node holds a lease and runs no engines. Node 0's
        own failure here is logged, never raised: it runs inside a node's Lease stream,
        whose end would blame that node (and abort its groups)."""
        sup = self.sup
        if not sup.world_mode or sup.stopping or self._tending:
            return  # (called again from leave_world / enter_world: this call goes on)
        self._tending = True
        try:
            self._tend_world()
        except Exception:
            log.exception("cluster world: node 0 could not tend it (the next heartbeat tries "
                          "again)")
        finally:
            self._tending = False

    def _tend_world(self) -> None:
        sup, keeper = self.sup, self.keeper
        why = keeper.lost(self._node_states())  # (node 0's own leaving included)
        if why is not None:
            self.world = None
            if sup.world_generation:
                sup.leave_world(why)
        world = keeper.form(self._node_states())
        if world is not None:
            try:
                self.world = sup.planner.form_world(world)
            except Exception:
                keeper.abandon("node 0 could not make it")
                raise
            log.info("cluster world %d formed over %d node(s), %d PE(s)", world.generation,
                     sup.cfg.num_nodes, world.num_pes)
            sup.enter_world(self.world)  # (a failure leaves it: abandoned at the next tend)

    async def Lease(self, request_iterator, context):
        await self._check_token(context, "Lease")
        deadline = MISSED_HEARTBEATS * self.heartbeat
        it = request_iterator.__aiter__()
        try:
            first = await within(it.__anext__(), deadline)
        except (TimeoutError, StopAsyncIteration):
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no registration heartbeat within {deadline:g} s")
        if (problem := heartbeat_problem(first)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        rank = first.node_rank
        num_nodes = self.sup.cfg.num_nodes
        if not 0 < rank < num_nodes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"node_rank {rank}: this cluster has nodes 1..{num_nodes - 1} "
                                f"besides node 0")
        differ = settings_difference(agreed_settings(self.sup), first.agreed_settings)
        if differ:
            log.error("node %d refused: its settings differ from node 0's (%s)", rank, differ)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"node {rank}'s settings differ from node 0's: {differ} "
                                f"(every node of a cluster must run with the same)")
        old = self.nodes.get(rank)
        if old is not None and old.live:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"node {rank} is registered already (incarnation "
                                f"{old.incarnation}, lease alive); two daemons with one "
                                f"--node-rank, or a restart before the old lease ended "
                                f"(retry after {deadline:g} s)")
        lease = NodeLease(rank, first.incarnation, first.node_name, list(first.engines),
                          world_generation=first.world_generation,
                          world_left=first.world_left)
        self.nodes[rank] = lease
        log.info("node %d (%s, incarnation %s) registered with %d engine(s)", rank,
                 first.node_name, first.incarnation, len(first.engines))
        why = "its lease stream ended"
        try:  # (from here on the lease ends with the stream, whatever fails: _lease_ended)
            self.tend_world()
            yield self._event()
            while True:
                try:
                    hb = await within(it.__anext__(), deadline)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    why = f"no heartbeat within {deadline:g} s"
                    break
                if (problem := heartbeat_problem(hb)) is not None:
                    why = problem
                    break
                lease.last_seen = time.monotonic()
                lease.engines = list(hb.engines)
                lease.world_generation = hb.world_generation
                lease.world_left = hb.world_left
                self.tend_world()
                yield self._event()
        except asyncio.CancelledError:
            why = "its connection broke"
            raise
        except grpc.aio.AioRpcError as e:  # reading a broken stream
            why = f"its lease stream failed ({e.code().name})"
        finally:
            self._lease_ended(lease, why)

    def _lease_ended(self, lease: NodeLease, why: str) -> None:
        if not lease.live or self.nodes.get(lease.node_rank) is not lease:
            return
        lease.live = False
        lost = self.sup.coordinator.node_lost(lease.node_rank, why)
        log.warning("node %d lease ended (%s); groups aborted: %s", lease.node_rank, why,
                    lost or "none")
        self.tend_world()

    def _live(self, rank: int, incarnation: str) -> bool:
        n = self.nodes.get(rank)
        return n is not None and n.live and n.incarnation == incarnation

    async def Rendezvous(self, request, context):
        await self._check_token(context, "Rendezvous")
        if not self._live(request.node_rank, request.incarnation):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"node {request.node_rank} holds no lease with node 0 "
                                f"(incarnation {request.incarnation!r}); its supervisor "
                                f"registers first")
        engines = len(self.nodes[request.node_rank].engines)
        if not request.request.attached and not 0 <= request.request.engine_index < engines:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"engine index {request.request.engine_index} out of range: "
                                f"node {request.node_rank} has {engines} engine(s)")
        try:
            return await self.sup.coordinator.rendezvous(request.request,
                                                         node=request.node_rank)
        except EpdError as e:
            await context.abort(e.code, e.message)

    async def ReleaseRank(self, request, context):
        await self._check_token(context, "ReleaseRank")
        # (a node whose lease ended had its ranks released then: node_lost)
        if self._live(request.node_rank, request.incarnation):
            r = request.request
            self.sup.coordinator.release(r.group_id, r.rank, r.reason, left=r.left,
                                         node=request.node_rank)
        return epd_pb2.ReleaseRankResponse()

    def close(self) -> None:
        for lease in self.nodes.values():
            lease.live = False


@dataclass
class AdoptedGroup:
    """A group node 0 formed with ranks on this node: the plan this node holds for it."""

    name: str
    plan: bytes  # this node's plan (GroupPlanner.adopt_plan)
    rank_nodes: tuple[int, ...]
    local: dict[int, int] = field(default_factory=dict)  # rank -> local engine
    released: set[int] = field(default_factory=set)
    aborted: bool = False
    shrink: bool = False  # a low-latency group that masks a rank that goes away (spec.shrink)
    # The node 0 (its incarnation) that formed it: once another leads the cluster, this node
    # alone tells the group's ranks that one went away (the new node 0 never knew the group)
    owner: str = ""


class ClusterMember:
    """A node other than 0: its lease with node 0, and the forwarding of its engines' group
    calls there (while the lease is alive; otherwise groups form on this node alone)."""

    def __init__(self, sup: Supervisor, token: str) -> None:
        self.sup = sup
        self.cfg = sup.cfg
        self.token = token
        self.metadata = cluster_metadata(token)
        self.connected = False
        self.view: epd_pb2.ClusterInfo | None = None
        self.last_error = ""
        self.node0_incarnation = ""  # the node 0 whose worlds this node follows
        self.leases = 0  # leases held so far (a release is retried within its own)
        self.groups: dict[str, AdoptedGroup] = {}
        self._channel: grpc.aio.Channel | None = None
        self._stub: epd_pb2_grpc.ClusterStub | None = None
        self._tasks: set[asyncio.Task] = set()
        # Calls forwarded to node 0 and waiting; those cut when its lease ended, with why
        self._forwarded: set = set()
        self._cut: dict[object, str] = {}

    def info(self) -> epd_pb2.ClusterInfo:
        cfg = self.cfg
        nodes = list(self.view.nodes) if self.view is not None and self.connected else []
        if not nodes:  # node 0 not reachable: what this node knows, itself
            nodes = [epd_pb2.ClusterNodeInfo(node_rank=0, healthy=False),
                     epd_pb2.ClusterNodeInfo(node_rank=cfg.node_rank,
                                             node_name=socket.gethostname(), healthy=True,
                                             engines=engine_infos(self.sup),
                                             incarnation=self.sup.incarnation)]
        return epd_pb2.ClusterInfo(node_rank=cfg.node_rank, num_nodes=cfg.num_nodes,
                                   cluster_address=cfg.cluster_address, nodes=nodes,
                                   coordinator_reachable=self.connected,
                                   **world_fields(self.sup),
                                   tls=self.sup.cluster_tls is not None)

    async def run(self) -> None:
        """Hold the lease; after it ends, register again (every period) until stopped."""
        tls = self.sup.cluster_tls
        options = [("grpc.max_receive_message_length", CLUSTER_MESSAGE_BYTES)]
        self._channel = (grpc.aio.secure_channel(self.cfg.cluster_address,
                                                 tls.channel_credentials(), options=options)
                         if tls is not None
                         else grpc.aio.insecure_channel(self.cfg.cluster_address,
                                                        options=options))
        self._stub = epd_pb2_grpc.ClusterStub(self._channel)
        try:
            while True:
                why = await self._lease()
                # gRPC's stream set-up task swallows a cancellation that lands while this task
                # waits on it (grpc.aio's _prepare_rpc); when the call has already failed (a
                # wrong token: at once), the read then raises the RPC's error, not the
                # cancellation, and a stop's cancel was lost: the daemon never exited. The
                # task still counts the request.
                if current_task_cancelling():
                    raise asyncio.CancelledError
                if self.connected:
                    self.connected = False
                    self._coordinator_lost(why)
                elif why != self.last_error:
                    log.error("cannot register with node 0 at %s: %s", self.cfg.cluster_address,
                              why)
                self.last_error = why
                await asyncio.sleep(self.cfg.cluster_heartbeat_seconds)
        finally:
            self.connected = False
            # (shielded: a stop cancels this task again each second, and the close goes on)
            await asyncio.shield(self._channel.close())

    def _heartbeat(self) -> epd_pb2.ClusterHeartbeat:
        return epd_pb2.ClusterHeartbeat(node_rank=self.cfg.node_rank,
                                        incarnation=self.sup.incarnation,
                                        node_name=socket.gethostname(),
                                        engines=engine_infos(self.sup),
                                        world_generation=self.sup.world_generation,
                                        world_left=self.sup.world_left,
                                        agreed_settings=agreed_settings(self.sup))

    async def _lease(self) -> str:
        """One lease: returns why it ended."""
        # Node 0 ends a lease after MISSED_HEARTBEATS of its own periods: beat at the shorter
        # of the two (its period comes with every event).
        period = [self.cfg.cluster_heartbeat_seconds]
        call = self._stub.Lease(metadata=self.metadata)

        async def beat() -> None:
            while True:
                await call.write(self._heartbeat())
                await asyncio.sleep(period[0])

        sender = asyncio.create_task(beat())
        try:
            while True:
                wait = MISSED_HEARTBEATS * max(period[0], self.cfg.cluster_heartbeat_seconds)
                try:
                    ev = await within(call.read(), wait)
                except TimeoutError:
                    return f"no answer from node 0 within {wait:g} s"
                if ev is grpc.aio.EOF:
                    return "node 0 ended the lease"
                if ev.heartbeat_seconds > 0:
                    period[0] = min(self.cfg.cluster_heartbeat_seconds, ev.heartbeat_seconds)
                self.view = ev.cluster
                try:
                    self._follow_world(ev)
                except Exception as e:  # (an engine that cannot start: leave the world half
                    # entered, end this lease and register again; node 0 forms the next one)
                    why = f"following node 0's world failed: {e!r}"
                    if why != self.last_error:
                        log.exception("following node 0's world failed")
                    if self.sup.world_generation:
                        with contextlib.suppress(Exception):
                            self.sup.leave_world(why)
                    return why
                if not self.connected:
                    self.connected = True
                    self.leases += 1
                    self.last_error = ""
                    log.info("registered with node 0 at %s (node %d of %d)",
                             self.cfg.cluster_address, self.cfg.node_rank, self.cfg.num_nodes)
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {e.details()}"
        finally:
            sender.cancel()
            call.cancel()
            # The sender ends with the call in any way (cancelled, or writing to a finished
            # RPC: InvalidStateError); the reader above already said why the lease ended.
            # Waited for, not awaited: a stop cancelling this task meanwhile is not swallowed.
            await asyncio.wait({sender})
            if not sender.cancelled():
                sender.exception()  # (retrieved: not logged as never retrieved)

    def _follow_world(self, ev: epd_pb2.ClusterLeaseEvent) -> None:
        """Start the engines in the world node 0 formed; stop them when it says it is lost.
        A world this node left (its engine died) is never entered again."""
        sup = self.sup
        node0 = ev.cluster.nodes[0].incarnation if ev.cluster.nodes else ""
        if node0 and node0 != self.node0_incarnation:  # (also where no world is followed: the
            if self.node0_incarnation and sup.world_mode:  # node 0 that leads, AdoptedGroup)
                sup.world_left = 0  # (node 0 restarted: its worlds count from 1 again)
            self.node0_incarnation = node0
        if not sup.world_mode:
            return
        if ev.HasField("world"):
            if ev.world.generation > max(sup.world_generation, sup.world_left):
                sup.enter_world(ev.world)
        elif sup.world_generation:
            sup.leave_world(f"node 0 says world {sup.world_generation} is lost")

    def _coordinator_lost(self, why: str) -> None:
        # A forwarded rendezvous waiting on node 0 ends now, saying why (not at its own
        # deadline, up to its timeout + 5 s later, as a bare "Deadline Exceeded").
        for call in list(self._forwarded):
            self._cut[call] = why
            call.cancel()
        if self.sup.world_mode and self.sup.world_generation:
            self.sup.leave_world(f"node 0 went away ({why})")
        me = self.cfg.node_rank
        aborted = []
        for g in self.groups.values():
            nodes = sorted(set(g.rank_nodes))
            if nodes == [me]:  # node-local: its memory is held here, it keeps working, and
                g.owner = ""  # this node alone tells its ranks when one goes (node 0 lets it
                continue      # go: Coordinator.node_lost)
            if g.aborted:
                continue
            reason = (f"node 0 (the cluster coordinator) went away ({why}); the group spans "
                      f"nodes {nodes}")
            if self._masks(g):  # this node's ranks leave it; the other nodes' ranks go on
                for r in g.local:
                    self.sup.planner.mark_gone(g.plan, r, reason)
                continue
            g.aborted = True
            aborted.append(g.name)
            self.sup.planner.abort_group(g.plan, reason)
        log.warning("lease with node 0 ended (%s); groups spanning nodes aborted: %s", why,
                    aborted or "none")

    def _masks(self, g: AdoptedGroup) -> bool:
        return g.shrink and self.sup.planner.supports_rank_masking

    def owns(self, group_id: str) -> bool:
        return group_id in self.groups

    async def rendezvous(self, req: epd_pb2.RendezvousRequest) -> epd_pb2.RendezvousResponse:
        """Forward an engine's rendezvous to node 0; a formed group's plan is adopted here."""
        timeout = (req.timeout_seconds or self.cfg.timeout_seconds) + FORWARD_MARGIN_SECONDS
        fwd = epd_pb2.ClusterRendezvousRequest(node_rank=self.cfg.node_rank,
                                               incarnation=self.sup.incarnation, request=req)
        call = self._stub.Rendezvous(fwd, metadata=self.metadata, timeout=timeout)
        self._forwarded.add(call)
        try:
            resp = await call
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as e:
            why = self._cut.get(call)
            if why is not None:  # (node 0's lease ended under it: _coordinator_lost)
                raise EpdError(grpc.StatusCode.UNAVAILABLE,
                               f"node 0 (the cluster coordinator) went away ({why}) while "
                               f"this node's call waited for it") from None
            if isinstance(e, asyncio.CancelledError):
                raise
            code = e.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise EpdError(grpc.StatusCode.UNAVAILABLE,
                               f"node 0 (the cluster coordinator) is unreachable: "
                               f"{e.details()}") from None
            raise EpdError(code, e.details() or code.name) from None
        finally:
            self._forwarded.discard(call)
            self._cut.pop(call, None)
        if req.attached:
            return resp
        g = self.groups.get(resp.group_id)
        if g is None:
            try:
                plan = self.sup.planner.adopt_plan(resp.group_id, resp.plan)
            except EpdError as e:
                self.release_rank(resp.group_id, req.rank, e.message, forward_only=True)
                raise
            g = self.groups[resp.group_id] = AdoptedGroup(req.spec.name, plan,
                                                          tuple(resp.rank_nodes),
                                                          shrink=req.spec.shrink,
                                                          owner=self.node0_incarnation)
        g.local[req.rank] = req.engine_index
        g.released.discard(req.rank)  # (a replacement of a rank that went away: held again)
        out = epd_pb2.RendezvousResponse()
        out.CopyFrom(resp)
        out.plan = g.plan
        return out

    def release_rank(self, group_id: str, rank: int, reason: str, left: bool = False,
                     forward_only: bool = False) -> None:
        """A rank of a forwarded group went away: tell node 0 (best effort, in the background)
        and drop this node's hold once all its ranks of the group are gone. A group formed by
        an earlier node 0 (it restarted since) is this node's alone to tell: the new one
        never knew it and would ignore the release (a review: the peers of a rank that died
        then waited for their deadline, and a shrink group's rank was never masked)."""
        g = self.groups.get(group_id)
        led = self.connected and (g is None or g.owner == self.node0_incarnation)
        if led:
            req = epd_pb2.ClusterReleaseRequest(
                node_rank=self.cfg.node_rank, incarnation=self.sup.incarnation,
                request=epd_pb2.ReleaseRankRequest(group_id=group_id, rank=rank, reason=reason,
                                                   left=left))
            task = asyncio.get_running_loop().create_task(self._forward_release(req))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if forward_only or g is None:
            return
        if (reason and not g.aborted and not led
                and len(g.released) < len(g.rank_nodes) - 1):
            # Node 0 cannot tell the peers: this node's shared plan can (node-local groups).
            if self._masks(g):
                self.sup.planner.mark_gone(g.plan, rank, reason)
            else:
                g.aborted = True
                self.sup.planner.abort_group(g.plan, reason)
        g.released.add(rank)
        if g.released >= set(g.local):
            self.sup.planner.free_group(g.plan)
            del self.groups[group_id]

    async def _forward_release(self, req: epd_pb2.ClusterReleaseRequest) -> None:
        """Tell node 0, again (backing off) until it answers while this lease lives: a release
        lost to a blip would keep the group, its memory and its name there with a rank that is
        gone. Once the lease ends node 0 releases every rank of this node itself (node_lost)."""
        lease, delay = self.leases, RELEASE_RETRY_SECONDS
        while True:
            try:
                await self._stub.ReleaseRank(req, metadata=self.metadata,
                                             timeout=RELEASE_TIMEOUT_SECONDS)
                return
            except grpc.aio.AioRpcError as e:
                log.warning("forwarding the release of rank %d of %s failed (%s); retrying "
                            "while the lease lives", req.request.rank, req.request.group_id,
                            e.details())
            await asyncio.sleep(delay)
            delay = min(2 * delay, RELEASE_RETRY_MAX_SECONDS)
            if not self.connected or self.leases != lease:
                return

    def engine_lost(self, engine: int) -> None:
        """An engine of this node died: its ranks of forwarded groups go away."""
        for gid, g in list(self.groups.items()):
            ranks = sorted(r for r, e in g.local.items() if e == engine and r not in g.released)
            reason = (f"engine {engine} of node {self.cfg.node_rank} holding rank(s) {ranks} "
                      f"exited")
            for r in ranks:
                self.release_rank(gid, r, reason)

    def close(self) -> None:
        for g in self.groups.values():
            self.sup.planner.free_group(g.plan)
        self.groups.clear()
        for t in self._tasks:
            t.cancel()


def new_incarnation() -> str:
    return secrets.token_hex(6)
