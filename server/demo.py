"""`epd demo`: a daemon and N client processes doing real dispatch/combine, checked against the
reference. Its parts are reused by the tests and benchmarks: `Daemon` (`epd serve` in a
subprocess with its own socket folder), `Workload` (every rank's deterministic inputs) and
`expert_transform` (the stand-in experts). Test-only helpers live in tests/daemon_harness.py."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

import numpy as np

from ..proto import dtypes, engine_sockets
from . import reference as ref


class Daemon:
    """`epd serve` in a subprocess with a private socket folder; stops on exit."""

    def __init__(self, *, backend: str = "cpu", engines: int = 2, metrics_port: int = 0,
                 timeout_seconds: float = 10.0, extra: list[str] | None = None,
                 log_path: str | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="epd-")
        self.socket_dir = os.path.join(self.dir, "sock")
        self.metrics_port = metrics_port or _free_port()
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"
        self.log_path = log_path or os.path.join(self.dir, "daemon.log")
        args = [sys.executable, "-m", "epd.server.cli", "serve", "--backend", backend,
                "--engines", str(engines), "--socket-dir", self.socket_dir,
                "--metrics-port", str(self.metrics_port),
                "--timeout-seconds", str(timeout_seconds), "--restart-backoff-seconds", "0.2",
                "--drain-seconds", "3", *(extra or [])]
        env = dict(os.environ)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self._log = open(self.log_path, "w")  # noqa: SIM115  (lives as long as the daemon)
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.engines = engines
        self.extra = list(extra or [])

    def socket(self, engine: int, service_class: str = "") -> str:
        """Engine `engine`'s socket; with class engines, `service_class` "latency" names the
        device's latency engine."""
        return engine_sockets.socket_path(self.socket_dir, engine, service_class)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.metrics_url + path, timeout=2) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def wait_ready(self, timeout: float = 30.0, give_up_after_failed_starts: int = 5) -> None:
        """Until /readyz says ready; RuntimeError at once if the daemon exits, or once an
        engine failed to start that many times in a row (its reason is in the message: a
        start-up failure repeats, so waiting out `timeout` would only delay it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status, body = self.get("/readyz")
            except OSError:
                status, body = 0, ""
            if status == 200:
                return
            failed = re.search(r"failed to start (\d+) time", body)
            if failed and int(failed.group(1)) >= give_up_after_failed_starts > 0:
                raise RuntimeError(f"daemon not ready: {body.strip()}")
            time.sleep(0.1)
        raise TimeoutError(f"daemon not ready within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def client_env(self) -> dict[str, str]:
        """What `eval "$(epd env)"` exports for clients: the daemon's MPS pipe folder, if any
        (set it before a client process initialises CUDA)."""
        import grpc

        from ..proto.v1 import epd_pb2, epd_pb2_grpc
        with grpc.insecure_channel(f"unix://{self.socket_dir}/node.sock") as ch:
            topo = epd_pb2_grpc.NodeStub(ch).GetTopology(epd_pb2.GetTopologyRequest(),
                                                         timeout=10)
        return ({"CUDA_MPS_PIPE_DIRECTORY": topo.mps_pipe_directory}
                if topo.mps_pipe_directory else {})

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return self.proc.returncode

    def __enter__(self) -> Daemon:
        try:
            self.wait_ready()
        except BaseException:  # (a daemon that never came up: stop it, leave no folder)
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Workload:
    num_ranks: int
    tokens: list[int]
    hidden: int
    num_experts: int
    num_topk: int
    seed: int
    dtype: str = "bfloat16"
    drop_prob: float = 0.1

    def inputs(self, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(x, topk_idx, topk_weights) of one rank: the same on every process."""
        rng = np.random.default_rng([self.seed, rank])
        idx, w = ref.random_routing(rng, self.tokens[rank], self.num_experts, self.num_topk,
                                    drop_prob=self.drop_prob)
        x = ref.random_x(rng, self.tokens[rank], self.hidden, dtypes.to_numpy(
            dtypes.from_name(self.dtype)))
        return x, idx, w

    def all_inputs(self):
        return [self.inputs(r) for r in range(self.num_ranks)]


