"""The supervisor: one per node. Starts an engine process per GPU (or `--engines N` on the CPU
backend), restarts crashed engines, serves the Node service (topology + group rendezvous) on
<socket-dir>/node.sock (node_service.py) and the HTTP endpoint (/metrics, /healthz, /readyz).
The process around it, from `epd serve` to exit, is startup.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..proto import fd_channel
from ..proto.v1 import epd_pb2, epd_pb2_grpc
from . import __version__
from .backends.base import GroupPlanner
from .cluster import ClusterHub, ClusterMember, ClusterTls, new_incarnation
from .config import (
    NODE_TOKEN_ENV,
    Config,
    read_cluster_token,
)
from .engine_slots import EngineSlot, engine_slots
from .mps import Mps, MpsError
from .node_service import NodeService
from .open_files import check_open_files_limit
from .service_classes import THROUGHPUT

if TYPE_CHECKING:
    from .startup import EarlyStop

log = logging.getLogger("epd.supervisor")
WATCH_ERROR_LOG_SECONDS = 10.0  # a failing look at an engine is logged this often
# A ready engine's health check: at most this often (a third of --engine-unresponsive-seconds
# when that is shorter), each waiting at most its timeout (the monitor waits with it).
HEALTH_CHECK_SECONDS, HEALTH_CHECK_TIMEOUT_SECONDS = 5.0, 2.0
KILL_AGAIN_SECONDS = 30.0  # a killed engine that has not exited yet is killed again this often
MPS_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
LEFTOVER_ENGINE_SECONDS = 5.0  # exit after a failure: engines get this long before SIGKILL
DRAIN_EXTRA_SECONDS = 5.0  # a stop: engines get --drain-seconds and this long before SIGKILL

# A SIGKILLed engine is waited for this long at most (one stuck in the kernel, in a driver call,
# may not exit for a long time): then logged with its pid and left, the daemon going on without
# it. On the event loop (an engine lost while serving) the wait is shorter: it blocks the loop.
KILLED_EXIT_SECONDS, KILLED_EXIT_ON_LOOP_SECONDS = 5.0, 0.5
CANCEL_TRIES = 5  # a stop cancels a background task at most this many times, one second apart
# Signals that stop the daemon gracefully (SIGHUP: its terminal or session went away), SIGHUP
# not where the daemon was started ignoring it (nohup: it must outlive its terminal).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT) + (
    () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,))


class Stopped(BaseException):
    """A stop signal while the daemon starts up, in a step that may hang (a wedged driver):
    the start ends there, and what it made is removed (EarlyStop.interruptible)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StartupError(Exception):
    """A setting the daemon cannot start with: one line naming the setting and the fix."""


@dataclass
class EngineProc:
    index: int
    socket_path: str
    slot: EngineSlot = None  # type: ignore[assignment]  (default: device = index, any class)
    proc: subprocess.Popen | None = None
    ready: bool = False
    restarts: int = 0
    started_at: float = 0.0
    failed_starts: int = 0  # starts in a row that ended before the engine was ready
    last_failure: str = ""  # why the last of them ended (the engine's own words, or its exit)
    restart_at: float | None = None  # exited: when it is started again (monotonic)
    watch_error_logged: float = -1e9  # when a failed look at it was last logged (monotonic)
    answered_at: float = 0.0  # its last answered health check (monotonic)
    next_check_at: float = 0.0  # when a ready engine's health is checked next (monotonic)
    unresponsive: bool = False  # ready once, then stopped answering (not ready meanwhile)
    killed_at: float | None = None  # when the supervisor killed it for not answering
    missed: int = 0  # health checks in a row it did not answer

    def __post_init__(self) -> None:
        if self.slot is None:
            self.slot = EngineSlot(self.index, self.index, pe=self.index)

    def backoff(self, base: float, longest: float) -> float:
        """Delay before the next start: `base`, doubled for each failed start in a row."""
        doublings = min(max(self.failed_starts - 1, 0), 62)  # (2**1024 overflows a float)
        return min(base * 2 ** doublings, max(longest, base))


