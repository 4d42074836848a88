"""`epd`: the command line.

    epd serve      run the daemon (supervisor + one engine per GPU, or --engines N on the CPU)
    epd demo       start a daemon, run client processes doing dispatch/combine, verify, report
    epd topology   ask a running daemon what it serves
    epd health     exit 0 if a running daemon is serving (a liveness probe)
    epd bench      end to end through the DeepEP facade, beside DeepEP and an NCCL pipeline
    epd env        the environment a client process needs to share the daemon's CUDA MPS server
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from . import __version__
from . import config as config_mod

if TYPE_CHECKING:
    import grpc

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
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # (stacks on demand, as engines)
    from .exit_deadline import exit_within
    from .startup import EXIT_SECONDS, log, run
    code = 1  # (an exception out of run(): a bug; the traceback follows)
    try:
        code = run(cfg)
        return code
    finally:  # (everything is removed by now: see startup.run)
        exit_within(EXIT_SECONDS, code, log)


def _demo(ns: argparse.Namespace) -> int:
    from .demo import run_demo
    return run_demo(ns)


def _ask_topology(socket_dir: str, command: str):
    """The running daemon's GetTopology answer, or None after a one-line error on stderr."""
    import grpc

    from ..proto.v1 import epd_pb2, epd_pb2_grpc
    path = f"{socket_dir}/node.sock"
    try:
        with grpc.insecure_channel(f"unix://{path}") as ch:
            return epd_pb2_grpc.NodeStub(ch).GetTopology(epd_pb2.GetTopologyRequest(),
                                                         timeout=5)
    except grpc.RpcError as e:
        print(f"epd {command}: no daemon answers on {path} ({_why_no_answer(path, e)}); start "
              f"one with `epd serve --socket-dir {socket_dir}`, or name its folder with "
              f"--socket-dir or EPD_SOCKET_DIR", file=sys.stderr)
        return None


def _why_no_answer(path: str, e: grpc.RpcError) -> str:
    """A failed call to node.sock in a few words (not gRPC's connection wording)."""
    if not os.path.exists(path):
        return "no such socket"
    return (e.details() or e.code().name).split("; last error:")[0]