def expert_transform(recv_x: np.ndarray, recv_topk_idx: np.ndarray,
                     recv_topk_weights: np.ndarray, rank: int, local_experts: int) -> np.ndarray:
    """A stand-in for the experts: y = x * sum_k w_k * (1 + e_k / 64), in fp32, cast back."""
    valid = recv_topk_idx >= 0
    global_e = np.where(valid, recv_topk_idx + rank * local_experts, 0)
    factor = np.where(valid, recv_topk_weights * (1 + global_e / 64.0), 0).sum(axis=1)
    return (recv_x.astype(np.float32) * factor[:, None].astype(np.float32)).astype(recv_x.dtype)


def _demo_rank(rank: int, socket: str, wl: Workload, iters: int, q: mp.Queue) -> None:
    try:
        from ..client import Session  # (inside: a Ctrl-C while it imports is handled too)

        x, idx, w = wl.inputs(rank)
        x_np = x
        lx = wl.num_experts // wl.num_ranks
        with Session(socket, client_name=f"demo-rank{rank}") as s:
            # Inputs where the engine reads them (host memory, or the engine's GPU), and
            # outputs back on the host, whichever memory the session's backend uses.
            to_dev, to_host = s.memory.from_host, s.memory.to_host
            x, idx, w = to_dev(x), to_dev(idx), to_dev(w)
            g = s.join("demo", rank=rank, num_ranks=wl.num_ranks, num_experts=wl.num_experts,
                       hidden=wl.hidden, max_tokens_per_rank=max(wl.tokens),
                       num_topk=wl.num_topk, dtype=wl.dtype)
            times: dict[str, list[float]] = {"layout": [], "dispatch": [], "combine": []}
            # On cuda the calls are ordered on the caller's stream and return before the GPU
            # ran them: each phase ends when the stream is done (host wall clock).
            sync = functools.partial(s.memory.synchronize, x)
            for it in range(iters + 1):  # the first round warms up and is not timed
                sync()
                t0 = time.perf_counter()
                g.get_dispatch_layout(idx)
                sync()
                t1 = time.perf_counter()
                out = g.dispatch(x, idx, w)
                sync()
                t2 = time.perf_counter()
                y = to_dev(expert_transform(to_host(out.recv_x, x_np.dtype),
                                            to_host(out.recv_topk_idx),
                                            to_host(out.recv_topk_weights), rank, lx))
                sync()
                t3 = time.perf_counter()
                cx, cw = g.combine(y, out.handle, topk_weights=out.recv_topk_weights)
                sync()
                t4 = time.perf_counter()
                if it:
                    times["layout"].append(t1 - t0)
                    times["dispatch"].append(t2 - t1)
                    times["combine"].append(t4 - t3)
            # Verify the last round against the reference, computed here from every rank's inputs.
            inputs = wl.all_inputs()
            disp = ref.dispatch([i[0] for i in inputs], [i[1] for i in inputs],
                                [i[2] for i in inputs], wl.num_experts)
            ys = [expert_transform(d.recv_x, d.recv_topk_idx, d.recv_topk_weights, r, lx)
                  for r, d in enumerate(disp)]
            comb = ref.combine(ys, disp, wl.tokens,
                               recv_topk_weights=[d.recv_topk_weights for d in disp])
            mine = disp[rank]
            bits = (lambda a: to_host(a, x_np.dtype).view(np.uint16))  # noqa: E731
            ok = (np.array_equal(bits(out.recv_x), mine.recv_x.view(np.uint16))
                  and np.array_equal(to_host(out.recv_topk_idx), mine.recv_topk_idx)
                  and np.array_equal(to_host(out.recv_topk_weights), mine.recv_topk_weights)
                  and out.num_recv_tokens_per_expert == mine.num_recv_tokens_per_expert
                  and np.array_equal(bits(cx), comb[rank][0].view(np.uint16))
                  and np.array_equal(to_host(cw), comb[rank][1]))
            q.put({"rank": rank, "ok": bool(ok), "recv": int(out.num_recv_tokens),
                   "bytes": int(out.recv_x.nbytes),
                   "times": {k: float(np.median(v)) for k, v in times.items()}})
    except Exception as e:  # report, never hang the parent
        q.put({"rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}"})
    except KeyboardInterrupt:  # Ctrl-C reaches the whole group: the parent says it, once
        pass