class Supervisor:
    def __init__(self, cfg: Config, planner: GroupPlanner, num_engines: int) -> None:
        from .coordinator import Coordinator  # after PROMETHEUS_MULTIPROC_DIR is set

        self.cfg = cfg
        self.planner = planner
        self.backend = planner.name  # for logs and metrics only
        self.engines = [EngineProc(x.index, cfg.engine_socket(x.device, x.service_class,
                                                              x.tenant_pool), x)
                        for x in engine_slots(num_engines, cfg.class_engines_on,
                                              [p.name for p in cfg.tenants])]
        worlds = {e.index: e.slot.world for e in self.engines}
        self.coordinator = Coordinator(planner, cfg.timeout_seconds, allow_uids=cfg.allowed_uids,
                                       allow_gids=cfg.allowed_gids, tenant_pools=cfg.tenants,
                                       world_of=(worlds.__getitem__ if len(set(worlds.values()))
                                                 > 1 else None))
        self.metrics_url = ""
        self.device_names: dict[int, tuple[str, str]] = {}
        self.policy_text = cfg.service_classes.text  # canonical (GetTopology)
        self.stopping = False
        self._stop: asyncio.Event | None = None  # set: run() drains and returns (request_stop)
        self.early_stop: EarlyStop | None = None  # a signal before run() (startup.run())
        self.class_engines_why = ""  # (logged at start: run() sets it from check_backend)
        self._http = None
        self.lock_fd: int | None = None
        self.node_token = secrets.token_hex(32)  # given to engines at spawn, never to clients
        # Started in run() before the engines, stopped by startup.run() after them.
        self.mps = Mps(cfg.mps, cfg.socket_dir, planner.name, planner.proto_kind)
        # Cluster mode: node 0 serves the Cluster service, the other nodes hold a lease there.
        self.incarnation = new_incarnation()
        self.cluster_hub: ClusterHub | None = None
        self.cluster_member: ClusterMember | None = None
        self.cluster_token = ""
        self.cluster_tls: ClusterTls | None = None  # mutual TLS on the Cluster port, if set
        # A world over all nodes (cluster_world.py): the generation the engines run in (0: none;
        # in that mode they start only in a world).
        self.world_generation = 0
        self.world_left = 0  # the last generation this node left: never entered again

    def world_size(self, world: int) -> int:
        """How many engines form world `world` (engine_slots.py)."""
        return sum(e.slot.world == world for e in self.engines)

    @property
    def world_mode(self) -> bool:
        return self.planner.world_spans_nodes  # (only in cluster mode)

    @property
    def cluster(self) -> ClusterHub | ClusterMember | None:
        return self.cluster_hub or self.cluster_member

    def check_cluster(self) -> None:
        """Cluster settings the daemon cannot start with: one line naming the setting."""
        cfg = self.cfg
        if not cfg.cluster_mode:
            return
        if not self.planner.cluster_capable:
            raise StartupError(f"--num-nodes {cfg.num_nodes}: the {self.backend} backend forms "
                               f"groups spanning nodes only with the experimental "
                               f"--cuda-cluster (docs/DESIGN_NOTES.md); use --num-nodes 1")
        try:
            self.cluster_token = read_cluster_token(cfg.cluster_token_file)
            self.cluster_tls = ClusterTls.of(cfg)
        except ValueError as e:
            setting, _, rest = str(e).partition(" ")
            raise StartupError(f"--{setting.replace('_', '-')} {rest}") from None

    def ready(self) -> tuple[bool, str]:
        not_ready = [e.index for e in self.engines if not e.ready]
        if self.stopping:
            return False, "draining"
        if not_ready:
            why = "; ".join(self._start_failure(e) for e in self.engines
                            if not e.ready and e.failed_starts)
            return False, f"engines not ready: {not_ready}" + (f" ({why})" if why else "")
        return True, f"ready: {len(self.engines)} engine(s), backend {self.backend}"

    def _spawn(self, e: EngineProc) -> None:
        from . import metrics
        # Down until it serves (_watch sets 1): an engine stuck in its first start has a series
        # of 0 for EpdEngineDown to see, not none until --engine-start-timeout-seconds.
        metrics.ENGINE_UP.labels(str(e.index)).set(0)
        env = dict(os.environ)
        env.update(self.cfg.to_env())
        env["EPD_BACKEND"] = self.backend
        # Never NVLink multicast: it can take a shared host's GPUs out of service.
        env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        for key, value in self.planner.engine_env(e.slot.world).items():
            env.setdefault(key, value)
        env.update(self.mps.env())  # the MPS server in use (the engine reports it to clients)
        if e.slot.service_class == THROUGHPUT and self.cfg.throughput_mps_percentage:
            # (a class engine's own share of the SMs; only MPS clients read it)
            env[MPS_PERCENTAGE_ENV] = str(self.cfg.throughput_mps_percentage)
        env[NODE_TOKEN_ENV] = self.node_token
        env["EPD_SUPERVISOR_PID"] = str(os.getpid())  # the engine checks its parent (app.py)
        # The engines inherit the daemon's lock: a second daemon on this socket folder cannot
        # start before the last engine of this one has exited.
        keep = (self.lock_fd,) if self.lock_fd is not None else ()
        e.proc = subprocess.Popen([sys.executable, "-m", "epd.server.engine.app",
                                   "--index", str(e.index), "--device", str(e.slot.device),
                                   "--service-class", e.slot.service_class or "any",
                                   "--tenant-pool", e.slot.tenant_pool],
                                  env=env, pass_fds=keep)
        e.ready, e.unresponsive, e.killed_at = False, False, None
        e.started_at = time.monotonic()
        log.info("%s started (pid %d)", e.slot.describe(), e.proc.pid)

    @staticmethod
    def _start_failure(e: EngineProc) -> str:
        nxt = (f"; next start in {max(e.restart_at - time.monotonic(), 0.0):.1f} s"
               if e.restart_at is not None else "")
        return (f"engine {e.index} failed to start {e.failed_starts} time(s) in a row, "
                f"last: {e.last_failure}{nxt}")

    def _note_exit(self, e: EngineProc, code: int) -> None:
        """Why engine `e` exited: its own words where it could not start (the failure file it
        leaves, engine/app.py), else its exit status; a start that never came up counts."""
        from . import metrics
        if e.ready or e.unresponsive:  # (it had served: not a failed start)
            e.failed_starts = 0
        else:  # it never came up: a start that failed, counted for the backoff
            e.failed_starts += 1
        path = self.cfg.engine_failure_file(e.socket_path)
        try:
            with open(path) as f:
                e.last_failure = f.read(4096).strip() or f"exit status {code}"
            os.unlink(path)
        except OSError:
            e.last_failure = f"exit status {code}"
        metrics.ENGINE_START_FAILURES.labels(str(e.index)).set(e.failed_starts)

    def _exited(self, e: EngineProc, code: int) -> None:
        """Engine `e` exited (not asked to): note why, forget it, and schedule its restart
        (with every engine's, where the backend's world must be rebuilt)."""
        self._note_exit(e, code)
        delay = e.backoff(self.cfg.restart_backoff_seconds,
                          self.cfg.restart_backoff_max_seconds)
        if e.failed_starts:
            log.error("engine %d (pid %d) could not start (%d time(s) in a row): %s; "
                      "next start in %.1f s", e.index, e.proc.pid, e.failed_starts,
                      e.last_failure, delay)
        else:
            log.error("engine %d (pid %d) exited with code %s; restarting in %.1f s",
                      e.index, e.proc.pid, code, delay)
        # A backend whose engines form one world that cannot take a new member (cuda:
        # NVSHMEM) rebuilds the whole world: every engine of it restarts.
        lost = self._world_of(e) if self.planner.restart_all_on_engine_loss else [e]
        for x in lost:
            self._engine_gone(x)
            x.restart_at = time.monotonic() + delay

    def _restart(self, e: EngineProc) -> None:
        """Start engine `e` again (with its world, where the backend rebuilds it). A restart
        counts only once its process runs; one that cannot spawn (fork's EAGAIN or ENOMEM, a
        world that cannot be made) is a failed start, tried again after its backoff."""
        from . import metrics
        lost = ([x for x in self._world_of(e) if x.restart_at is not None]
                if self.planner.restart_all_on_engine_loss else [e])
        started: list[EngineProc] = []
        trying = e
        try:
            if self.planner.restart_all_on_engine_loss:
                self.planner.new_world(e.slot.world)
            for trying in lost:
                self._spawn(trying)
                started.append(trying)
        except Exception as err:
            self._restart_failed(trying, err, lost, started)
            return
        for x in lost:
            x.restart_at = None
            x.restarts += 1
            metrics.ENGINE_RESTARTS.labels(str(x.index)).inc()

    def _restart_failed(self, e: EngineProc, err: Exception, lost: list[EngineProc],
                        started: list[EngineProc]) -> None:
        """Engine `e` could not be started again: a failed start (its reason kept, its backoff
        longer); the engines of its world started meanwhile are stopped again, and all of them
        are tried again together after the backoff."""
        from . import metrics
        e.failed_starts += 1
        e.last_failure = f"cannot start its process: {type(err).__name__}: {err}"
        metrics.ENGINE_START_FAILURES.labels(str(e.index)).set(e.failed_starts)
        delay = e.backoff(self.cfg.restart_backoff_seconds, self.cfg.restart_backoff_max_seconds)
        log.error("engine %d could not be started again (%s); next start in %.1f s", e.index,
                  e.last_failure, delay, exc_info=err)
        for x in started:
            self._engine_gone(x)
        for x in lost:
            x.restart_at = time.monotonic() + delay

    def _world_of(self, e: EngineProc) -> list[EngineProc]:
        """The engines of e's world (engine_slots.py): those that go down and restart with it
        where the backend's world cannot take a replacement."""
        return [x for x in self.engines if x.slot.world == e.slot.world]

    async def _probe(self, e: EngineProc, timeout: float = 1.0) -> bool:
        try:
            async with grpc.aio.insecure_channel(f"unix://{e.socket_path}") as ch:
                resp = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            return False

    async def _probe_periodic(self, e: EngineProc) -> bool | None:
        """The health check of an engine that served once: at most every check period (each
        probe it does not answer costs the monitor its timeout); None: not due yet."""
        now = time.monotonic()
        if now < e.next_check_at:
            return None
        period = min(HEALTH_CHECK_SECONDS, self.cfg.engine_unresponsive_seconds / 3)
        e.next_check_at = now + period
        return await self._probe(e, timeout=min(HEALTH_CHECK_TIMEOUT_SECONDS, period))

    async def _probe_due(self, e: EngineProc) -> bool:
        """A not-ready engine's probe: every look while it starts; one that stopped answering
        only every check period."""
        if not e.unresponsive:
            return await self._probe(e)
        return bool(await self._probe_periodic(e))

    async def _check_ready(self, e: EngineProc) -> None:
        """A ready engine's health, checked every HEALTH_CHECK_SECONDS: one that stopped
        answering (its event loop wedged, the process stopped) is marked not ready after
        --engine-unresponsive-seconds, then answering again makes it ready (_watch)."""
        from . import metrics
        now = time.monotonic()
        answered = await self._probe_periodic(e)
        if answered is None:
            return
        if answered:
            e.answered_at, e.missed = time.monotonic(), 0
            return
        e.missed += 1  # (two in a row at least: one slow answer is no verdict)
        if e.missed >= 2 and now - e.answered_at >= self.cfg.engine_unresponsive_seconds:
            e.ready, e.unresponsive = False, True
            metrics.ENGINE_UP.labels(str(e.index)).set(0)
            log.error("engine %d (pid %d) has not answered its health check for %.0f s: not "
                      "ready until it answers%s", e.index, e.proc.pid, now - e.answered_at,
                      f" (killed after {self.cfg.engine_hung_seconds:g} s)"
                      if self.cfg.engine_hung_seconds else "")

    async def _monitor(self) -> None:
        while not self.stopping:
            for e in self.engines:
                if e.proc is None:
                    continue
                try:
                    await self._watch(e)
                except Exception as err:  # (a bug): logged, the others still watched
                    self._watch_failed(e, err)
            await asyncio.sleep(0.1)

    def _watch_failed(self, e: EngineProc, err: Exception) -> None:
        """A look at engine `e` raised (a bug: a restart that cannot spawn is _restart's):
        logged, at most every WATCH_ERROR_LOG_SECONDS."""
        now = time.monotonic()
        if now - e.watch_error_logged >= WATCH_ERROR_LOG_SECONDS:
            e.watch_error_logged = now
            log.exception("supervising engine %d failed; watching it again", e.index)

    async def _watch(self, e: EngineProc) -> None:
        """One look of the monitor at one engine: its exit, its restart, its readiness."""
        from . import metrics
        code = e.proc.poll()
        if code is not None and not self.stopping and self.world_mode:
            # Its world is lost for every node: stop the others, report generation 0,
            # and start again in the next world node 0 forms.
            if self.world_generation:
                self._note_exit(e, code)
                self.leave_world(f"engine {e.index} (pid {e.proc.pid}) exited with "
                                 f"code {code}: {e.last_failure}")
            return
        if code is not None and not self.stopping:
            # Restarts wait without blocking this loop (the other engines are still
            # watched); a failing start waits longer each time (EngineProc.backoff).
            if e.restart_at is None:
                self._exited(e, code)
            elif time.monotonic() >= e.restart_at:
                self._restart(e)
        elif e.ready and code is None:
            await self._check_ready(e)
        elif not e.ready and await self._probe_due(e):
            e.ready = True
            e.failed_starts = 0
            e.answered_at, e.missed = time.monotonic(), 0
            metrics.ENGINE_UP.labels(str(e.index)).set(1)
            metrics.ENGINE_START_FAILURES.labels(str(e.index)).set(0)
            log.info("engine %d %s on %s", e.index,
                     "answers again: ready" if e.unresponsive else "ready", e.socket_path)
            e.unresponsive = False
        elif (e.unresponsive and code is None and self.cfg.engine_hung_seconds > 0
              and time.monotonic() - e.answered_at > self.cfg.engine_hung_seconds
              and (e.killed_at is None or time.monotonic() - e.killed_at > KILL_AGAIN_SECONDS)):
            # (a process stuck in the driver may outlive SIGKILL a while: not every look)
            if e.killed_at is None:
                self._kill(e, f"not answering its health check for "
                              f"{self.cfg.engine_hung_seconds:g} s (--engine-hung-seconds)")
            else:
                e.proc.kill()
            e.killed_at = time.monotonic()
        elif (not e.ready and not e.unresponsive and code is None
              and self.cfg.engine_start_timeout_seconds > 0
              and time.monotonic() - e.started_at > self.cfg.engine_start_timeout_seconds):
            # Stuck in its set-up: killed; the next look sees the exit, counted as a failed
            # start with this reason (the failure file the engine did not get to write).
            self._kill(e, f"not serving {self.cfg.engine_start_timeout_seconds:g} s after its "
                          f"start (--engine-start-timeout-seconds)")

    def _kill(self, e: EngineProc, why: str) -> None:
        """Kill engine `e` for `why`, logged and left in its failure file (its exit reads it)."""
        why += ": killed"
        log.error("engine %d (pid %d) %s", e.index, e.proc.pid, why)
        with (contextlib.suppress(OSError),
              open(self.cfg.engine_failure_file(e.socket_path), "w") as f):
            f.write(why)
        e.proc.kill()

    def _engine_gone(self, x: EngineProc) -> None:
        """An engine is down (exited, or killed with its world): stop it if it still runs,
        and forget it everywhere (metrics, groups, the cluster, its files and sockets)."""
        from prometheus_client import multiprocess

        from . import metrics
        from .engine.state import sweep_engine_files
        if x.proc is None:
            return
        if x.proc.poll() is None:
            x.proc.kill()
            _wait_killed(x, KILLED_EXIT_ON_LOOP_SECONDS)  # (bounded: this is the event loop)
        multiprocess.mark_process_dead(x.proc.pid)
        try:  # (a metrics file it left unreadable must not stop its restart)
            metrics.archive_dead_process(x.proc.pid)
        except Exception:
            log.exception("folding engine %d's metrics into the archive failed", x.index)
        metrics.ENGINE_UP.labels(str(x.index)).set(0)
        x.ready = False
        self.coordinator.engine_lost(x.index, self.cfg.node_rank)
        if self.cluster_member is not None:
            self.cluster_member.engine_lost(x.index)
        sweep_engine_files(self.cfg.shm_dir, x.index)
        _remove_engine_sockets(x.socket_path)

    def _remove_engine_files(self, e: EngineProc) -> None:
        """What a stopped engine may leave in the socket folder: its sockets (it crashed, was
        killed, or failed while stopping) and its failure file (it could not start)."""
        _remove_engine_sockets(e.socket_path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.cfg.engine_failure_file(e.socket_path))

    def enter_world(self, world: epd_pb2.ClusterWorld) -> None:
        """Start every engine in `world` (after leaving an older one)."""
        if self.world_generation:
            self.leave_world(f"world {world.generation} replaces it")
        self.planner.adopt_world(world)
        self.world_generation = world.generation
        log.info("cluster world %d: %d PE(s), this node's engines are PEs %d..%d",
                 world.generation, world.num_pes, world.node_first_pe[self.cfg.node_rank],
                 world.node_first_pe[self.cfg.node_rank] + len(self.engines) - 1)
        try:
            for e in self.engines:
                self._spawn(e)
        except Exception as err:  # fork's EAGAIN or ENOMEM: a PE of the world cannot start,
            # so the world is lost (as when one dies) and this node never enters it again
            log.error("cluster world %d: engine %d cannot start (%s: %s)", world.generation,
                      e.index, type(err).__name__, err)
            e.last_failure = f"cannot start its process: {type(err).__name__}: {err}"
            self.leave_world(f"engine {e.index} of node {self.cfg.node_rank} cannot start")

    def leave_world(self, why: str) -> None:
        """The world is lost: every engine of this node stops (a PE cannot be replaced)."""
        log.warning("cluster world %d lost (%s): stopping this node's engines",
                    self.world_generation, why)
        self.planner.leave_world()
        self.world_left = max(self.world_left, self.world_generation)
        self.world_generation = 0
        for e in self.engines:  # (all killed first: each one's bounded wait then overlaps)
            if e.proc is not None and e.proc.poll() is None:
                e.proc.kill()
        for e in self.engines:
            self._engine_gone(e)
            e.proc = None
        if self.cluster_hub is not None:
            self.cluster_hub.tend_world()

    def bind_http(self) -> None:
        """Listen on the metrics address (before anything else starts: a port in use is a
        one-line start-up error)."""
        from . import http

        cfg = self.cfg
        try:
            self._http = http.start(cfg.metrics_host, cfg.metrics_port, self.ready)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise StartupError(
                    f"--metrics-port {cfg.metrics_port}: {cfg.metrics_host}:{cfg.metrics_port} "
                    f"is already in use; pick a free port (or 0 for any free port)") from None
            raise StartupError(
                f"--metrics-host {cfg.metrics_host} / --metrics-port {cfg.metrics_port}: cannot "
                f"listen there ({e.strerror or e}); fix the address or port") from None
        self.metrics_url = http.url(self._http)  # (an IPv6 host in brackets)

    def request_stop(self) -> None:
        """A graceful stop (what SIGTERM, SIGINT and SIGHUP do): drain, then exit."""
        if self._stop is not None:
            self._stop.set()

    async def run(self) -> int:
        from . import metrics

        if self._http is None:
            self.bind_http()
        metrics.BUILD_INFO.labels(__version__, self.backend).set(1)

        # Signals first: a SIGTERM from here on drains (and so stops a private MPS server).
        self._stop = stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
        if self.early_stop is not None and self.early_stop.signum is not None:
            log.info("signal %d before the daemon started: stopping",
                     self.early_stop.signum)  # (startup.run() noted it before the loop)
            stop.set()
        servers = _Servers()
        try:
            await self._start(stop, servers)
            await stop.wait()
        finally:
            # Every exit, a failed start's too: stop the engines already started and remove
            # what this daemon made (node.sock; startup.run() the lock and metrics).
            await self._shutdown(servers)
        log.info("stopped")
        return 0

    async def _start(self, stop: asyncio.Event, servers: _Servers) -> None:
        """MPS, the cluster, node.sock, then the engines (unless asked to stop meanwhile)."""
        cfg = self.cfg
        try:
            await asyncio.to_thread(self.mps.start)
        except MpsError as e:
            raise StartupError(str(e)) from None

        # a bad cluster address fails here
        servers.cluster, servers.member_task = await self._start_cluster()
        server = servers.node = grpc.aio.server()
        epd_pb2_grpc.add_NodeServicer_to_server(NodeService(self), server)
        servers.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servers.health, server)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(cfg.node_socket)
        server.add_insecure_port(f"unix://{cfg.node_socket}")
        await server.start()
        os.chmod(cfg.node_socket, 0o660)
        await servers.health.set("", health_pb2.HealthCheckResponse.SERVING)

        log.info("EPD %s: backend %s, %d engine(s), sockets in %s, metrics at %s, MPS %s",
                 __version__, self.backend, len(self.engines), cfg.socket_dir, self.metrics_url,
                 self.mps.mode)
        if self.class_engines_why:
            log.info("class engines %s (%s)", cfg.class_engines, self.class_engines_why)
        check_open_files_limit(cfg)
        for pool in cfg.tenants:
            log.info("tenant pool %s (uids %s, gids %s): engines %s", pool.name,
                     sorted(pool.uids) or "-", sorted(pool.gids) or "-",
                     [e.index for e in self.engines if e.slot.tenant_pool == pool.name])
        cuda = self.planner.proto_kind == epd_pb2.CUDA
        if cfg.class_engines_on and cuda and self.mps.mode == "off":
            log.warning("--class-engines without MPS: the two engines of a GPU time-slice it "
                        "instead of running side by side (--mps on)%s",
                        "; --throughput-mps-percentage has no effect"
                        if cfg.throughput_mps_percentage else "")
        # Files an earlier daemon on this folder left when it was killed (this one holds the
        # lock: they are nobody's): a stale gpu<N>.failed would stay until this daemon's stop
        # and be read as the reason of its engine's first exit. (Sockets are unlinked by
        # whoever binds them.)
        for e in self.engines:
            self._remove_engine_files(e)
        if not stop.is_set() and not self.world_mode:  # (not asked to stop while MPS started)
            starting = None
            try:
                for world in sorted({e.slot.world for e in self.engines}):
                    self.planner.new_world(world)
                for starting in self.engines:
                    self._spawn(starting)
            except Exception as err:  # fork's EAGAIN or ENOMEM, a world that cannot be made
                what = (f"cannot start engine {starting.index}'s process"
                        if starting is not None else "cannot set up the engines' world")
                raise StartupError(f"{what} ({type(err).__name__}: {err}); the daemon stopped "
                                   f"the engines it had started") from None
        elif self.cluster_hub is not None:  # engines start in the first world over all nodes
            self.cluster_hub.tend_world()
        servers.monitor = asyncio.create_task(self._monitor())

    async def _shutdown(self, servers: _Servers) -> None:
        """The drain: no new sessions, the engines stopped, the servers closed, node.sock
        removed. Runs on every exit of run(), whatever of it had started."""
        if servers.node is not None:  # (a start-up error before it is one line on stderr)
            log.info("draining: no new sessions; running collectives get %.0f s",
                     self.cfg.drain_seconds)
        self.stopping = True
        self.coordinator.stop_forming("the daemon is shutting down (draining)")
        if servers.health is not None:
            await servers.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        if servers.monitor is not None:
            servers.monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await servers.monitor
        await self.stop_engines()
        if servers.member_task is not None:
            await _cancel_and_wait(servers.member_task, "the lease with node 0")
        if servers.cluster is not None:
            await servers.cluster.stop(grace=0.5)
        if self.cluster is not None:
            self.cluster.close()
        self.coordinator.close()
        if servers.node is not None:
            await servers.node.stop(grace=0.5)
        with contextlib.suppress(FileNotFoundError):  # (ours or stale: this daemon holds the lock)
            os.unlink(self.cfg.node_socket)
        self._http.shutdown()

    async def stop_engines(self) -> None:
        """SIGTERM every engine; one still running after --drain-seconds (and a margin) is
        killed, and one that does not exit even then (stuck in the kernel) is logged with its
        pid and left. Every engine's sockets and failure file are removed."""
        live = [e for e in self.engines if e.proc is not None and e.proc.poll() is None]
        for e in live:
            e.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.drain_seconds + DRAIN_EXTRA_SECONDS
        while any(e.proc.poll() is None for e in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stuck = [e for e in live if e.proc.poll() is None]
        for e in stuck:
            log.warning("engine %d did not stop in time; killing it", e.index)
            e.proc.kill()
        deadline = time.monotonic() + KILLED_EXIT_SECONDS
        while any(e.proc.poll() is None for e in stuck) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for e in stuck:
            if e.proc.poll() is None:
                _log_not_exited(e, KILLED_EXIT_SECONDS)
        for e in self.engines:
            if e.proc is None:
                continue
            if e.proc.poll():  # (a clean stop removes its own sockets; this one did not)
                log.warning("engine %d exited with code %s while stopping", e.index,
                            e.proc.returncode)
            self._remove_engine_files(e)

    async def _start_cluster(self) -> tuple[grpc.aio.Server | None, asyncio.Task | None]:
        """Node 0: the Cluster service on TCP (token-checked); other nodes: the lease task."""
        cfg = self.cfg
        if not cfg.cluster_mode:
            return None, None
        if cfg.node_rank != 0:
            self.cluster_member = ClusterMember(self, self.cluster_token)
            return None, asyncio.create_task(self.cluster_member.run())
        self.cluster_hub = ClusterHub(self, self.cluster_token)
        server = grpc.aio.server()
        epd_pb2_grpc.add_ClusterServicer_to_server(self.cluster_hub, server)
        tls = self.cluster_tls
        try:
            port = (server.add_secure_port(cfg.cluster_address, tls.server_credentials())
                    if tls is not None else server.add_insecure_port(cfg.cluster_address))
        except RuntimeError:
            port = 0
        if not port:
            raise StartupError(f"--cluster-address {cfg.cluster_address}: cannot listen there "
                               f"(in use, or not an address of this host); fix it on every "
                               f"node")
        await server.start()
        log.info("cluster: node 0 of %d, Cluster service on %s (%s)", cfg.num_nodes,
                 cfg.cluster_address, "mutual TLS" if tls is not None else "token only")
        return server, None

    def stop_leftover_engines(self) -> None:
        """After run(), whichever way it ended: engines still running get SIGTERM, then SIGKILL
        after a deadline (they must be gone before a private MPS server is quit); one that does
        not exit even then is logged with its pid and left. Their files are removed."""
        live = [e for e in self.engines if e.proc is not None and e.proc.poll() is None]
        for e in live:
            e.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + LEFTOVER_ENGINE_SECONDS
        killed = []
        for e in live:
            try:
                e.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                e.proc.kill()
                killed.append(e)
        deadline = time.monotonic() + KILLED_EXIT_SECONDS
        for e in killed:
            _wait_killed(e, max(0.0, deadline - time.monotonic()))
        for e in self.engines:
            if e.proc is not None:
                self._remove_engine_files(e)


@dataclass
class _Servers:
    """What Supervisor.run started, for its shutdown (None: not started)."""
    node: grpc.aio.Server | None = None
    health: health.aio.HealthServicer | None = None
    cluster: grpc.aio.Server | None = None
    member_task: asyncio.Task | None = None
    monitor: asyncio.Task | None = None


async def _cancel_and_wait(task: asyncio.Task, what: str) -> None:
    """Cancel `task` and wait for it to end, cancelling again every second: a library may
    swallow one cancellation (grpc.aio's stream set-up does), and a stop must not hang on it."""
    for _ in range(CANCEL_TRIES):
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=1.0)
        if done:
            if not task.cancelled() and task.exception() is not None:
                log.warning("%s ended with %r", what, task.exception())
            return
    log.error("%s did not stop after %d cancellations; the daemon stops without it", what,
              CANCEL_TRIES)


def _log_not_exited(e: EngineProc, seconds: float) -> None:
    log.error("engine %d (pid %d) has not exited %.1f s after SIGKILL (stuck in the kernel, "
              "in a driver call?); going on without it", e.index, e.proc.pid, seconds)


def _wait_killed(e: EngineProc, seconds: float) -> bool:
    """Wait at most `seconds` for engine `e`, just SIGKILLed, to exit; False (logged with its
    pid) if it has not."""
    try:
        e.proc.wait(seconds)
        return True
    except subprocess.TimeoutExpired:
        _log_not_exited(e, seconds)
        return False


def _remove_engine_sockets(grpc_socket: str) -> None:
    """An engine's gRPC socket and its descriptor channel beside it, if it left them (it
    crashed, was killed, or failed while stopping)."""
    for path in (grpc_socket, fd_channel.socket_path_for(grpc_socket)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

