"""Entry point of one engine process: `python -m epd.server.engine.app --index N`.

The supervisor starts it with the configuration in EPD_* environment variables. The engine owns
its device (one CUDA context / NVSHMEM PE on the cuda backend) and serves the Engine service and
gRPC health checking on <socket-dir>/gpu<D>.sock (a latency class engine: gpu<D>.latency.sock,
proto/engine_sockets.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import faulthandler
import logging
import os
import platform
import signal
import sys
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ...proto import fd_channel, host_order
from ...proto.thread_names import name_this_thread
from .. import config as config_mod
from .. import metrics
from ..backends import make_backend
from ..engine_slots import EngineSlot
from ..exit_deadline import exit_within
from ..service_classes import CLASS_NAMES
from . import gc_pauses
from .core import Engine
from .fd_server import FdServer
from .service import EngineService, add_to_server

log = logging.getLogger("epd.engine")
SERVICE_NAME = "epd.v1.Engine"
# A request is parsed before its session's token is checked, so its size is what anyone in the
# socket group can make the engine hold: every request EPD sends is small (a release list of
# the most ids an engine takes, 65,536, is under 1 MiB), and a review's 32 senders of 25 MB
# requests grew an engine to 7.6 GiB and slowed other tenants' calls to seconds. Answers
# (GetStats of many groups) may be larger.
MAX_REQUEST_BYTES = 4 << 20
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                ("grpc.so_reuseport", 0)]
STOP_GRACE_SECONDS = 1.0  # after the drain: what gRPC calls still open get before they end
# After serve() ends: the longest the process's own exit may take (joining its threads) before
# it is cut short with os._exit (a thread stuck in an operation would hold it forever).
EXIT_SECONDS = 10.0
# (SIGHUP not where the engine's supervisor was started ignoring it: nohup; inherited)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT) + (
    () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,))


STARTUP_FAILED = 3  # exit status of an engine that could not start (reason: failure file)
FAILURE_TEXT_BYTES = 2000  # what of the reason the supervisor gets (its log has the rest)


def report_startup_failure(cfg: config_mod.Config, slot: EngineSlot,
                           error: BaseException) -> None:
    """Leave the reason an engine could not start where its supervisor reads it (readiness,
    `epd topology`), then exit with STARTUP_FAILED; the traceback goes to the log."""
    log.exception("engine %d could not start", slot.index)
    text = f"{type(error).__name__}: {error}"[:FAILURE_TEXT_BYTES]
    failure = cfg.engine_failure_file(cfg.engine_socket(slot.device, slot.service_class,
                                                        slot.tenant_pool))
    with contextlib.suppress(OSError), open(failure, "w") as f:
        f.write(text)
    raise SystemExit(STARTUP_FAILED)


def keepalive_options(seconds: float) -> list[tuple[str, int]]:
    """gRPC server options that end the connection of a client that stops answering pings:
    its session's stream (the lease) ends with it, so a stopped or frozen client process
    releases its ranks within about 2 x `seconds` (gRPC's default server keepalive is 2 hours,
    and stops pinging after two pings without data)."""
    if seconds <= 0:
        return []
    ms = max(int(seconds * 1000), 1)
    return [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # (this grpc times a keepalive ping's ack with the ping timeout, 60 s by default,
            # not with keepalive_timeout_ms: seen with grpcio 1.85)
            ("grpc.http2.ping_timeout_ms", ms)]


def _init_backend(cfg: config_mod.Config, index: int, device: int) -> Any:
    """The backend, made on a thread named epd-init: the threads its libraries start meanwhile
    (NVSHMEM's, CUDA's) inherit that name, so a CPU breakdown by thread tells them from the
    engine's own."""
    name_this_thread("epd-init")
    return make_backend(cfg, index, device)


