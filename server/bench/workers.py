"""The rank processes of `epd bench`: one process per EP rank runs every implementation's rows
on the same inputs and sends its figures to the parent.

Implementations, in this order per shape: EPD through its DeepEP facade (`client/buffer.py`,
imported as `deep_ep`), DeepEP V1 in-process (a real `deep_ep`, cuda only), and the
torch.distributed pipeline any user could write (NCCL on cuda, gloo on cpu). EPD and DeepEP
run the very same calls (`FacadeCalls`): the facade is DeepEP's API.

Timing of one iteration, every row and implementation: barrier across ranks (gloo, host only),
t0, the row's calls, synchronise the device (`torch.cuda.synchronize()`; nothing on cpu), t1.
The client CPU of a row is `time.process_time()` (all threads of this process) summed over the
calls themselves, barrier and synchronisation excluded; its work CPU is the calling thread's
CPU over the same calls without its spins for the engine's replies (`client/host_cpu.py`).
Rank 0 also reads the engines' CPU (EPD rows) just after the barrier before the timed loop and
just after the one after it, and the engines' work CPU per request from their metrics.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import re
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...client import host_cpu
from ...proto import dtypes
from .. import reference as ref
from . import engine_host

ROW_FULL = "layout + dispatch + combine"
# The same with DeepEP's num_worst_tokens (ranks x tokens): no CPU sync for the count. The
# pipeline has no such call: its reference is its own ROW_FULL (report.judge).
ROW_WORST = "layout + dispatch + combine, num_worst_tokens"
# The same captured once in a CUDA graph and replayed (cuda; after every shape's other rows:
# an eager call of a group holding captured calls synchronises its stream first).
ROW_WORST_GRAPH = "layout + dispatch + combine, num_worst_tokens, CUDA graph replay"
ROW_CACHED = "cached dispatch"
ROW_COMBINE = "combine"
ROW_LAYER = "layer with expert MLPs"
ROW_LAYER_PROJ = "layer with projection + expert MLPs"
LAYER_ROWS = (ROW_LAYER, ROW_LAYER_PROJ)
ROW_LL_PLAIN = "low latency: FP8 dispatch + combine"
ROW_LL_HOOK = "low latency: with recv hooks"
ROW_LL_GRAPH = "low latency: CUDA graph replay"
NORMAL_ROWS = (ROW_FULL, ROW_CACHED, ROW_COMBINE, ROW_WORST)
LL_ROWS = (ROW_LL_PLAIN, ROW_LL_HOOK, ROW_LL_GRAPH)
# The low-latency check that is not a timed row: each token's rows through bf16 experts.
LL_ROWS_CHECK = "low latency: each token's rows (bf16, untimed)"
# API calls per iteration: what client and engine CPU are divided by (hooks not counted).
CALLS_PER_ITER = {ROW_FULL: 3, ROW_CACHED: 1, ROW_COMBINE: 1, ROW_WORST: 3, ROW_WORST_GRAPH: 3,
                  ROW_LAYER: 3,
                  ROW_LAYER_PROJ: 3, ROW_LL_PLAIN: 2, ROW_LL_HOOK: 2, ROW_LL_GRAPH: 2}

EPD, DEEP_EP, PIPELINE = "epd", "deep_ep", "pipeline"
IMPLS = (EPD, DEEP_EP, PIPELINE)
# The engine's CPU while no call comes, measured over this long after the normal-mode rows (the
# graph row's captured calls stay armed: their rings idle): what the daemon costs its node
# between requests.
IDLE_SECONDS = 1.0
# Before each reading of the daemon's metrics, rank 0 waits this long: the engine's fast-path
# and poller threads hold their metric updates while busy (a batch applied once idle or every
# 256 calls), so a reading right after a row missed that row's last updates and gave them to
# the next (a row of the poller's low-latency calls read 0 µs of engine work). Its threads
# go idle within their spin (5 ms at most) and flush. The process CPU is read before the wait.
# (The first timed call after it may find the poller's looks backed off: one of the row's
# iterations, up to --stream-op-idle-poll-us later.)
SETTLE_SECONDS = 0.05
PR_SET_PDEATHSIG = 1


@dataclass
class RankPlan:
    """Everything one rank process needs (picklable: it crosses a spawn)."""

    rank: int
    num_ranks: int
    store_port: int          # the parent's TCPStore on 127.0.0.1 (rendezvous, no files)
    device_type: str         # torch device type of the tensors
    gpu: int                 # this rank's CUDA device, -1 without one
    socket_dir: str
    engine: int | None       # EPD engine of this rank; None: the facade's choice (cuda)
    shapes: list[tuple[str, int]]  # (name, tokens per rank)
    hidden: int
    experts: int
    topk: int
    iters: int
    warmup: int
    seed: int
    impls: list[str]         # those that run (the others were skipped with a reason)
    use_nccl: bool           # an NCCL group for the pipeline and DeepEP
    low_latency: bool
    deep_ep_ll: bool         # DeepEP's low-latency rows too (needs NVSHMEM working in-process)
    ll_tokens: int           # num_max_dispatch_tokens_per_rank (shape D's tokens)
    graphs: bool
    expert_intermediate: int = 0  # > 0: the layer row, expert MLPs of this size between calls
    fresh_inputs: bool = False  # every call gets new tensor objects (views) of its inputs
    engine_pids: list[int] = field(default_factory=list)
    metrics_url: str = ""  # the daemon's /metrics: the engine's host time per armed op
    mps_pipe_directory: str = ""  # the daemon's MPS server, joined before CUDA starts here
    collective_timeout: float = 120.0
    call_timeout: float = 60.0


def inputs(seed: int, rank: int, shape_index: int, tokens: int, hidden: int, experts: int,
           topk: int, num_ranks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x bf16, topk_idx int64, topk_weights float32) of one rank and shape: DeepEP's
    score-based router, the same on every implementation and every run with this seed."""
    rng = np.random.default_rng([seed, rank, shape_index])
    idx, w = ref.random_routing(rng, tokens, experts, topk, num_ranks=num_ranks)
    return ref.random_x(rng, tokens, hidden, dtypes.BFLOAT16), idx, w


