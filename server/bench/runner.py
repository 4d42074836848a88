"""`epd bench`'s parent process: decide what runs (and print why anything is skipped), start a
daemon unless one is given, spawn one process per rank, wait for them with deadlines, fold and
report the figures. On any failure it ends every rank it started and its daemon, then exits
non-zero with one line; nothing is left in /tmp, /dev/shm or the process table."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.util
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ...proto.v1 import epd_pb2
from .. import __version__
from . import report, workers
from .workers import DEEP_EP, EPD, PIPELINE, RankPlan, rank_main

DEVICE_OF_BACKEND = {"cpu": "cpu", "cuda": "cuda"}  # torch device type of a backend's tensors
SHAPES = {"P": 4096, "D": 128}  # tokens per rank (issue 10: prefill and decode)
TOPOLOGY_TIMEOUT = 5.0  # seconds for Node.GetTopology
DEFAULT_HEAP = 4 << 30
# NVLink multicast stays off for NCCL, NVSHMEM (DeepEP's and the engines') and torch.
NO_MULTICAST = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


class BenchError(Exception):
    """A reason to stop, printed as one line."""


class BenchUsage(BenchError):
    """A bad argument: one line, exit code 2 (argparse's convention; was 1)."""


@dataclass
class Setup:
    """What this run does, decided once in the parent."""

    backend: str
    device_type: str
    gpus: int
    ranks: int
    shapes: list[tuple[str, int]]
    impls: list[str]
    skipped: dict[str, str] = field(default_factory=dict)
    low_latency: bool = False
    deep_ep_ll: bool = True  # DeepEP's low-latency rows, where DeepEP and low latency run
    graphs: bool = False
    expert_intermediate: int = 0  # the layer row's expert size (0: no layer row)
    shared_gpu_note: str = ""  # DeepEP runs where ranks share GPUs (--deep-ep-shared-gpu)


def topology(socket_dir: str) -> epd_pb2.GetTopologyResponse:
    """The daemon's GetTopology answer, or BenchError naming the socket."""
    try:
        return workers.topology(socket_dir, TOPOLOGY_TIMEOUT)
    except RuntimeError as e:
        raise BenchError(str(e)) from None


def _shapes(ns: Any) -> list[tuple[str, int]]:
    names = [s.strip().upper() for s in ns.shapes.split(",") if s.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if not names or unknown or len(set(names)) != len(names):
        raise BenchUsage(f"--shapes takes distinct names among {', '.join(SHAPES)}, "
                         f"got {ns.shapes!r}")
    try:
        tokens = [int(t) for t in ns.tokens.split(",") if t.strip()] if ns.tokens else []
    except ValueError:  # (was: a traceback)
        raise BenchUsage(f"--tokens takes whole numbers, one or one per shape, got "
                         f"{ns.tokens!r}") from None
    if len(tokens) == 1:
        tokens = tokens * len(names)
    if tokens and len(tokens) != len(names):
        raise BenchUsage(f"--tokens takes one value or one per shape ({len(names)}), "
                         f"got {ns.tokens!r}")
    out = list(zip(names, tokens or [SHAPES[n] for n in names], strict=True))
    if any(t < 1 for _, t in out):
        raise BenchUsage(f"--tokens must be positive, got {ns.tokens!r}")
    return out


def _deep_ep() -> str | None:
    """None when a real DeepEP imports here, else why not (EPD's shim is not DeepEP)."""
    if importlib.util.find_spec("deep_ep") is None:
        return "DeepEP is not installed (no `deep_ep` module)"
    try:
        deep_ep = importlib.import_module("deep_ep")
    except ImportError as e:  # e.g. EPD's shim refusing to shadow a real DeepEP
        return f"`import deep_ep` failed: {str(e).splitlines()[0]}"
    if getattr(deep_ep, "IS_EPD", False):
        return "`deep_ep` is EPD's opt-in shim, not DeepEP"
    return None


def plan_run(ns: Any, backend: str) -> Setup:
    """What runs on this machine, and why anything does not."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise BenchError("the bench runs every implementation with torch tensors: install "
                         "torch (pip install 'epd[torch]')") from None
    if ns.experts < 1 or ns.topk < 1 or ns.topk > ns.experts or ns.hidden < 1:
        raise BenchUsage(f"need 1 <= --topk <= --experts and --hidden >= 1, got topk "
                         f"{ns.topk}, experts {ns.experts}, hidden {ns.hidden}")
    if ns.iters < 1 or ns.warmup < 0:
        raise BenchUsage("--iters must be >= 1 and --warmup >= 0")
    device = torch.device(DEVICE_OF_BACKEND[backend])
    gpu = device.type == "cuda"
    gpus = torch.cuda.device_count() if gpu else 0
    if gpu and gpus < 1:
        raise BenchError("the daemon's backend is cuda but torch sees no GPU here")
    ranks = ns.ranks or max(gpus, 2)  # one GPU: two EPD ranks share it (one engine)
    if ranks < 2:
        raise BenchUsage(f"--ranks must be >= 2 (an all-to-all between ranks), got {ranks}")
    if ns.experts % ranks:
        raise BenchUsage(f"--experts {ns.experts} must be a multiple of the {ranks} ranks")
    skip = {s.strip() for s in ns.skip.split(",") if s.strip()}
    bad = skip - {DEEP_EP, "deep_ep_ll", PIPELINE, "graph"}
    if bad:
        raise BenchUsage(f"--skip takes deep_ep, deep_ep_ll, pipeline, graph; got {sorted(bad)}")
    setup = Setup(backend, device.type, gpus, ranks, _shapes(ns), [EPD])
    one_per_gpu = gpu and ranks <= gpus
    shared = gpu and not one_per_gpu and ns.deep_ep_shared_gpu
    if not gpu:
        setup.skipped[DEEP_EP] = "DeepEP needs the cuda backend (this run: cpu)"
    elif not one_per_gpu and not shared:
        setup.skipped[DEEP_EP] = (f"DeepEP needs one GPU per rank ({ranks} ranks, {gpus} GPU; "
                                  f"--deep-ep-shared-gpu runs its normal mode on shared GPUs)")
    elif DEEP_EP in skip:
        setup.skipped[DEEP_EP] = "--skip deep_ep"
    elif (why := _deep_ep()) is not None:
        setup.skipped[DEEP_EP] = why
    else:
        setup.impls.append(DEEP_EP)
    if PIPELINE in skip:
        setup.skipped[PIPELINE] = "--skip pipeline"
    elif gpu and not one_per_gpu:
        setup.skipped[PIPELINE] = f"NCCL needs one GPU per rank ({ranks} ranks, {gpus} GPU)"
    elif gpu and not dist.is_nccl_available():
        setup.skipped[PIPELINE] = "this torch has no NCCL"
    else:
        setup.impls.append(PIPELINE)
    inter = ns.expert_intermediate
    if inter is not None and inter < 0:
        raise BenchUsage(f"--expert-intermediate must be >= 0, got {inter}")
    setup.expert_intermediate = inter if inter is not None else (2048 if gpu else 0)
    if not setup.expert_intermediate:
        setup.skipped["layer rows"] = (
            "--expert-intermediate 0" if inter is not None else
            "the cpu backend's default (--expert-intermediate F runs it)")
    names = [n for n, _ in setup.shapes]
    if not ns.low_latency:
        setup.skipped["low_latency"] = "not asked (--low-latency)"
    elif "D" not in names:
        setup.skipped["low_latency"] = "low-latency rows run at shape D (add it to --shapes)"
    elif ns.hidden % 128:
        setup.skipped["low_latency"] = f"FP8 dispatch needs hidden % 128 == 0 ({ns.hidden})"
    else:
        setup.low_latency = True
    if setup.low_latency and DEEP_EP in setup.impls and "deep_ep_ll" in skip:
        setup.skipped["deep_ep_ll"] = "--skip deep_ep_ll"
        setup.deep_ep_ll = False
    elif setup.low_latency and DEEP_EP in setup.impls and shared:
        setup.skipped["deep_ep_ll"] = "DeepEP's low-latency mode (NVSHMEM) takes one GPU per rank"
        setup.deep_ep_ll = False
    if shared and DEEP_EP in setup.impls:
        setup.shared_gpu_note = (f"DeepEP's {ranks} ranks share {gpus} GPU(s) as EPD's do "
                                 f"(rank r on GPU r % {gpus}), through the daemon's MPS server")
    if setup.low_latency:
        if not gpu:
            setup.skipped["graph"] = "CUDA graphs need the cuda backend (this run: cpu)"
        elif "graph" in skip:
            setup.skipped["graph"] = "--skip graph"
        else:
            setup.graphs = True
    return setup


def heap_bytes(ns: Any, setup: Setup) -> int | None:
    """Symmetric heap per engine for the groups this bench forms (the facade's normal and
    layout groups, the low-latency one), with room to spare; the cuda planner's own sizes.
    The cpu backend ignores the flag. None where the cuda layout refuses the shapes (the
    daemon then answers for itself)."""
    from ...proto import dtypes
    from ..backends.base import GroupSpec
    from ..backends.cuda_plan import group_bytes
    bf16 = dtypes.from_name("bfloat16")
    tokens = max(t for _, t in setup.shapes)
    specs = [GroupSpec("n", setup.ranks, ns.experts, ns.hidden, tokens, ns.topk, bf16),
             GroupSpec("l", setup.ranks, ns.experts, 128, tokens, ns.topk, bf16)]
    if setup.low_latency:
        specs.append(GroupSpec("ll", setup.ranks, ns.experts, ns.hidden,
                               dict(setup.shapes)["D"], ns.topk, bf16, True))
    try:
        need = sum(group_bytes(s) for s in specs)
    except ValueError:
        return None
    gib = 1 << 30
    return max(DEFAULT_HEAP, -(-(need * 5 // 4 + gib) // gib) * gib)


def versions() -> dict[str, str]:
    """Installed versions (package metadata only: nothing is imported or initialised)."""
    from importlib.metadata import PackageNotFoundError, version
    wanted = {"torch": ["torch"], "numpy": ["numpy"],
              "cupy": ["cupy-cuda13x", "cupy-cuda12x", "cupy"],
              "nvshmem": ["nvshmem4py-cu13", "nvshmem4py-cu12", "nvshmem4py"],
              "cuda-bindings": ["cuda-bindings", "cuda-python"],
              "deep_ep": ["deep_ep", "deep-ep"], "grpcio": ["grpcio"]}
    out = {"epd": __version__, "python": platform.python_version()}
    for key, names in wanted.items():
        for name in names:
            with contextlib.suppress(PackageNotFoundError):
                out[key] = f"{version(name)} ({name})" if len(names) > 1 else version(name)
                break
    return out


def source_commit() -> str | None:
    """The git commit of the source tree this runs from (None outside a git checkout)."""
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--",
                                    "."], capture_output=True, text=True, timeout=10).stdout
            return out.stdout.strip() + ("+changes" if dirty.strip() else "")
    return None


def provenance() -> dict[str, Any]:
    """What a benchmark record says about its run: the command, the date, the machine, the
    versions and the source commit (every script under benchmarks/ writes it too)."""
    return {"command": sys.argv,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": {"node": platform.node(), "platform": platform.platform(),
                        "cpus": os.cpu_count()},
            "versions": versions(), "commit": source_commit()}


def daemon_mps_pipe(topo: epd_pb2.GetTopologyResponse) -> str:
    """The pipe folder of the daemon's MPS server ("" when it runs without MPS): the ranks
    join it as `eval "$(epd env)"` would, so engines and clients share the GPU concurrently."""
    if topo.mps_mode and topo.mps_mode != "off" and topo.mps_pipe_directory:
        return topo.mps_pipe_directory
    return ""


def drop_shared_deep_ep_without_mps(setup: Setup, mps_pipe: str) -> str:
    """DeepEP's ranks on a shared GPU spin on each other's flags: without one MPS server for
    them their contexts take turns on the GPU and a call stalls for time slices (or meets
    DeepEP's own kernel timeout, which kills the process). Where the daemon runs without MPS,
    DeepEP leaves the run; returns the reason ("" when it stays)."""
    if not setup.shared_gpu_note or mps_pipe or DEEP_EP not in setup.impls:
        return ""
    why = ("--deep-ep-shared-gpu needs the daemon's MPS server (DeepEP's ranks wait on each "
           "other's kernels: time-sliced contexts stall them), and this daemon runs without MPS")
    setup.impls.remove(DEEP_EP)
    setup.skipped[DEEP_EP] = why
    setup.shared_gpu_note = ""
    return why


def _mps(topo: epd_pb2.GetTopologyResponse, ranks_pipe: str,
         without: list[int] | None) -> dict:
    """Whether this run is under MPS: the caller's environment, the daemon's mode (GetTopology),
    the pipe folder the ranks used, and per engine the sessions whose client is not on the
    daemon's MPS server (read while the ranks were connected). `on`: engines and ranks shared
    one MPS server."""
    caller = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    return {"on": bool(ranks_pipe) and not any(without or []),
            "caller_CUDA_MPS_PIPE_DIRECTORY": caller,
            "daemon_mps_mode": topo.mps_mode or None,
            "daemon_mps_pipe_directory": topo.mps_pipe_directory or None,
            "ranks_CUDA_MPS_PIPE_DIRECTORY": ranks_pipe or caller,
            "sessions_without_mps": without}


class _Workers:
    """The rank processes and their queue; every wait has a deadline."""

    def __init__(self, plans: list[RankPlan], quiet: bool) -> None:
        ctx = mp.get_context("spawn")
        self.queue = ctx.Queue()
        self.quiet = quiet
        self.procs = [ctx.Process(target=rank_main, args=(p, self.queue), daemon=True,
                                  name=f"epd-bench-rank{p.rank}") for p in plans]
        for p in self.procs:
            p.start()

    def collect(self, timeout: float) -> list[dict]:
        deadline = time.monotonic() + timeout
        results: dict[int, dict] = {}
        while len(results) < len(self.procs):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(len(self.procs))) - set(results))
                raise BenchError(f"ranks {missing} did not finish within --timeout "
                                 f"{timeout:g} s")
            try:
                msg = self.queue.get(timeout=min(1.0, left))
            except queue_mod.Empty:
                for rank, p in enumerate(self.procs):
                    if rank not in results and p.exitcode is not None:
                        try:  # its last words may still be on their way
                            msg = self.queue.get(timeout=2.0)
                        except queue_mod.Empty:
                            raise BenchError(f"rank {rank} exited with code {p.exitcode} "
                                             "without a result") from None
                        break
                else:
                    continue
            if msg["kind"] == "progress":
                if not self.quiet:
                    print(f"  {msg['text']}", flush=True)
            elif msg["kind"] == "error":
                raise BenchError(msg["reason"], msg.get("trace", ""))
            else:
                results[msg["rank"]] = msg
        for p in self.procs:
            p.join(30)
        return [results[r] for r in sorted(results)]

    def stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(10)
        self.queue.close()
        self.queue.join_thread()


class Terminated(Exception):
    """SIGTERM: stop like Ctrl-C, cleaning up on the way out."""


def _raise_terminated(signum: int, _frame: Any) -> None:
    raise Terminated(signum)


def run_bench(ns: Any) -> int:
    """`epd bench`: the exit code (0: ran, every correctness check passed)."""
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    old_term = signal.signal(signal.SIGTERM, _raise_terminated)  # cleans up like Ctrl-C
    daemon: Any = None
    workers: _Workers | None = None
    store: Any = None
    try:
        from ..backends import resolve_backend_name
        if ns.socket_dir:
            topo = topology(ns.socket_dir)
            if not topo.engines:
                raise BenchError(f"the daemon on {ns.socket_dir} serves no engine")
            backend = epd_pb2.Backend.Name(topo.engines[0].backend).lower()
        else:
            backend = resolve_backend_name(ns.backend)
        setup = plan_run(ns, backend)

        def say(text: str) -> None:
            if not ns.quiet:
                print(text, flush=True)

        model = f"hidden {ns.hidden}, top-{ns.topk} of {ns.experts} experts, bf16"
        say(f"epd bench: backend {backend}, {setup.ranks} ranks, {model}; shapes "
            + ", ".join(f"{n} = {t} tokens/rank" for n, t in setup.shapes)
            + f"; {ns.warmup} warm-up + {ns.iters} timed iterations"
            + ("; new input tensor objects every call" if ns.fresh_inputs else ""))
        for what, why in setup.skipped.items():
            say(f"  skipped {what}: {why}")
        if setup.shared_gpu_note:
            say(f"  {setup.shared_gpu_note}")
        if ns.socket_dir:
            socket_dir, daemon_note = ns.socket_dir, f"external at {ns.socket_dir}"
        else:
            from ..demo import Daemon
            engines = ns.engines or (setup.gpus if setup.gpus else 2)
            heap = heap_bytes(ns, setup)
            extra = [*(["--nvshmem-heap-bytes", str(heap)] if heap else []), *ns.serve_arg]
            daemon = Daemon(backend=backend, engines=engines,
                            timeout_seconds=ns.call_timeout, extra=extra)
            try:
                daemon.wait_ready(ns.daemon_start_timeout)
            except (RuntimeError, TimeoutError) as e:
                tail = [ln for ln in daemon.log().splitlines() if ln.strip()][-1:] or [""]
                raise BenchError(f"the daemon did not start ({str(e).splitlines()[0]}): "
                                 f"{tail[0]}", daemon.log()) from None
            socket_dir, daemon_note = daemon.socket_dir, "started by the bench"
            say(f"  daemon: epd serve --backend {backend} --engines {engines} (pid "
                f"{daemon.proc.pid})")
        topo = topology(socket_dir)
        engine_pids = [int(e.pid) for e in topo.engines if e.pid]
        mps_pipe = daemon_mps_pipe(topo)
        say(f"  MPS: daemon {topo.mps_mode or 'off'}"
            + (f", ranks join its server ({mps_pipe})" if mps_pipe else ""))
        if why := drop_shared_deep_ep_without_mps(setup, mps_pipe):
            say(f"  skipped {DEEP_EP}: {why}")
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=ns.collective_timeout))
        d_tokens = dict(setup.shapes).get("D", 0)
        plans = [RankPlan(
            rank=r, num_ranks=setup.ranks, store_port=store.port,
            device_type=setup.device_type, gpu=r % setup.gpus if setup.gpus else -1,
            socket_dir=socket_dir, engine=None if setup.gpus else r % len(topo.engines),
            shapes=setup.shapes, hidden=ns.hidden, experts=ns.experts, topk=ns.topk,
            iters=ns.iters, warmup=ns.warmup, seed=ns.seed, impls=setup.impls,
            use_nccl=0 < setup.ranks <= setup.gpus
            and (DEEP_EP in setup.impls or PIPELINE in setup.impls),
            low_latency=setup.low_latency, deep_ep_ll=setup.deep_ep_ll, ll_tokens=d_tokens,
            graphs=setup.graphs, expert_intermediate=setup.expert_intermediate,
            fresh_inputs=ns.fresh_inputs, engine_pids=engine_pids,
            metrics_url=topo.metrics_url, mps_pipe_directory=mps_pipe,
            collective_timeout=ns.collective_timeout,
            call_timeout=ns.call_timeout) for r in range(setup.ranks)]
        workers = _Workers(plans, ns.quiet)
        results = workers.collect(ns.timeout)
        return _report(ns, setup, backend, daemon_note, topo, mps_pipe, results)
    except BenchError as e:
        print(f"epd bench: {e.args[0]}", file=sys.stderr, flush=True)
        if ns.verbose and len(e.args) > 1 and e.args[1]:
            print(e.args[1], file=sys.stderr)
        return 2 if isinstance(e, BenchUsage) else 1
    except KeyboardInterrupt:
        print("epd bench: interrupted", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"epd bench: terminated by signal {e.args[0]}", file=sys.stderr)
        return 128 + e.args[0]
    finally:
        if workers is not None:
            workers.stop()
        if daemon is not None:
            daemon.stop()
        del store  # closes the rendezvous port
        signal.signal(signal.SIGTERM, old_term)


def _report(ns: Any, setup: Setup, backend: str, daemon_note: str,
            topo: epd_pb2.GetTopologyResponse, mps_pipe: str, results: list[dict]) -> int:
    rows = report.fold(results, setup.ranks)
    report.judge(rows)
    checks = [c for r in results for c in r["checks"]]
    args = {k: v for k, v in vars(ns).items() if k != "func"}
    summary: dict[str, Any] = {
        "bench": "epd bench", **provenance(), "daemon_version": topo.version,
        "gpu": results[0].get("device_name"), "gpus": setup.gpus,
        "args": args, "backend": backend,
        "device": setup.device_type, "ranks": setup.ranks,
        "engines": len(topo.engines), "daemon": daemon_note,
        "shapes": [{"name": n, "tokens_per_rank": t} for n, t in setup.shapes],
        "model": {"hidden": ns.hidden, "experts": ns.experts, "topk": ns.topk,
                  "dtype": "bfloat16"},
        "issue_shapes": report.issue_shapes(args, setup.shapes),
        "mps": _mps(topo, mps_pipe, results[0].get("sessions_without_mps")),
        "engine_idle": results[0].get("engine_idle"),
        "skipped": setup.skipped,
        "deep_ep_shared_gpu": setup.shared_gpu_note,
        "expert_intermediate": setup.expert_intermediate,
        "fresh_inputs": ns.fresh_inputs,
        "pipeline_name": "NCCL pipeline" if setup.gpus else "gloo pipeline",
        "rows": rows, "correctness": checks,
        "correctness_passed": bool(checks) and all(c["passed"] for c in checks),
    }
    print()
    print(report.table(summary))
    print()
    for line in report.correctness_lines(checks) or ["FAIL  no correctness check ran"]:
        print(line)
    if setup.shared_gpu_note:
        print(f"note: {setup.shared_gpu_note}; the issue's ratios are for one GPU per rank")
    if not summary["issue_shapes"]:
        print("note: targets are issue 10's, for its shapes (P 4096 / D 128 tokens, hidden 7168, "
              "top-8 of 256); this run's differ, so verdicts are indicative only")
    mps = summary["mps"]
    print(f"MPS: {'on' if mps['on'] else 'off'} (daemon mode "
          f"{mps['daemon_mps_mode'] or 'not reported'}, ranks' CUDA_MPS_PIPE_DIRECTORY "
          f"{mps['ranks_CUDA_MPS_PIPE_DIRECTORY'] or 'unset'}, sessions without MPS per engine "
          f"{mps['sessions_without_mps']})")
    if ns.plot:
        summary["plot"] = report.plot(ns.plot, summary)
        print(f"plot: {summary['plot']}")
    if ns.json:
        report.write_json(ns.json, summary)
        print(f"json: {ns.json}")
    if not summary["correctness_passed"]:
        print("epd bench: correctness check failed (see FAIL above)", file=sys.stderr)
        return 1
    return 0