async def serve(cfg: config_mod.Config, slot: EngineSlot) -> None:
    # The CUDA backend joins the node's NVSHMEM world here, which blocks until every engine
    # arrives: keep it off the event loop.
    metrics.set_group_label_cap(cfg.max_group_label_values)
    index = slot.index
    try:
        backend = await asyncio.to_thread(_init_backend, cfg, index, slot.device)
    except Exception as e:  # a missing toolchain, a device that will not open, ...
        report_startup_failure(cfg, slot, e)
    engine = Engine(cfg, index, backend, slot)
    server = grpc.aio.server(options=GRPC_OPTIONS + keepalive_options(
        cfg.session_keepalive_seconds))
    add_to_server(EngineService(engine), server)  # malformed bytes: INVALID_ARGUMENT
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    path = engine.socket_path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    try:
        server.add_insecure_port(f"unix://{path}")
    except RuntimeError as e:  # (a path a unix socket cannot take, a folder gone: said where
        report_startup_failure(cfg, slot, e)  # the supervisor shows it, not only in the log)
    await server.start()
    os.chmod(path, 0o660)
    # The descriptor channel beside it (gpu<N>.fds, same permissions): memory by descriptor.
    fds = FdServer(engine, fd_channel.socket_path_for(path), asyncio.get_running_loop(),
                   cfg.max_sessions_per_uid)
    engine.on_session_closed = fds.drop_session
    fds.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    # (epd_engine_up is the supervisor's, which sees an engine that stopped answering)
    metrics.ENGINE_INFO.labels(str(index), str(slot.device), slot.service_class or "any").set(1)
    gc_pauses.install(cfg.gc_freeze)
    info = backend.device_info()
    log.info("engine %d serving on %s (backend %s, device %s, pid %d)", index, path,
             backend.name, info.get("name"), os.getpid())
    if host_order.FENCES:  # (a weakly ordered host, or EPD_HOST_FENCES=1)
        log.info("engine %d: host memory fences on the shared-memory protocols (%s)", index,
                 platform.machine())

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():  # (the collector's pauses go into their metric from here)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), gc_pauses.FLUSH_SECONDS)
        gc_pauses.flush()
    log.info("engine %d draining: no new sessions or calls; calls in flight get %.1f s",
             index, cfg.drain_seconds)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await engine.drain(cfg.drain_seconds)
    await server.stop(grace=STOP_GRACE_SECONDS)
    fds.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    log.info("engine %d stopped", index)


async def serve_then_exit(cfg: config_mod.Config, slot: EngineSlot) -> None:
    """serve(), then the bounded exit (exit_within) with the status the process means to end
    with: 0 after a stop, STARTUP_FAILED (or another SystemExit's), 1 after an error."""
    code = 1
    try:
        await serve(cfg, slot)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        raise
    finally:
        exit_within(EXIT_SECONDS, code, log)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_supervisor() -> None:
    """SIGTERM this engine when its supervisor dies (it then drains and exits like on a normal
    stop), and exit now if the supervisor is already gone (it died between fork and prctl: the
    signal would never come). EPD_SUPERVISOR_PID is set by the supervisor at spawn."""
    expected = os.environ.get("EPD_SUPERVISOR_PID")
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if expected and os.getppid() != int(expected):
        log.error("the supervisor (pid %s) is gone; exiting", expected)
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one EPD engine (started by `epd serve`)")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--device", type=int, help="the device it drives (default: --index)")
    parser.add_argument("--service-class", choices=("any", *CLASS_NAMES), default="any",
                        help="with class engines: the only class of groups it runs")
    parser.add_argument("--tenant-pool", default="",
                        help="with tenant pools: the only pool whose sessions it serves")
    ns = parser.parse_args(argv)
    slot = EngineSlot(ns.index, ns.index if ns.device is None else ns.device,
                      "" if ns.service_class == "any" else ns.service_class,
                      tenant_pool=ns.tenant_pool)
    cfg = config_mod.load()
    logging.basicConfig(level=cfg.log_level.upper(),
                        format=f"%(asctime)s engine{ns.index} %(levelname)s %(message)s")
    die_with_supervisor()
    name_this_thread(f"epd-engine{ns.index}")  # (the process's name in ps and top too)
    # `kill -USR1 <engine pid>` writes every thread's stack to the log: a call that hangs in a
    # driver call shows where, without stopping the engine.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Several threads serve calls (one fast-path thread per session, the stream-op poller, the
    # event loop): a thread that wakes for a call must not wait the default 5 ms for the GIL.
    sys.setswitchinterval(max(cfg.gil_switch_us, 1) * 1e-6)
    try:
        import uvloop  # optional: only its absence falls back, not an ImportError inside
    except ImportError:
        asyncio.run(serve_then_exit(cfg, slot))
    else:
        uvloop.run(serve_then_exit(cfg, slot))


if __name__ == "__main__":
    main()