def expert_value(experts: int) -> np.ndarray:
    """What the timed rows' stand-in low-latency experts return for every row of expert e:
    (e % 8 + 1) / 8, exact in bf16, so a combine that reads another expert's rows changes the
    sum. A wrong row of the right expert does not (where a row lands in an expert's receive
    buffer is the implementation's choice, and not deterministic): `RankRun._ll_rows_check`
    covers that, untimed."""
    return ((np.arange(experts) % 8) + 1).astype(np.float32) / 8


def expert_scale(experts: int) -> np.ndarray:
    """The untimed check's experts: each multiplies its received rows by 2 ** -(e % 4) (exact
    in bf16), so every token's combined row depends on its own x and on each expert's scale."""
    return np.exp2(-(np.arange(experts) % 4)).astype(np.float32)


class ExpertMlp:
    """The layer rows' stand-in GPU work. Experts: each received row goes through an MLP,
    silu(x @ w1) @ w2, with the FLOPs of its top-k / ranks local experts of intermediate size
    `intermediate` each (one GEMM pair of `intermediate * experts_per_row` columns; a grouped
    GEMM over experts does the same work in more, smaller pieces). Projection: x @ w0, [H, H],
    the attention block's output projection that precedes a MoE layer's dispatch (the part of
    attention whose size does not depend on the sequence). The weights are the same on every
    rank and implementation (seeded), scaled so that outputs stay of order one."""

    def __init__(self, torch: Any, device: Any, seed: int, hidden: int, intermediate: int,
                 experts_per_row: int) -> None:
        width = intermediate * max(1, experts_per_row)
        g = torch.Generator().manual_seed(seed)
        self.w1 = (torch.randn(hidden, width, generator=g) / hidden ** 0.5).to(
            device=device, dtype=torch.bfloat16)
        self.w2 = (torch.randn(width, hidden, generator=g) / width ** 0.5).to(
            device=device, dtype=torch.bfloat16)
        self.w0 = (torch.randn(hidden, hidden, generator=g) / hidden ** 0.5).to(
            device=device, dtype=torch.bfloat16)
        self.silu = torch.nn.functional.silu

    def __call__(self, x: Any) -> Any:
        return self.silu(x @ self.w1) @ self.w2

    def project(self, x: Any) -> Any:
        return x @ self.w0


def cpu_seconds(pids: list[int]) -> float | None:
    """CPU time of processes (all their threads) in seconds, from /proc: per-thread schedstat
    run times (nanoseconds; /proc/<pid>/stat counts in clock ticks, 10 ms, too coarse for a
    row), else utime + stime. None when a process cannot be read (another pid namespace)."""
    total = 0.0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
            run_ns = 0
            for tid in tasks:
                with (contextlib.suppress(FileNotFoundError),  # a thread that just ended
                      open(f"/proc/{pid}/task/{tid}/schedstat") as f):
                    run_ns += int(f.read().split()[0])
            total += run_ns * 1e-9
        except (OSError, ValueError, IndexError):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, ValueError, IndexError):
                return None
    return total