def _usage_error(ns: argparse.Namespace) -> str | None:
    """What is wrong with the demo's arguments, before a daemon starts (was: a traceback for
    --ranks 0, a daemon and per-rank errors for --topk above --experts, NaN for --iters 0)."""
    from .config import MAX_ENGINES
    for name, low in (("ranks", 1), ("tokens", 1), ("hidden", 1), ("experts", 1),
                      ("topk", 1), ("iters", 1), ("engines", 0), ("metrics_port", 0)):
        if getattr(ns, name) < low:
            return f"--{name.replace('_', '-')} must be >= {low}, got {getattr(ns, name)}"
    if ns.topk > ns.experts:
        return f"--topk {ns.topk} must be at most --experts {ns.experts}"
    if ns.experts % ns.ranks:
        return f"--experts {ns.experts} must be a multiple of --ranks {ns.ranks}"
    if ns.engines > MAX_ENGINES:
        return f"--engines must be at most {MAX_ENGINES}, got {ns.engines}"
    if ns.metrics_port > 65535:
        return f"--metrics-port must lie in [0, 65535] (0: a free port), got {ns.metrics_port}"
    return None


def run_demo(ns: argparse.Namespace) -> int:
    from .backends import make_planner, missing_requirements, resolve_backend_name
    from .config import Config
    if (why := _usage_error(ns)) is not None:
        print(f"epd demo: {why}", file=sys.stderr)
        return 2
    backend = resolve_backend_name(ns.backend)
    if (missing := missing_requirements(backend)) is not None:  # (was an ImportError's
        print(f"epd demo: --backend {backend}: {missing}", file=sys.stderr)  # traceback)
        return 2
    planner = make_planner(Config(backend=backend))
    engines = ns.engines or planner.detect_engines()  # as `epd serve` decides
    wl = Workload(ns.ranks, [ns.tokens] * ns.ranks, ns.hidden, ns.experts, ns.topk, ns.seed)
    print(f"epd demo: starting a daemon (backend {backend}, {engines} engine(s)) and "
          f"{ns.ranks} client processes ...", flush=True)
    daemon = Daemon(backend=backend, engines=engines, metrics_port=ns.metrics_port)
    procs: list = []
    try:
        try:
            daemon.wait_ready(60)
        except (RuntimeError, TimeoutError) as e:  # one line: the daemon's last words
            lines = [ln for ln in daemon.log().splitlines() if ln.strip()] or [str(e)]
            print(f"epd demo: the daemon did not start: {lines[-1]}", file=sys.stderr)
            return 1
        os.environ.update(daemon.client_env())  # the client processes share its MPS server
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs += [ctx.Process(target=_demo_rank,
                             args=(r, daemon.socket(r % engines), wl, ns.iters, q))
                 for r in range(ns.ranks)]
        for p in procs:
            p.start()
        results = []
        for _ in procs:
            try:
                results.append(q.get(timeout=120))
            except Exception:
                break
        for p in procs:
            p.join(timeout=10)
        results.sort(key=lambda r: r["rank"])
        print(f"\n{ns.ranks} ranks x {ns.tokens} tokens, hidden {ns.hidden}, top-{ns.topk} of "
              f"{ns.experts} experts, bf16, {ns.iters} rounds (median, client-observed)")
        print(f"{'rank':>4} {'recv rows':>9} {'recv MB':>8} {'layout ms':>10} "
              f"{'dispatch ms':>12} {'combine ms':>11}  check")
        for r in results:
            if "error" in r:
                print(f"{r['rank']:>4}  ERROR {r['error']}")
                continue
            t = r["times"]
            print(f"{r['rank']:>4} {r['recv']:>9} {r['bytes'] / 1e6:>8.2f} "
                  f"{t['layout'] * 1e3:>10.3f} {t['dispatch'] * 1e3:>12.3f} "
                  f"{t['combine'] * 1e3:>11.3f}  {'exact' if r['ok'] else 'MISMATCH'}")
        ok = len(results) == ns.ranks and all(r.get("ok") for r in results)
        _status, body = daemon.get("/metrics")
        series = sum(1 for line in body.splitlines() if line.startswith("epd_"))
        print(f"\nmetrics: {daemon.metrics_url}/metrics ({series} epd_ series), "
              f"health: {daemon.metrics_url}/readyz")
        print(json.dumps({"ok": ok, "ranks": ns.ranks, "backend": backend}))
        if ns.keep and ok:
            print("--keep: daemon left running; Ctrl-C to stop it", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                daemon.proc.wait()
        return 0 if ok else 1
    except KeyboardInterrupt:
        print("epd demo: interrupted", file=sys.stderr)
        return 130
    finally:
        # (a second Ctrl-C must not cut the cleanup short: it left the daemon's temporary
        # folder behind, and tracebacks)
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join(10)
            daemon.stop()
        finally:
            signal.signal(signal.SIGINT, old_int)
