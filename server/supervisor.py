"""The supervisor: one per node. Starts an engine process per GPU (or `--engines N` on the CPU
backend), restarts crashed engines, serves the Node service (topology + group rendezvous) on
<socket-dir>/node.sock and the HTTP endpoint (/metrics, /healthz, /readyz).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..proto.errors import EpdError
from ..proto.v1 import epd_pb2, epd_pb2_grpc
from . import __version__
from .backends.base import GroupPlanner
from .config import Config

log = logging.getLogger("epd.supervisor")


@dataclass
class EngineProc:
    index: int
    socket_path: str
    proc: subprocess.Popen | None = None
    ready: bool = False
    restarts: int = 0
    started_at: float = 0.0


class NodeService(epd_pb2_grpc.NodeServicer):
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup

    async def GetTopology(self, request, context):
        s = self.sup
        engines = []
        for e in s.engines:
            info = s.device_names.get(e.index, ("", ""))
            engines.append(epd_pb2.EngineInfo(
                index=e.index, socket_path=e.socket_path,
                backend=s.planner.proto_kind,
                device_name=info[0], device_uuid=info[1], ready=e.ready,
                pid=e.proc.pid if e.proc else 0, restarts=e.restarts))
        return epd_pb2.GetTopologyResponse(version=__version__, node_name=socket.gethostname(),
                                           engines=engines, metrics_url=s.metrics_url)

    async def Rendezvous(self, request, context):
        try:
            return await self.sup.coordinator.rendezvous(request)
        except EpdError as e:
            await context.abort(e.code, e.message)

    async def ReleaseRank(self, request, context):
        self.sup.coordinator.release(request.group_id, request.rank, request.reason)
        return epd_pb2.ReleaseRankResponse()

    async def GetBootstrap(self, request, context):
        s = self.sup
        try:
            return s.planner.bootstrap(request.engine_index, len(s.engines))
        except EpdError as e:
            await context.abort(e.code, e.message)


class Supervisor:
    def __init__(self, cfg: Config, planner: GroupPlanner, num_engines: int) -> None:
        from .coordinator import Coordinator  # after PROMETHEUS_MULTIPROC_DIR is set

        self.cfg = cfg
        self.planner = planner
        self.backend = planner.name  # for logs and metrics only
        self.engines = [EngineProc(i, cfg.engine_socket(i)) for i in range(num_engines)]
        self.coordinator = Coordinator(planner, cfg.timeout_seconds)
        self.metrics_url = ""
        self.device_names: dict[int, tuple[str, str]] = {}
        self.stopping = False
        self._http = None

    def ready(self) -> tuple[bool, str]:
        not_ready = [e.index for e in self.engines if not e.ready]
        if self.stopping:
            return False, "draining"
        if not_ready:
            return False, f"engines not ready: {not_ready}"
        return True, f"ready: {len(self.engines)} engine(s), backend {self.backend}"

    def _spawn(self, e: EngineProc) -> None:
        env = dict(os.environ)
        env.update(self.cfg.to_env())
        env["EPD_BACKEND"] = self.backend
        # Never NVLink multicast: it can take a shared host's GPUs out of service.
        env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        for key, value in self.planner.engine_env().items():
            env.setdefault(key, value)
        e.proc = subprocess.Popen([sys.executable, "-m", "epd.server.engine.app",
                                   "--index", str(e.index)], env=env)
        e.ready = False
        e.started_at = time.monotonic()
        log.info("engine %d started (pid %d)", e.index, e.proc.pid)

    async def _probe(self, e: EngineProc) -> bool:
        try:
            async with grpc.aio.insecure_channel(f"unix://{e.socket_path}") as ch:
                resp = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            return False

    async def _monitor(self) -> None:
        from prometheus_client import multiprocess

        from . import metrics
        from .engine.state import sweep_engine_files
        while not self.stopping:
            for e in self.engines:
                if e.proc is None:
                    continue
                code = e.proc.poll()
                if code is not None and not self.stopping:
                    log.error("engine %d (pid %d) exited with code %s; restarting in %.1f s",
                              e.index, e.proc.pid, code, self.cfg.restart_backoff_seconds)
                    # A backend whose engines form one world that cannot take a new member
                    # (cuda: NVSHMEM) rebuilds the whole world: every engine restarts.
                    lost = self.engines if self.planner.restart_all_on_engine_loss else [e]
                    for x in lost:
                        if x is not e and x.proc is not None and x.proc.poll() is None:
                            x.proc.kill()
                            x.proc.wait()
                        multiprocess.mark_process_dead(x.proc.pid)
                        metrics.ENGINE_UP.labels(str(x.index)).set(0)
                        x.ready = False
                        self.coordinator.engine_lost(x.index)
                        sweep_engine_files(self.cfg.shm_dir, x.index)
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(x.socket_path)
                    await asyncio.sleep(self.cfg.restart_backoff_seconds)
                    if self.planner.restart_all_on_engine_loss:
                        self.planner.new_world()
                    for x in lost:
                        x.restarts += 1
                        metrics.ENGINE_RESTARTS.labels(str(x.index)).inc()
                        self._spawn(x)
                elif not e.ready and await self._probe(e):
                    e.ready = True
                    metrics.ENGINE_UP.labels(str(e.index)).set(1)
                    log.info("engine %d ready on %s", e.index, e.socket_path)
            await asyncio.sleep(0.1)

    async def run(self) -> int:
        from . import http, metrics

        cfg = self.cfg
        sock_dir = Path(cfg.socket_dir)
        sock_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(sock_dir, 0o750)  # keep the folder (clients may bind-mount it); tighten it
        Path(cfg.shm_dir).mkdir(parents=True, exist_ok=True)
        metrics.BUILD_INFO.labels(__version__, self.backend).set(1)

        server = grpc.aio.server()
        epd_pb2_grpc.add_NodeServicer_to_server(NodeService(self), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(cfg.node_socket)
        server.add_insecure_port(f"unix://{cfg.node_socket}")
        await server.start()
        os.chmod(cfg.node_socket, 0o660)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)

        self._http = http.start(cfg.metrics_host, cfg.metrics_port, self.ready)
        host, port = self._http.server_address[:2]
        self.metrics_url = f"http://{host}:{port}/metrics"
        log.info("EPD %s: backend %s, %d engine(s), sockets in %s, metrics at %s", __version__,
                 self.backend, len(self.engines), cfg.socket_dir, self.metrics_url)
        self.planner.new_world()
        for e in self.engines:
            self._spawn(e)

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        monitor = asyncio.create_task(self._monitor())
        await stop.wait()

        log.info("draining: no new sessions; running collectives get %.0f s",
                 self.cfg.drain_seconds)
        self.stopping = True
        await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        monitor.cancel()
        for e in self.engines:
            if e.proc and e.proc.poll() is None:
                e.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.drain_seconds + 5
        for e in self.engines:
            if e.proc is None:
                continue
            while e.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if e.proc.poll() is None:
                log.warning("engine %d did not stop in time; killing it", e.index)
                e.proc.kill()
                e.proc.wait()
        self.coordinator.close()
        await server.stop(grace=0.5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(cfg.node_socket)
        self._http.shutdown()
        log.info("stopped")
        return 0


def prepare_metrics_dir() -> str:
    """Multiprocess metrics: must be set before prometheus_client is imported anywhere."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        path = tempfile.mkdtemp(prefix="epd-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    else:
        Path(path).mkdir(parents=True, exist_ok=True)
        for f in Path(path).glob("*.db"):  # stale samples of an earlier run
            f.unlink()
    return path


def run(cfg: Config) -> int:
    prepare_metrics_dir()
    from .backends import make_planner

    planner = make_planner(cfg)
    sup = Supervisor(cfg, planner, cfg.engines or planner.detect_engines())
    try:
        import uvloop
        return uvloop.run(sup.run())
    except ImportError:
        return asyncio.run(sup.run())