def thread_cpu(pids: list[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (OS thread name, CPU seconds) of the processes' threads, a session's id in
    a name folded into `*` (epd-fast-*, epd-s*: one entry per kind of thread, once grouped);
    {} where /proc cannot be read."""
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    with open(f"/proc/{pid}/task/{tid}/comm") as f:
                        name = _SESSION_ID_TAIL.sub("*", f.read().strip())
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        out[(pid, int(tid))] = (name, int(f.read().split()[0]) * 1e-9)
    return out


def cpu_by_thread(before: dict[tuple[int, int], tuple[str, float]],
                  after: dict[tuple[int, int], tuple[str, float]]) -> dict[str, float]:
    """CPU seconds by thread name between two `thread_cpu` reads (per thread, then summed by
    name: a thread that ended between them drops out instead of going negative)."""
    out: dict[str, float] = {}
    for key, (name, sec) in after.items():
        out[name] = out.get(name, 0.0) + sec - before.get(key, (name, 0.0))[1]
    return out


_SESSION_ID_TAIL = re.compile(r"[0-9a-f]{6}$")


def topology(socket_dir: str, timeout: float) -> Any:
    """What `epd topology` shows: Node.GetTopology over <socket-dir>/node.sock (engine pids,
    backend, MPS state). RuntimeError naming the socket when no daemon answers."""
    import grpc

    from ...proto.v1 import epd_pb2, epd_pb2_grpc
    path = os.path.join(socket_dir, "node.sock")
    try:
        with grpc.insecure_channel(f"unix://{path}") as ch:
            return epd_pb2_grpc.NodeStub(ch).GetTopology(epd_pb2.GetTopologyRequest(),
                                                         timeout=timeout)
    except grpc.RpcError as e:
        raise RuntimeError(f"no daemon answers on {path}: {e.details()}") from None


class Rank:
    """This process's rank: torch, the process groups, barriers and synchronisation."""

    def __init__(self, plan: RankPlan, report: Callable[[dict], None]) -> None:
        import torch
        import torch.distributed as dist
        self.plan, self.torch, self.dist, self._report = plan, torch, dist, report
        if plan.gpu >= 0:
            torch.cuda.set_device(plan.gpu)
            self.device = torch.device(plan.device_type, plan.gpu)
        else:
            self.device = torch.device(plan.device_type)
        self.on_gpu = self.device.type == "cuda"
        timeout = datetime.timedelta(seconds=plan.collective_timeout)
        store = dist.TCPStore("127.0.0.1", plan.store_port, plan.num_ranks, False,
                              timeout=timeout)
        # gloo for barriers and host-side exchanges on every device; NCCL only for the
        # pipeline and DeepEP, one rank per GPU.
        dist.init_process_group("gloo", store=store, rank=plan.rank,
                                world_size=plan.num_ranks, timeout=timeout)
        self.host_group = dist.group.WORLD
        self.nccl_group = (dist.new_group(backend="nccl", timeout=timeout)
                           if plan.use_nccl else None)

    def barrier(self) -> None:
        self.dist.barrier(group=self.host_group)

    def sync(self) -> None:
        if self.on_gpu:
            self.torch.cuda.synchronize()

    def tensor(self, a: np.ndarray) -> Any:
        """A host array as a torch tensor on this rank's device (bf16 through its bits)."""
        torch = self.torch
        if a.dtype == dtypes.BFLOAT16:
            t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(a.copy())
        return t.to(self.device)

    def progress(self, text: str) -> None:
        if self.plan.rank == 0:
            self._report({"kind": "progress", "text": text})

    def timed(self, impl: str, shape: str, row: str, step: Callable[[], Any],
              engine_pids: list[int] | None = None) -> tuple[dict, Any]:
        """Warm up, then time `iters` iterations of `step` (see the module docstring).
        Returns the row's record and what the last call of `step` returned."""
        p = self.plan
        for _ in range(p.warmup):
            self.barrier()
            step()
            self.sync()
        self.barrier()
        metered = bool(engine_pids) and p.rank == 0 and bool(p.metrics_url)
        if metered:
            time.sleep(SETTLE_SECONDS)  # (the warm-up's held updates applied first)
        m0 = engine_host.read(p.metrics_url) if metered else None
        e0 = cpu_seconds(engine_pids) if engine_pids and p.rank == 0 else None
        t0_threads = thread_cpu(engine_pids) if e0 is not None else {}
        times, cpu, work, last = [], 0.0, 0.0, None
        for _ in range(p.iters):
            self.barrier()
            t0 = time.perf_counter()
            c0, tc0, s0 = time.process_time(), time.thread_time(), host_cpu.wait_seconds()
            last = step()
            c1, tc1, s1 = time.process_time(), time.thread_time(), host_cpu.wait_seconds()
            self.sync()
            t1 = time.perf_counter()
            times.append(t1 - t0)
            cpu += c1 - c0
            work += (tc1 - tc0) - (s1 - s0)  # this thread's CPU, without its spins for replies
        self.barrier()
        e1 = cpu_seconds(engine_pids) if e0 is not None else None
        t1_threads = thread_cpu(engine_pids) if e1 is not None else {}
        if m0 is not None:
            time.sleep(SETTLE_SECONDS)  # (after the CPU reading: the wait is not the row's)
        m1 = engine_host.read(p.metrics_url) if m0 is not None else None
        h0, h1, w0, w1 = ((engine_host.totals(m0), engine_host.totals(m1),
                           engine_host.work_totals(m0), engine_host.work_totals(m1))
                          if m0 is not None and m1 is not None else (None,) * 4)
        calls = CALLS_PER_ITER[row] * p.iters
        rec = {"impl": impl, "shape": shape, "row": row, "times_s": times,
               "client_cpu_s": cpu, "client_work_cpu_s": work, "calls": calls,
               "engine_cpu_s": None if e0 is None or e1 is None else e1 - e0,
               # (where that CPU went: by thread name, e.g. the poller, the fast path's)
               "engine_cpu_by_thread_s": cpu_by_thread(t0_threads, t1_threads),
               "engine_host_us": engine_host.means_us(h0, h1),
               "engine_work_us": engine_host.work_us(w0, w1)}
        self.progress(f"{shape:>2} {row:<36} {impl:<8} p50 {np.median(times) * 1e6:9.1f} us "
                      f"(rank 0)")
        return rec, last

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.barrier()
        with contextlib.suppress(Exception):
            self.dist.destroy_process_group()


# -- the calls ----------------------------------------------------------------------------------
def _same(t: Any) -> Any:
    return t


def _fresh(t: Any) -> Any:
    """A new tensor object over the same data (a model's next layer hands the facade new
    activations, often at addresses its allocator reuses: a cache keyed by the object misses)."""
    return t.view(t.shape)


class FacadeCalls:
    """DeepEP V1's calls, identical for EPD's facade and DeepEP: the same code times both.
    `fresh`: every call gets new tensor objects of its inputs (`epd bench --fresh-inputs`)."""

    def __init__(self, buf: Any, experts: int, fresh: bool = False) -> None:
        self.buf, self.experts = buf, experts
        self.state: dict[str, Any] = {}
        self.inp = _fresh if fresh else _same

    def normal(self, x: Any, idx: Any, w: Any, mlp: ExpertMlp | None = None,
               num_worst_tokens: int = 0) -> dict[str, Callable[[], None]]:
        """The rows' steps; `num_worst_tokens` (> 0) adds ROW_WORST's."""
        buf, st, e, new = self.buf, self.state, self.experts, self.inp

        def layer(inp: Any, experts: Callable[[Any], Any] | None = None,
                  worst: int = 0) -> tuple:
            """(combined, recv_x, recv_topk_weights, handle) of one MoE layer's calls."""
            i = new(idx)
            n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(i, e)
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(
                new(inp), num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=n_expert, topk_idx=i, topk_weights=new(w),
                **({"num_worst_tokens": worst} if worst else {}))
            y = recv_x if experts is None else experts(recv_x)
            combined, _, _ = buf.combine(new(y), handle, topk_weights=recv_w)
            return combined, recv_x, recv_w, handle

        def full() -> None:
            # Experts = identity (DeepEP's own tests combine recv_x): the row is communication.
            st["combined"], st["recv_x"], st["recv_w"], st["handle"] = layer(x)
            st["full_combined"] = st["combined"]  # (the combine row overwrites "combined")

        # The cached row sends other rows (x doubled, exact in bf16) along the handle's
        # routing: the full dispatch's rows, still in the receive buffer, would pass a check.
        x2 = x * 2

        def cached() -> None:
            st["cached"] = buf.dispatch(new(x2), handle=st["handle"])[0]

        def combine() -> None:
            st["combined"], _, _ = buf.combine(new(st["recv_x"]), st["handle"],
                                               topk_weights=st["recv_w"])

        def with_experts(inp: Callable[[], Any], row: str) -> Callable[[], None]:
            def step() -> None:
                st[row] = layer(inp(), mlp)[0]
            return step

        def worst() -> None:
            st[ROW_WORST] = layer(x, worst=num_worst_tokens)[0]

        steps = {ROW_FULL: full, ROW_CACHED: cached, ROW_COMBINE: combine}
        if num_worst_tokens:
            steps[ROW_WORST] = worst
        if mlp is not None:
            steps[ROW_LAYER] = with_experts(lambda: x, ROW_LAYER)
            steps[ROW_LAYER_PROJ] = with_experts(lambda: mlp.project(x), ROW_LAYER_PROJ)
        return steps

    def low_latency(self, x: Any, idx: Any, w: Any, y: Any,
                    num_max: int) -> dict[str, Callable[[], Any]]:
        """FP8 dispatch + bf16 combine of the stand-in expert outputs `y` `[L, R*num_max, H]`;
        each step returns the combined tensor."""
        buf, e, new = self.buf, self.experts, self.inp

        def plain() -> Any:
            i = new(idx)
            _, _, handle, _, _ = buf.low_latency_dispatch(new(x), i, num_max, e, use_fp8=True)
            combined, _, _ = buf.low_latency_combine(new(y), i, new(w), handle)
            return combined

        def hooked() -> Any:
            i = new(idx)
            _, _, handle, _, hook = buf.low_latency_dispatch(new(x), i, num_max, e,
                                                             use_fp8=True,
                                                             return_recv_hook=True)
            hook()
            combined, _, hook = buf.low_latency_combine(new(y), i, new(w), handle,
                                                        return_recv_hook=True)
            hook()
            return combined

        return {ROW_LL_PLAIN: plain, ROW_LL_HOOK: hooked}


class PipelineCalls:
    """The MoE all-to-all with torch.distributed alone: layout (which ranks each token goes
    to), count exchange with a host sync, all_to_all_single of the token rows grouped by
    destination (the local permute), all_to_all_single back, index_add in fp32 (what DeepEP's
    combine computes: the experts, identity here, would apply the top-k weights)."""

    def __init__(self, r: Rank, group: Any, experts: int) -> None:
        self.r, self.group, self.experts = r, group, experts
        self.state: dict[str, Any] = {}

    def normal(self, x: Any, idx: Any, w: Any, mlp: ExpertMlp | None = None,
               num_worst_tokens: int = 0) -> dict[str, Callable[[], None]]:
        """FacadeCalls.normal's steps but ROW_WORST's (a pipeline has no call without the
        count; `num_worst_tokens` is not used)."""
        torch, dist, g, st = self.r.torch, self.r.dist, self.group, self.state
        world = self.r.plan.num_ranks
        local = self.experts // world
        tokens, hidden = x.shape
        dev = x.device

        def layout() -> None:
            rank_of = torch.where(idx >= 0, idx // local, torch.full_like(idx, world))
            in_rank = torch.zeros(tokens, world + 1, dtype=torch.bool, device=dev)
            in_rank.scatter_(1, rank_of, True)
            in_rank = in_rank[:, :world]
            send_counts = in_rank.sum(0)
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=g)
            st["sc"], st["rc"] = send_counts.tolist(), recv_counts.tolist()  # the host sync
            st["perm"] = in_rank.t().nonzero()[:, 1]  # token ids, grouped by destination

        def dispatch(inp: Any = x) -> None:
            send_x = inp.index_select(0, st["perm"])
            recv_x = torch.empty(sum(st["rc"]), hidden, dtype=x.dtype, device=dev)
            dist.all_to_all_single(recv_x, send_x, st["rc"], st["sc"], group=g)
            st["recv_x"] = recv_x

        def back(rows: Any) -> Any:
            got = torch.empty(st["perm"].numel(), hidden, dtype=x.dtype, device=dev)
            dist.all_to_all_single(got, rows, st["sc"], st["rc"], group=g)
            out = torch.zeros(tokens, hidden, dtype=torch.float32, device=dev)
            out.index_add_(0, st["perm"], got.float())
            return out.to(x.dtype)

        def combine() -> None:
            st["combined"] = back(st["recv_x"])

        def full() -> None:
            layout()
            dispatch()
            combine()

        def layer(inp: Any, row: str) -> None:
            layout()
            dispatch(inp)
            st[row] = back(mlp(st["recv_x"]))

        steps = {ROW_FULL: full, ROW_CACHED: dispatch, ROW_COMBINE: combine}
        if mlp is not None:
            steps[ROW_LAYER] = lambda: layer(x, ROW_LAYER)
            steps[ROW_LAYER_PROJ] = lambda: layer(mlp.project(x), ROW_LAYER_PROJ)
        return steps


# -- correctness ----------------------------------------------------------------------------------
def compare(torch: Any, got: Any, want: Any, *, exact: bool) -> dict:
    """Bit-exact (`exact`) or within bf16 rounding (torch.testing.assert_close's bf16
    tolerances: both sides sum in fp32 and round once, in different orders)."""
    g, w = got.detach().cpu(), want.detach().cpu()
    if g.shape != w.shape:
        return {"passed": False, "exact": False, "max_abs_diff": None,
                "detail": f"shapes differ: {list(g.shape)} vs {list(w.shape)}"}
    same = bool(torch.equal(g.view(torch.int16), w.view(torch.int16)))
    diff = float((g.float() - w.float()).abs().max()) if g.numel() else 0.0
    detail = ""
    if exact:
        passed = same
        if not same:
            detail = f"{int((g.view(torch.int16) != w.view(torch.int16)).sum())} elements differ"
    else:
        try:
            torch.testing.assert_close(g, w)
            passed = True
        except AssertionError as e:
            passed, detail = False, str(e).splitlines()[0] if str(e) else "assert_close failed"
    return {"passed": passed, "exact": same, "max_abs_diff": diff, "detail": detail}


def ll_reference(torch: Any, idx: Any, w: Any, rows: Any, per_expert: Any) -> Any:
    """A low-latency combine as the kernels (EPD's and DeepEP's) compute it: for k in order,
    acc = fma(w[t,k], y, acc) in fp32, where y = rows[t] * per_expert[idx[t,k]] is the expert's
    (exact) bf16 output; rounded to bf16 once. `rows` `[T, H]`, or `[T, 1]` for outputs the
    same on every column; `per_expert` one float32 value per expert. On the host: torch has no
    fused multiply-add, NumPy has `reference.fma_f32`."""
    def host(a: Any) -> np.ndarray:
        return a.detach().float().cpu().numpy() if a.is_floating_point() else a.cpu().numpy()

    e_all, wn, yn, pe = host(idx), host(w), host(rows), host(per_expert)
    acc = np.zeros(yn.shape, np.float32)
    for k in range(e_all.shape[1]):
        sel = e_all[:, k] >= 0
        y = yn[sel] * pe[e_all[sel, k]][:, None]
        acc[sel] = ref.fma_f32(wn[sel, k][:, None], y, acc[sel])
    return torch.from_numpy(acc).to(idx.device).to(torch.bfloat16)


# -- one rank ------------------------------------------------------------------------------------
def _deep_ep_nvl_bytes(deep_ep: Any, num_ranks: int, hidden: int) -> int:
    """DeepEP's own sizing of the intranode buffer (its README's get_buffer)."""
    n = 0
    for cfg in (deep_ep.Buffer.get_dispatch_config(num_ranks),
                deep_ep.Buffer.get_combine_config(num_ranks)):
        n = max(n, cfg.get_nvl_buffer_size_hint(hidden * 2, num_ranks))
    return n


def _destroy(buf: Any) -> None:
    if buf is None:
        return
    if getattr(buf, "explicitly_destroy", False) and hasattr(buf, "destroy"):
        buf.destroy()


class RankRun:
    """All rows of one rank, in order; figures and checks accumulate in `result`."""

    def __init__(self, plan: RankPlan, report: Callable[[dict], None]) -> None:
        self.plan = plan
        self.r = Rank(plan, report)
        self.result: dict[str, Any] = {"kind": "result", "rank": plan.rank, "records": [],
                                       "checks": []}
        self.epd_buf = self.epd_ll_buf = self.dep_buf = None
        self.deep_ep: Any = None
        self._references: dict[tuple[int, int], Any] = {}  # (shape index, tokens) -> combine

    def check(self, shape: str, what: str, impl: str, against: str, got: Any, want: Any, *,
              exact: bool) -> None:
        res = compare(self.r.torch, got, want, exact=exact)
        res.update(shape=shape, what=what, impl=impl, against=against, rank=self.plan.rank,
                   rule="bit-exact" if exact else "bf16 tolerance")
        self.result["checks"].append(res)

    def _epd_buffer(self, low_latency: bool) -> Any:
        from ...client import buffer as deep_ep  # EPD's facade, imported as DeepEP would be
        p = self.plan
        return deep_ep.Buffer(self.r.host_group, low_latency_mode=low_latency,
                              explicitly_destroy=True, socket_dir=p.socket_dir, engine=p.engine,
                              group_name="epd-bench-ll" if low_latency else "epd-bench",
                              max_tokens_per_rank=p.ll_tokens if low_latency else
                              max(t for _, t in p.shapes),
                              timeout=p.call_timeout)

    def _deep_ep_buffer(self, low_latency: bool) -> Any:
        import inspect

        de, p = self.deep_ep, self.plan
        kw = {}
        if "explicitly_destroy" in inspect.signature(de.Buffer).parameters:
            kw["explicitly_destroy"] = True
        if low_latency:
            rdma = de.Buffer.get_low_latency_rdma_size_hint(p.ll_tokens, p.hidden, p.num_ranks,
                                                            p.experts)
            return de.Buffer(self.r.nccl_group, 0, rdma, low_latency_mode=True,
                             num_qps_per_rank=p.experts // p.num_ranks, **kw)
        # Ranks sharing a GPU have no NCCL group (NCCL takes one rank per GPU); DeepEP's
        # intranode mode uses its group only to exchange IPC handles, which gloo does.
        group = self.r.nccl_group if self.r.nccl_group is not None else self.r.host_group
        return de.Buffer(group, _deep_ep_nvl_bytes(de, p.num_ranks, p.hidden), 0, **kw)

    def run(self) -> dict:
        p, r = self.plan, self.r
        torch = r.torch
        if r.on_gpu:
            self.result["device_name"] = torch.cuda.get_device_name(r.device)
        if DEEP_EP in p.impls:
            import deep_ep
            self.deep_ep = deep_ep
        if EPD in p.impls:
            self.epd_buf = self._epd_buffer(False)
        if DEEP_EP in p.impls:
            self.dep_buf = self._deep_ep_buffer(False)
        pipe_group = r.nccl_group if r.on_gpu else r.host_group
        mlp = (ExpertMlp(torch, r.device, p.seed, p.hidden, p.expert_intermediate,
                         round(p.topk / p.num_ranks)) if p.expert_intermediate > 0 else None)
        rows = (*NORMAL_ROWS, *LAYER_ROWS) if mlp is not None else NORMAL_ROWS
        for si, (shape, tokens) in enumerate(p.shapes):
            x, idx, w = (r.tensor(a) for a in inputs(p.seed, p.rank, si, tokens, p.hidden,
                                                     p.experts, p.topk, p.num_ranks))
            combined: dict[str, Any] = {}
            full: dict[str, Any] = {}  # the "layout + dispatch + combine" row's own output
            layers: dict[str, Any] = {}
            for impl in p.impls:
                if impl == EPD:
                    calls = FacadeCalls(self.epd_buf, p.experts, p.fresh_inputs)
                elif impl == DEEP_EP:
                    calls = FacadeCalls(self.dep_buf, p.experts, p.fresh_inputs)
                else:
                    calls = PipelineCalls(r, pipe_group, p.experts)
                steps = calls.normal(x, idx, w, mlp, p.num_ranks * tokens)
                pids = p.engine_pids if impl == EPD else None
                for row in rows:
                    if row in steps:  # (the pipeline has no worst-case row)
                        self.result["records"].append(r.timed(impl, shape, row, steps[row],
                                                              pids)[0])
                if impl == EPD and p.rank == 0 and "sessions_without_mps" not in self.result:
                    # Read while every rank's session is open (after they close, 0 says nothing).
                    topo = topology(p.socket_dir, 5.0)
                    self.result["sessions_without_mps"] = [int(e.sessions_without_mps)
                                                           for e in topo.engines]
                combined[impl] = calls.state["combined"]
                if "full_combined" in calls.state:
                    full[impl] = calls.state["full_combined"]
                if "cached" in calls.state:  # the handle's routing again: x2's rows
                    self.check(shape, "cached dispatch", impl, "its full dispatch, doubled",
                               calls.state["cached"], calls.state["recv_x"] * 2, exact=True)
                if ROW_WORST in calls.state:  # (the combined tokens do not depend on it)
                    self.check(shape, ROW_WORST, impl, "reference", calls.state[ROW_WORST],
                               self._normal_reference(si, tokens), exact=impl == EPD)
                if mlp is not None:
                    layers[impl] = {row: calls.state[row] for row in LAYER_ROWS}
                calls.state.clear()  # free the outputs before the next implementation
            self._check_normal(shape, combined, si, tokens)
            if EPD in full:  # (checked as well: the combine row's output is checked above)
                self.check(shape, "layout + dispatch + combine", EPD, "reference", full[EPD],
                           self._normal_reference(si, tokens), exact=True)
            self._check_layer(shape, layers)
        if p.graphs:
            self._worst_graphs()
        self._idle_engine_cpu()
        _destroy(self.dep_buf)
        self.dep_buf = None
        if p.low_latency:
            self._low_latency()
        if self.epd_buf is not None:
            r.barrier()  # no rank leaves a group while a peer still uses it
            self.epd_buf.destroy()
        return self.result

    def _worst_graphs(self) -> None:
        """ROW_WORST_GRAPH at every shape, for the facades that capture it (EPD, DeepEP)."""
        p, r = self.plan, self.r
        for si, (shape, tokens) in enumerate(p.shapes):
            x, idx, w = (r.tensor(a) for a in inputs(p.seed, p.rank, si, tokens, p.hidden,
                                                     p.experts, p.topk, p.num_ranks))
            for impl, buf in ((EPD, self.epd_buf), (DEEP_EP, self.dep_buf)):
                if impl not in p.impls or buf is None:
                    continue
                calls = FacadeCalls(buf, p.experts, p.fresh_inputs)
                worst = calls.normal(x, idx, w, None, p.num_ranks * tokens)[ROW_WORST]
                combined = self._graph_row(
                    impl, (lambda worst=worst, st=calls.state: (worst(), st[ROW_WORST])[1]),
                    p.engine_pids if impl == EPD else None, shape, ROW_WORST_GRAPH)
                self.check(shape, ROW_WORST_GRAPH, impl, "reference",
                           self._settled(impl, buf, combined),
                           self._normal_reference(si, tokens), exact=impl == EPD)
                calls.state.clear()

    def _idle_engine_cpu(self) -> None:
        """Rank 0 reads the engine processes' CPU over IDLE_SECONDS in which no rank calls
        (`engine_idle`: the share of one core, in all and by thread name)."""
        p, r = self.plan, self.r
        if EPD not in p.impls or not p.engine_pids:
            return
        r.barrier()
        if p.rank == 0:
            t0, w0 = thread_cpu(p.engine_pids), time.perf_counter()
            time.sleep(IDLE_SECONDS)
            t1, wall = thread_cpu(p.engine_pids), time.perf_counter() - w0
            # (by thread, summed: a thread that ended in between drops out, not below zero)
            by_thread = sorted(cpu_by_thread(t0, t1).items(), key=lambda kv: -kv[1])
            self.result["engine_idle"] = {
                "seconds": wall, "armed_graphs": p.graphs,
                "core_share": sum(s for _, s in by_thread) / wall if t1 else None,
                "core_share_by_thread": {n: s / wall for n, s in by_thread if s > 0}}
        r.barrier()

    def _normal_reference(self, shape_index: int, tokens: int) -> Any:
        """This rank's combine of the identity experts by server/reference.py, from every
        rank's inputs (they are generated from the seed): x times the number of ranks that
        received the token, summed in fp32, rounded once to bf16. Computed once per shape."""
        key = (shape_index, tokens)
        if key not in self._references:
            self._references[key] = self._compute_reference(shape_index, tokens)
        return self._references[key]

    def _compute_reference(self, shape_index: int, tokens: int) -> Any:
        p, torch = self.plan, self.r.torch
        xs, idx, w = zip(*(inputs(p.seed, r, shape_index, tokens, p.hidden, p.experts, p.topk,
                                  p.num_ranks) for r in range(p.num_ranks)), strict=True)
        disp = ref.dispatch(list(xs), list(idx), list(w), p.experts)
        comb = ref.combine([d.recv_x for d in disp], disp, [tokens] * p.num_ranks,
                           recv_topk_weights=[d.recv_topk_weights for d in disp])
        bits = np.ascontiguousarray(comb[p.rank][0]).view(np.int16)
        return torch.from_numpy(bits).view(torch.bfloat16)

    def _check_normal(self, shape: str, combined: dict[str, Any], shape_index: int,
                      tokens: int) -> None:
        what = "normal combine"
        if EPD in combined:  # EPD's semantics are the reference's, bit for bit
            self.check(shape, what, EPD, "reference", combined[EPD],
                       self._normal_reference(shape_index, tokens), exact=True)
        if EPD in combined and DEEP_EP in combined:
            self.check(shape, what, EPD, DEEP_EP, combined[EPD], combined[DEEP_EP], exact=True)
        if EPD in combined and PIPELINE in combined:
            self.check(shape, what, EPD, PIPELINE, combined[EPD], combined[PIPELINE],
                       exact=False)
        if DEEP_EP in combined and PIPELINE in combined and EPD not in combined:
            self.check(shape, what, DEEP_EP, PIPELINE, combined[DEEP_EP], combined[PIPELINE],
                       exact=False)

    def _check_layer(self, shape: str, layers: dict[str, Any]) -> None:
        """The layer row's outputs: the same experts on the same rows, within bf16 rounding
        (the GEMMs' kernels may differ with the row count: received rows are ordered
        differently by the pipeline)."""
        first = EPD if EPD in layers else DEEP_EP
        for other in (DEEP_EP, PIPELINE):
            if first in layers and other in layers and other != first:
                for row in LAYER_ROWS:
                    self.check(shape, row, first, other, layers[first][row],
                               layers[other][row], exact=False)

    def _low_latency(self) -> None:
        """Rows at shape D (its index in the shape list picks the same inputs)."""
        p, r = self.plan, self.r
        torch = r.torch
        si = next(i for i, (name, _) in enumerate(p.shapes) if name == "D")
        x, idx, w = (r.tensor(a) for a in inputs(p.seed, p.rank, si, p.ll_tokens, p.hidden,
                                                 p.experts, p.topk, p.num_ranks))
        local = p.experts // p.num_ranks
        val = torch.from_numpy(expert_value(p.experts)).to(r.device)
        y = val[p.rank * local:(p.rank + 1) * local, None, None].expand(
            local, p.num_ranks * p.ll_tokens, p.hidden).to(torch.bfloat16).contiguous()
        ones = torch.ones(idx.shape[0], 1, device=r.device)
        want = ll_reference(torch, idx, w, ones, val).expand(-1, p.hidden)
        outs: dict[str, dict[str, Any]] = {}
        for impl in (i for i in p.impls if i == EPD or (i == DEEP_EP and p.deep_ep_ll)):
            buf = self._epd_buffer(True) if impl == EPD else self._deep_ep_buffer(True)
            if impl == EPD:
                self.epd_ll_buf = buf
            steps = FacadeCalls(buf, p.experts, p.fresh_inputs).low_latency(x, idx, w, y,
                                                                            p.ll_tokens)
            got: dict[str, Any] = {}
            pids = p.engine_pids if impl == EPD else None
            for row in (ROW_LL_PLAIN, ROW_LL_HOOK):
                rec, got[row] = r.timed(impl, "D", row, steps[row], pids)
                self.result["records"].append(rec)
                got[row] = self._settled(impl, buf, got[row])
                rec["ll_path"] = _ll_path(buf) if impl == EPD else None
            if p.graphs:
                got[ROW_LL_GRAPH] = self._settled(
                    impl, buf, self._graph_row(impl, steps[ROW_LL_HOOK], pids))
                self.result["records"][-1]["ll_path"] = _ll_path(buf) if impl == EPD else None
            outs[impl] = got
            self._ll_rows_check(impl, buf, x, idx, w)
            r.sync()
            r.barrier()
            if impl == DEEP_EP:
                _destroy(buf)
        for impl, got in outs.items():
            for row, combined in got.items():
                self.check("D", row, impl, "reference", combined, want, exact=False)
                if impl == EPD and DEEP_EP in outs:
                    self.check("D", row, EPD, DEEP_EP, combined, outs[DEEP_EP][row], exact=True)
        if self.epd_ll_buf is not None:
            r.barrier()
            self.epd_ll_buf.destroy()
            self.epd_ll_buf = None

    def _ll_rows_check(self, impl: str, buf: Any, x: Any, idx: Any, w: Any) -> None:
        """Untimed: a bf16 dispatch, experts that scale each received row by their own factor
        (`expert_scale`), the combine: every token's output depends on its own rows, so a
        combine that reads a wrong row inside the right (expert, source rank) block fails
        here, where the timed rows' per-block constants cannot tell."""
        p, torch = self.plan, self.r.torch
        local = p.experts // p.num_ranks
        scale = torch.from_numpy(expert_scale(p.experts)).to(self.r.device)
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, p.ll_tokens, p.experts,
                                                           use_fp8=False)
        mine = scale[p.rank * local:(p.rank + 1) * local]
        y = (recv_x.float() * mine[:, None, None]).to(torch.bfloat16)
        combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
        got = self._settled(impl, buf, combined)
        self.check("D", LL_ROWS_CHECK, impl, "reference", got,
                   ll_reference(torch, idx, w, x, scale), exact=False)

    def _settled(self, impl: str, buf: Any, combined: Any) -> Any:
        """A row's last output, once its calls are done: a copy (with a hook or in a graph,
        EPD returns the armed op's own output, which the next row's calls write), and on EPD
        any failure its ops' done words hold raised (a failed trigger leaves the last good
        output in place: the row would pass on a stale result)."""
        self.r.sync()
        if impl == EPD:
            buf.check()
        return combined.clone()

    def _graph_row(self, impl: str, step: Callable[[], Any], pids: list[int] | None,
                   shape: str = "D", row: str = ROW_LL_GRAPH) -> Any:
        """Capture one step (a hooked low-latency dispatch + combine, or a worst-case normal
        layer) into a CUDA graph, after a warm-up call outside the capture (which arms EPD's
        stream-ordered low-latency calls), and time its replay."""
        r = self.r
        torch = r.torch
        step()
        r.sync()
        r.barrier()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(r.device)
        with torch.cuda.graph(graph, stream=stream):
            combined = step()
        r.sync()
        rec, _ = r.timed(impl, shape, row, graph.replay, pids)
        self.result["records"].append(rec)
        return combined


def _ll_path(buf: Any) -> str:
    """Which path ran an EPD Buffer's armed low-latency ops: "chain" (the member's GPU chain,
    `--ll-chain`), "poller" (the engine's poller), "mixed", or "synchronous" (none armed)."""
    chained = {op.chained for op in buf._stream_ops.ops()}
    if not chained:
        return "synchronous"
    return "mixed" if len(chained) > 1 else ("chain" if chained == {True} else "poller")


def rank_main(plan: RankPlan, queue: Any) -> None:
    """Process entry: run, report the result or one error, never hang the parent."""
    with contextlib.suppress(Exception):  # die with the parent (Linux): no orphaned ranks
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if plan.mps_pipe_directory:  # what `eval "$(epd env)"` exports, before CUDA initialises
        os.environ["CUDA_MPS_PIPE_DIRECTORY"] = plan.mps_pipe_directory
    try:
        run = RankRun(plan, queue.put)
        result = run.run()
        run.r.close()
        queue.put(result)
    except BaseException as e:  # one line to the parent (which ends every rank), the trace too
        msg = str(e).strip().splitlines()
        queue.put({"kind": "error", "rank": plan.rank,
                   "reason": f"rank {plan.rank}: {type(e).__name__}: {msg[0] if msg else ''}",
                   "trace": traceback.format_exc()})