def _health(ns: argparse.Namespace) -> int:
    """Exit 0 when the daemon's node.sock answers its gRPC health check SERVING, else 1 with
    the reason on stderr: a liveness probe (Kubernetes `exec`) that clients flooding the HTTP
    endpoint with slow connections cannot crowd out, as they could /healthz's few slots."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    path = f"{ns.socket_dir}/node.sock"
    try:
        with grpc.insecure_channel(f"unix://{path}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                        timeout=ns.timeout)
    except grpc.RpcError as e:
        print(f"epd health: no daemon answers on {path} ({_why_no_answer(path, e)})",
              file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"epd health: the daemon on {path} is {status}", file=sys.stderr)
        return 1
    print(status)
    return 0


def _mps_on(t) -> bool:
    return bool(t.mps_mode and t.mps_mode != "off" and t.mps_pipe_directory)


def _topology(ns: argparse.Namespace) -> int:
    from ..proto.v1 import epd_pb2
    t = _ask_topology(ns.socket_dir, "topology")
    if t is None:
        return 1
    print(f"EPD {t.version} on {t.node_name}, metrics at {t.metrics_url}")
    if _mps_on(t):
        print(f"  CUDA MPS: {t.mps_mode}, pipe folder {t.mps_pipe_directory} "
              f"(clients: eval \"$(epd env)\")")
    else:
        print(f"  CUDA MPS: {t.mps_mode or 'off'}")
    budgets = ", ".join(f"{c} {n or 'default'}" for c, n in (
        ("latency", t.latency_num_sms), ("throughput", t.throughput_num_sms)))
    print(f"  service classes: policy {t.service_class_policy or '(none: any class may be asked)'}"
          f"; SM budgets {budgets}; groups {t.latency_groups} latency, "
          f"{t.throughput_groups} throughput")
    for e in t.engines:
        off_mps = f" sessions-without-mps={e.sessions_without_mps}" if _mps_on(t) else ""
        runs = f" {e.service_class} groups only" if e.service_class else ""
        runs += f" tenant pool {e.tenant_pool} only" if e.tenant_pool else ""
        print(f"  engine {e.index}: {e.socket_path} {epd_pb2.Backend.Name(e.backend).lower()} "
              f"device {e.device}{runs} {'ready' if e.ready else 'NOT READY'} pid={e.pid} "
              f"restarts={e.restarts}{off_mps}")
        if e.failed_starts:
            print(f"    failed to start {e.failed_starts} time(s) in a row: {e.last_failure}")
        elif e.last_failure:
            print(f"    last exit: {e.last_failure}")
    if t.HasField("cluster") and t.cluster.num_nodes > 1:
        _print_cluster(t.cluster)
    return 0


def _print_cluster(c) -> None:
    reach = "reachable" if c.coordinator_reachable else "UNREACHABLE"
    port = "mutual TLS" if c.tls else "token only"
    print(f"  cluster: node {c.node_rank} of {c.num_nodes}; node 0's Cluster service at "
          f"{c.cluster_address} ({reach}, {port})")
    if c.world_generation:
        print(f"  world {c.world_generation}: one NVSHMEM world of {c.world_num_pes} PEs over "
              f"every node's engines")
    for n in c.nodes:
        health = "healthy" if n.healthy else "DOWN" if n.incarnation else "not registered"
        engines = ", ".join(f"{e.index}{'' if e.ready else ' (not ready)'}" for e in n.engines)
        seen = f" last heartbeat {n.last_seen_seconds:.1f} s ago" if n.node_rank else ""
        print(f"    node {n.node_rank}: {n.node_name or '?'} {health}, engines [{engines}]"
              f"{seen}")


def _env(ns: argparse.Namespace) -> int:
    """`eval "$(epd env)"`: export what a client needs to share the daemon's MPS server."""
    import os
    import shlex
    t = _ask_topology(ns.socket_dir, "env")
    if t is None:
        return 1
    # The folder the client's Session/Buffer finds the daemon in (client/session.py).
    folder = f"export EPD_SOCKET_DIR={shlex.quote(os.path.abspath(ns.socket_dir))}"
    if not _mps_on(t):
        print(f"# the EPD daemon on {ns.socket_dir} runs without CUDA MPS "
              f"(mps {t.mps_mode or 'off'})")
        print(folder)
        return 0
    # An MPS server serves one uid at a time: a client of another uid would be queued until
    # the engines' server ends, i.e. its CUDA would not start. Never export that.
    try:
        daemon_uid = os.stat(f"{ns.socket_dir}/node.sock").st_uid
    except OSError:
        daemon_uid = os.getuid()
    if daemon_uid != os.getuid():
        print(f"epd env: the daemon runs as uid {daemon_uid} and this process as uid "
              f"{os.getuid()}; an MPS server serves one uid at a time, so CUDA here would wait "
              f"for the engines' server to end: run the client as uid {daemon_uid}",
              file=sys.stderr)
        return 1
    print(f"# the EPD daemon on {ns.socket_dir} runs on CUDA MPS ({t.mps_mode}); set before "
          f"CUDA initialises in the client")
    print(folder)
    print(f"export CUDA_MPS_PIPE_DIRECTORY={shlex.quote(t.mps_pipe_directory)}")
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

    demo = sub.add_parser(
        "demo", help="daemon + client processes doing real dispatch/combine",
        description="Start a daemon and --ranks client processes that dispatch tokens, apply a "
                    "per-expert transform, combine, check every byte against the NumPy "
                    "reference and print latency per phase; the daemon stops afterwards.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from .backends import BACKEND_NAMES  # the one list of backend names
    demo.add_argument("--backend", default="auto", choices=("auto", *BACKEND_NAMES))
    demo.add_argument("--ranks", type=int, default=4, help="client processes (EP ranks)")
    demo.add_argument("--engines", type=int, default=0,
                      help="engines (0: 2 on the cpu backend, one per GPU on cuda)")
    demo.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    demo.add_argument("--hidden", type=int, default=1024, help="hidden size of a token (bf16)")
    demo.add_argument("--experts", type=int, default=32,
                      help="experts in all (a multiple of --ranks)")
    demo.add_argument("--topk", type=int, default=4, help="experts per token")
    demo.add_argument("--iters", type=int, default=5, help="timed dispatch/combine rounds")
    demo.add_argument("--metrics-port", type=int, default=0, help="0 picks a free port")
    demo.add_argument("--keep", action="store_true",
                      help="leave the daemon running afterwards (Ctrl-C to stop)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    demo.set_defaults(func=_demo)

    topo = sub.add_parser(
        "topology", help="show what a running daemon serves",
        description="Ask a running daemon (its node.sock in --socket-dir) for its engines, "
                    "devices, service classes and group counts, MPS, and its cluster.")
    topo.add_argument("--socket-dir", default=os.environ.get("EPD_SOCKET_DIR", "/run/epd"),
                      help="default: EPD_SOCKET_DIR, else /run/epd")
    topo.set_defaults(func=_topology)

    check = sub.add_parser(
        "health", help="exit 0 if a running daemon is serving (a liveness probe)",
        description="Ask a running daemon's node.sock for its gRPC health (exit 0: SERVING; "
                    "1: not serving, or no daemon answers). A Kubernetes exec liveness probe: "
                    "unlike /healthz, no client can crowd it out with slow HTTP connections.")
    check.add_argument("--socket-dir", default=os.environ.get("EPD_SOCKET_DIR", "/run/epd"),
                       help="default: EPD_SOCKET_DIR, else /run/epd")
    check.add_argument("--timeout", type=float, default=3.0,
                       help="seconds to wait for the answer (default 3)")
    check.set_defaults(func=_health)

    env = sub.add_parser("env", help="print the exports a client needs to use the daemon and "
                         "share its CUDA MPS server: eval \"$(epd env)\"",
                         description="Print the shell exports (EPD_SOCKET_DIR; the MPS pipe "
                                     "folder where the daemon runs on MPS) a client process "
                                     "needs to use a running daemon and share its CUDA MPS "
                                     "server: eval \"$(epd env)\".")
    env.add_argument("--socket-dir", default=os.environ.get("EPD_SOCKET_DIR", "/run/epd"),
                     help="default: EPD_SOCKET_DIR, else /run/epd")
    env.set_defaults(func=_env)

    from .bench import add_parser as add_bench_parser
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
