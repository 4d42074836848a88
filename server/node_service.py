"""The Node service on <socket-dir>/node.sock: GetTopology for any client of the socket, and
the RPCs the daemon's own engines call (Rendezvous, ReleaseRank, GetBootstrap), which need the
secret the supervisor gave them at spawn."""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from typing import TYPE_CHECKING

import grpc

from ..proto.errors import EpdError, InvalidArgument
from ..proto.v1 import epd_pb2, epd_pb2_grpc
from . import __version__
from .config import NODE_TOKEN_METADATA
from .service_classes import LATENCY, THROUGHPUT

if TYPE_CHECKING:
    from .supervisor import Supervisor

log = logging.getLogger("epd.supervisor")


class NodeService(epd_pb2_grpc.NodeServicer):
    """GetTopology is open to every client of node.sock; the RPCs engines use (Rendezvous,
    ReleaseRank, GetBootstrap) need the secret the supervisor gave its engines at spawn."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self._reads = 0  # reads of the counts below started so far
        self._off_mps: tuple[int, dict[str, int]] | None = None  # (its read's number, counts)
        self._reading: asyncio.Future | None = None  # the read under way

    async def _sessions_without_mps(self) -> dict[str, int]:
        """The engines' counts of sessions off the MPS server (a whole collection of every
        process's metrics file, off the event loop): one read at a time, shared by every call
        that came before it started, so each call gets counts read after it came and a flood
        of calls makes one read after another, not one each (a fuzzer's report: each call
        read under the lock that the event loop takes when an engine dies). A call cancelled
        meanwhile (its deadline) leaves the read running and still the only one: callers wait
        for it shielded (a review: with a lock released by the cancelled caller, 200 calls
        with a 2 ms deadline started 134 reads, six at once)."""
        came = self._reads
        while True:
            done = self._off_mps
            if done is not None and done[0] > came:  # (started after this call came)
                return done[1]
            if self._reading is None:
                self._reads += 1
                self._reading = asyncio.ensure_future(self._read(self._reads))
            await asyncio.shield(self._reading)

    async def _read(self, number: int) -> None:
        try:
            self._off_mps = (number, await asyncio.to_thread(sessions_without_mps))
        finally:
            self._reading = None

    async def _engine_only(self, context, method: str) -> None:
        sent = dict(context.invocation_metadata() or ()).get(NODE_TOKEN_METADATA, "")
        if not (isinstance(sent, str)
                and hmac.compare_digest(sent.encode(), self.sup.node_token.encode())):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"Node.{method} is for the daemon's engines only")

    async def GetTopology(self, request, context):
        s = self.sup
        # The engines count their sessions off the MPS server in a gauge; read it from the
        # shared metrics folder (off the event loop: it reads every process's file).
        without_mps = await self._sessions_without_mps()
        engines = []
        for e in s.engines:
            info = s.device_names.get(e.index, ("", ""))
            engines.append(epd_pb2.EngineInfo(
                index=e.index, socket_path=e.socket_path,
                backend=s.planner.proto_kind,
                device_name=info[0], device_uuid=info[1], ready=e.ready,
                pid=e.proc.pid if e.proc else 0, restarts=e.restarts,
                sessions_without_mps=without_mps.get(str(e.index), 0),
                failed_starts=e.failed_starts, last_failure=e.last_failure,
                device=e.slot.device, service_class=e.slot.service_class,
                tenant_pool=e.slot.tenant_pool))
        by_class = s.coordinator.groups_by_class()
        cluster = s.cluster.info() if s.cluster is not None else None
        return epd_pb2.GetTopologyResponse(version=__version__, node_name=socket.gethostname(),
                                           engines=engines, metrics_url=s.metrics_url,
                                           mps_mode=s.mps.mode,
                                           mps_pipe_directory=s.mps.pipe_directory,
                                           service_class_policy=s.policy_text,
                                           latency_num_sms=s.cfg.latency_num_sms,
                                           throughput_num_sms=s.cfg.throughput_num_sms,
                                           latency_groups=by_class[LATENCY],
                                           throughput_groups=by_class[THROUGHPUT],
                                           cluster=cluster)

    async def Rendezvous(self, request, context):
        await self._engine_only(context, "Rendezvous")
        member = self.sup.cluster_member
        try:
            # Cluster mode, node > 0: node 0 forms the group while the lease is alive (and
            # always for a group it formed); otherwise the group forms on this node alone.
            if member is not None and (member.owns(request.group_id) if request.attached
                                       else member.connected):
                return await member.rendezvous(request)
            return await self.sup.coordinator.rendezvous(request, node=self.sup.cfg.node_rank)
        except EpdError as e:
            await context.abort(e.code, e.message)

    async def ReleaseRank(self, request, context):
        await self._engine_only(context, "ReleaseRank")
        member = self.sup.cluster_member
        if member is not None and member.owns(request.group_id):
            member.release_rank(request.group_id, request.rank, request.reason,
                                left=request.left)
            return epd_pb2.ReleaseRankResponse()
        self.sup.coordinator.release(request.group_id, request.rank, request.reason,
                                     left=request.left)
        return epd_pb2.ReleaseRankResponse()

    async def GetBootstrap(self, request, context):
        await self._engine_only(context, "GetBootstrap")
        s = self.sup
        try:
            if not 0 <= request.engine_index < len(s.engines):
                raise InvalidArgument(f"engine index {request.engine_index} out of range")
            slot = s.engines[request.engine_index].slot
            return s.planner.bootstrap(slot.pe, s.world_size(slot.world), slot.world)
        except EpdError as e:
            await context.abort(e.code, e.message)


def sessions_without_mps() -> dict[str, int]:
    """epd_sessions_without_mps per engine label, from the multiprocess metrics folder."""
    from prometheus_client import multiprocess

    from . import metrics
    out: dict[str, int] = {}
    try:
        with metrics.COLLECT_LOCK:  # (not while a dead engine's files are folded)
            families = list(multiprocess.MultiProcessCollector(None).collect())
        for family in families:
            if family.name == "epd_sessions_without_mps":
                for sample in family.samples:
                    out[sample.labels.get("engine", "")] = int(sample.value)
    except Exception:  # a file being written or removed: report 0, never fail the call
        log.debug("reading epd_sessions_without_mps failed", exc_info=True)
    return out

