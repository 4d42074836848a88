"""`epd`: the command line.

    epd serve      run the daemon (supervisor + one engine per GPU, or --engines N on the CPU)
    epd demo       start a daemon, run client processes doing dispatch/combine, verify, report
    epd topology   ask a running daemon what it serves
"""

from __future__ import annotations

import argparse
import logging
import sys

from . import __version__
from . import config as config_mod

EPILOG = """\
Settings come from (later wins): defaults, a TOML file (--config), EPD_* environment variables,
flags. Example: EPD_SOCKET_DIR=/tmp/epd epd serve --backend cpu --engines 2 --metrics-port 9464
"""


def _serve(ns: argparse.Namespace) -> int:
    try:
        cfg = config_mod.load(ns)
    except (ValueError, OSError) as e:
        print(f"epd serve: configuration error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s supervisor %(levelname)s %(message)s")
    from .supervisor import run
    return run(cfg)


def _demo(ns: argparse.Namespace) -> int:
    from .demo import run_demo
    return run_demo(ns)


def _topology(ns: argparse.Namespace) -> int:
    import grpc

    from ..proto.v1 import epd_pb2, epd_pb2_grpc
    path = f"{ns.socket_dir}/node.sock"
    try:
        with grpc.insecure_channel(f"unix://{path}") as ch:
            t = epd_pb2_grpc.NodeStub(ch).GetTopology(epd_pb2.GetTopologyRequest(), timeout=5)
    except grpc.RpcError as e:
        print(f"epd topology: no daemon answers on {path}: {e.details()}", file=sys.stderr)
        return 1
    print(f"EPD {t.version} on {t.node_name}, metrics at {t.metrics_url}")
    for e in t.engines:
        print(f"  engine {e.index}: {e.socket_path} {epd_pb2.Backend.Name(e.backend).lower()} "
              f"{'ready' if e.ready else 'NOT READY'} pid={e.pid} restarts={e.restarts}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd", description="EPD: expert-parallel communication daemon for MoE models",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"epd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon", epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    config_mod.add_arguments(serve)
    serve.set_defaults(func=_serve)

    demo = sub.add_parser("demo", help="daemon + client processes doing real dispatch/combine")
    from .backends import BACKEND_NAMES  # the one list of backend names
    demo.add_argument("--backend", default="auto", choices=("auto", *BACKEND_NAMES))
    demo.add_argument("--ranks", type=int, default=4, help="client processes (EP ranks)")
    demo.add_argument("--engines", type=int, default=0,
                      help="engines (default: 2 on the cpu backend, one per GPU on cuda)")
    demo.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    demo.add_argument("--hidden", type=int, default=1024)
    demo.add_argument("--experts", type=int, default=32)
    demo.add_argument("--topk", type=int, default=4)
    demo.add_argument("--iters", type=int, default=5, help="timed dispatch/combine rounds")
    demo.add_argument("--metrics-port", type=int, default=0, help="0 picks a free port")
    demo.add_argument("--keep", action="store_true",
                      help="leave the daemon running afterwards (Ctrl-C to stop)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)

    topo = sub.add_parser("topology", help="show what a running daemon serves")
    topo.add_argument("--socket-dir", default="/run/epd")
    topo.set_defaults(func=_topology)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
