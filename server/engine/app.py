"""Entry point of one engine process: `python -m epd.server.engine.app --index N`.

The supervisor starts it with the configuration in EPD_* environment variables. The engine owns
its device (one CUDA context / NVSHMEM PE on the cuda backend) and serves the Engine service and
gRPC health checking on <socket-dir>/gpu<N>.sock.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ...proto.v1 import epd_pb2_grpc
from .. import config as config_mod
from .. import metrics
from ..backends import make_backend
from .core import Engine
from .service import EngineService

log = logging.getLogger("epd.engine")
SERVICE_NAME = "epd.v1.Engine"
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.so_reuseport", 0)]
STOP_GRACE_SECONDS = 1.0  # after the drain: what gRPC calls still open get before they end


async def serve(cfg: config_mod.Config, index: int) -> None:
    # The CUDA backend joins the node's NVSHMEM world here, which blocks until every engine
    # arrives: keep it off the event loop.
    backend = await asyncio.to_thread(make_backend, cfg, index)
    engine = Engine(cfg, index, backend)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    epd_pb2_grpc.add_EngineServicer_to_server(EngineService(engine), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    path = cfg.engine_socket(index)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    os.chmod(path, 0o660)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    metrics.ENGINE_UP.labels(str(index)).set(1)
    info = backend.device_info()
    log.info("engine %d serving on %s (backend %s, device %s, pid %d)", index, path,
             backend.name, info.get("name"), os.getpid())

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("engine %d draining: no new sessions or calls; calls in flight get %.1f s",
             index, cfg.drain_seconds)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await engine.drain(cfg.drain_seconds)
    await server.stop(grace=STOP_GRACE_SECONDS)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    log.info("engine %d stopped", index)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one EPD engine (started by `epd serve`)")
    parser.add_argument("--index", type=int, required=True)
    ns = parser.parse_args(argv)
    cfg = config_mod.load()
    logging.basicConfig(level=cfg.log_level.upper(),
                        format=f"%(asctime)s engine{ns.index} %(levelname)s %(message)s")
    try:
        import uvloop
        uvloop.run(serve(cfg, ns.index))
    except ImportError:
        asyncio.run(serve(cfg, ns.index))


if __name__ == "__main__":
    main()
