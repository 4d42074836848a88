"""`epd bench` (issue 10) on the CPU backend: EPD's DeepEP facade against the gloo pipeline with
tiny shapes and few iterations. Checked: the exit code, the JSON record (every row, figures,
CPU per call, correctness passed, skips with reasons) and that nothing is left behind (files in
the temp folders, processes). No timing target is asserted: a benchmark is not a speed test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("torch")

MARK = "EPD_BENCH_TEST_MARK"
ROWS = ["layout + dispatch + combine", "cached dispatch", "combine", "layer with expert MLPs",
        "layer with projection + expert MLPs"]
LL_ROWS = ["low latency: FP8 dispatch + combine", "low latency: with recv hooks"]
WORST = "layout + dispatch + combine, num_worst_tokens"  # (EPD and DeepEP only)


def _marked_processes(token: str) -> list[int]:
    """Processes whose environment carries `token`: the bench, its ranks, daemon, engines."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _run(args: list[str], tmp_path, timeout: float = 120) -> tuple[subprocess.CompletedProcess,
                                                                  str]:
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir(exist_ok=True)
    token = uuid.uuid4().hex
    env = dict(os.environ, TMPDIR=str(private_tmp), **{MARK: token})
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    proc = subprocess.run([sys.executable, "-m", "epd.server.bench", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    deadline = time.monotonic() + 10  # engines leave right after their supervisor
    while _marked_processes(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _marked_processes(token), "processes left behind"
    assert os.listdir(private_tmp) == [], f"files left in TMPDIR: {os.listdir(private_tmp)}"
    return proc, token


def test_bench_cpu_rows_json_and_cleanup(tmp_path) -> None:
    # The bench and its daemon create their folders through tempfile, so under the private
    # TMPDIR that _run checks is empty afterwards; /tmp itself is shared with other runs on the
    # same machine and is not compared here.
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    out = tmp_path / "bench.json"
    proc, _ = _run(["--backend", "cpu", "--ranks", "2", "--tokens", "32,8", "--hidden", "256",
                    "--experts", "16", "--topk", "4", "--iters", "3", "--warmup", "1",
                    "--low-latency", "--expert-intermediate", "32", "--json", str(out),
                    "--plot", str(tmp_path / "b.png"),
                    "--timeout", "120", "-v"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| p50 µs | DeepEP in-process | EPD | gloo pipeline |" in proc.stdout
    assert "EPD host work CPU per call" in proc.stdout
    assert "EPD engine process CPU per call by thread, µs: " in proc.stdout
    assert "EPD engine process CPU while idle for " in proc.stdout
    assert "EPD's low-latency calls, per rank (armed ops on the GPU chain or the engine's " \
        "poller, or synchronous calls): " in proc.stdout
    if os.path.isdir("/dev/shm"):
        new_shm = [n for n in set(os.listdir("/dev/shm")) - shm_before
                   if n.startswith(("epd", "sem.mp", "torch"))
                   and not n.startswith("epd-test-")]  # other test runs' shm folders
        assert not new_shm, f"left in /dev/shm: {new_shm}"

    rec = json.loads(out.read_text())
    assert rec["backend"] == "cpu" and rec["ranks"] == 2 and rec["device"] == "cpu"
    # the engines' CPU over a second without calls: some (their threads wake to look), not a
    # core's worth per engine; no graph row on the cpu backend
    idle = rec["engine_idle"]
    assert idle["seconds"] >= 0.9 and idle["armed_graphs"] is False, idle
    assert 0 <= idle["core_share"] < 0.9 * rec["engines"], idle
    assert rec["versions"]["torch"] and rec["versions"]["epd"]
    assert rec["mps"]["on"] is False and rec["mps"]["daemon_mps_mode"] in ("off", None)
    assert "deep_ep" in rec["skipped"] and "graph" in rec["skipped"]  # each with its reason
    assert all(rec["skipped"].values())
    assert "plot" in rec  # a path, or why it was skipped (matplotlib missing)
    got = {(r["shape"], r["row"]): r for r in rec["rows"]}
    want = ([(s, row) for s in ("P", "D") for row in (*ROWS, WORST)]
            + [("D", row) for row in LL_ROWS])
    assert sorted(got) == sorted(want)
    for key, row in got.items():
        impls = ("epd",) if key[1] in (*LL_ROWS, WORST) else ("epd", "pipeline")
        assert ("pipeline" in row["results"]) is (key[1] not in (*LL_ROWS, WORST)), key
        if key[1] == WORST:  # (the pipeline's full row of the shape is its reference)
            full = got[(key[0], ROWS[0])]["results"]["pipeline"]["p50_us"]
            assert row["pipeline_reference_us"] == full, (key, row["pipeline_reference_us"])
        for impl in impls:
            fig = row["results"][impl]
            assert fig["p50_us"] > 0 and fig["p90_us"] >= fig["p50_us"], (key, impl, fig)
            assert fig["iters"] == 3 and len(fig["per_rank_p50_us"]) == 2
        epd = row["results"]["epd"]
        assert epd["client_cpu_us_per_call"] is not None and epd["client_cpu_us_per_call"] > 0
        assert epd["engine_cpu_us_per_call"] is not None and epd["engine_cpu_us_per_call"] >= 0
        # the work, without spins and waits: some, and no more than the process CPU
        work, engine_work = (epd["client_work_cpu_us_per_call"],
                             epd["engine_work_cpu_us_per_call"])
        assert 0 < work <= epd["client_cpu_us_per_call"] * 1.05 + 5, (key, epd)
        assert engine_work is not None and engine_work > 0, (key, epd)
        # the engine's process CPU by thread name: the named threads that served the calls
        by_thread = epd["engine_cpu_us_per_call_by_thread"]
        assert any(by_thread.get(n, 0) > 0 for n in ("epd-fast-*", "epd-s*")), \
            (key, by_thread)  # (the threads that serve calls: the fast path's, a session's)
        assert row["ratios"]["epd_over_pipeline"] is not None
        # who ran the armed low-latency ops: none are armed on the cpu backend
        assert epd["low_latency_path"] == (["synchronous"] * 2 if key[1] in LL_ROWS
                                           else None), (key, epd)
        if key[1].startswith("layer"):  # (a forward pass's layer: compared, no target)
            assert row["targets"] == [], row["targets"]
        else:
            assert any(t["what"].startswith("client CPU") for t in row["targets"])
    checks = rec["correctness"]
    assert rec["correctness_passed"] is True
    assert {(c["shape"], c["what"], c["against"]) for c in checks} >= {
        ("P", "normal combine", "pipeline"), ("D", "normal combine", "pipeline"),
        ("P", "normal combine", "reference"), ("D", "normal combine", "reference"),
        ("P", "layout + dispatch + combine", "reference"),  # (that row's own output)
        ("D", "layout + dispatch + combine", "reference"),
        ("P", WORST, "reference"), ("D", WORST, "reference"),  # (that row's own output)
        ("D", LL_ROWS[0], "reference"), ("D", LL_ROWS[1], "reference"),
        ("D", "low latency: each token's rows (bf16, untimed)", "reference"),
        *((s, row, "pipeline") for s in ("P", "D") for row in ROWS[3:])}
    assert rec["expert_intermediate"] == 32 and "layer rows (no target" in proc.stdout
    assert rec["fresh_inputs"] is False
    assert all(c["passed"] for c in checks) and {c["rank"] for c in checks} == {0, 1}


def test_bench_fresh_inputs(tmp_path) -> None:
    """--fresh-inputs: every call gets new tensor objects of its inputs (what a model's next
    layer hands the facade); the rows and their checks are the same."""
    out = tmp_path / "bench.json"
    proc, _ = _run(["--backend", "cpu", "--ranks", "2", "--shapes", "D", "--tokens", "8",
                    "--hidden", "256", "--experts", "16", "--topk", "4", "--iters", "2",
                    "--warmup", "1", "--low-latency", "--fresh-inputs", "--skip", "pipeline",
                    "--json", str(out), "--timeout", "120"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "new input tensor objects every call" in proc.stdout
    rec = json.loads(out.read_text())
    assert rec["fresh_inputs"] is True and rec["correctness_passed"] is True
    assert {r["row"] for r in rec["rows"]} == {*ROWS[:3], WORST, *LL_ROWS}
    assert all(r["results"]["epd"]["p50_us"] > 0 for r in rec["rows"])


@pytest.mark.parametrize("fresh", [False, True])
def test_fresh_inputs_reach_every_facade_call(fresh) -> None:
    """FacadeCalls with `fresh` hands each call new tensor objects over the inputs' data
    (same address and strides); without it, the inputs themselves."""
    import torch

    from epd.server.bench.workers import FacadeCalls

    seen: list[tuple[str, object]] = []

    class Recording:  # (a DeepEP Buffer's calls, recording their tensor arguments)
        def low_latency_dispatch(self, x, idx, num_max, experts, **kw):
            seen.extend([("x", x), ("idx", idx)])
            return None, None, "handle", None, (lambda: None)

        def low_latency_combine(self, y, idx, w, handle, **kw):
            seen.extend([("y", y), ("idx", idx), ("w", w)])
            return "combined", None, (lambda: None)

    x, idx, w, y = (torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2),
                    torch.zeros(2, 8, 8))
    given = {"x": x, "idx": idx, "w": w, "y": y}
    steps = FacadeCalls(Recording(), 4, fresh).low_latency(x, idx, w, y, 4)
    for _ in range(2):
        for step in steps.values():
            step()
    assert len(seen) == 2 * 2 * 5
    for name, t in seen:
        assert (t is given[name]) is not fresh, name
        assert (t.data_ptr(), t.stride(), t.shape) == (given[name].data_ptr(),
                                                       given[name].stride(), given[name].shape)


@pytest.mark.parametrize("args,reason,code", [
    (["--socket-dir", "{tmp}"], "no daemon answers on", 1),
    (["--backend", "cpu", "--experts", "15"], "must be a multiple of the 2 ranks", 2),  # usage
    (["--backend", "cpu", "--shapes", "P,X"], "--shapes takes distinct names", 2),
])
def test_bench_fails_with_one_line(tmp_path, args, reason, code) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc, _ = _run(args, tmp_path, timeout=60)
    assert proc.returncode == code, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("epd bench: ") and reason in lines[0], \
        proc.stderr


@pytest.mark.parametrize("shared", [False, True])
def test_plan_deep_ep_on_shared_gpu(monkeypatch, shared) -> None:
    """Where ranks share a GPU, DeepEP runs only when asked (--deep-ep-shared-gpu), in normal
    mode only, and the NCCL pipeline stays skipped: the plan of a one-GPU machine, with torch's
    device count and DeepEP's import made to say so."""
    import argparse

    import torch

    from epd.server import bench
    from epd.server.bench import runner

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(runner, "_deep_ep", lambda: None)  # as if a real DeepEP imported
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    ns = parser.parse_args(["--low-latency", *(["--deep-ep-shared-gpu"] if shared else [])])
    setup = runner.plan_run(ns, "cuda")
    assert setup.ranks == 2 and setup.gpus == 1
    assert setup.expert_intermediate == 2048  # the layer row, by default on cuda
    assert "pipeline" in setup.skipped and "NCCL needs one GPU per rank" in \
        setup.skipped["pipeline"]
    if shared:
        assert setup.impls == ["epd", "deep_ep"] and not setup.deep_ep_ll
        assert "takes one GPU per rank" in setup.skipped["deep_ep_ll"]
        assert "share 1 GPU(s)" in setup.shared_gpu_note
        # the daemon on MPS: DeepEP stays; without it: it leaves the run, with the reason
        assert runner.drop_shared_deep_ep_without_mps(setup, "/run/epd/mps/pipe") == ""
        assert setup.impls == ["epd", "deep_ep"]
        why = runner.drop_shared_deep_ep_without_mps(setup, "")
        assert "needs the daemon's MPS server" in why and setup.impls == ["epd"]
        assert setup.skipped["deep_ep"] == why and setup.shared_gpu_note == ""
    else:
        assert setup.impls == ["epd"] and "--deep-ep-shared-gpu" in setup.skipped["deep_ep"]
        assert setup.shared_gpu_note == ""


def test_ll_rows_check_catches_a_wrong_row_of_the_right_expert() -> None:
    """The untimed low-latency check (bench/workers.py `_ll_rows_check`): experts that scale
    their received rows by a per-expert power of two. The reference's combine of those outputs
    matches `ll_reference` bit for bit; two rows of one expert swapped (the timed rows'
    per-expert constants cannot see it) fail the check, and so does another expert's scale."""
    import numpy as np
    import torch

    from epd.proto import dtypes
    from epd.server import reference as ref
    from epd.server.bench import workers

    ranks, tokens, hidden, experts, topk = 2, 12, 32, 8, 3
    local = experts // ranks
    rng = np.random.default_rng(5)
    xs, idxs, ws = [], [], []
    for _ in range(ranks):
        idx, w = ref.random_routing(rng, tokens, experts, topk, drop_prob=0.0)
        xs.append(ref.random_x(rng, tokens, hidden, dtypes.BFLOAT16))
        idxs.append(idx)
        ws.append(w)
    disp = ref.low_latency_dispatch(xs, idxs, experts, tokens)
    scale = workers.expert_scale(experts)

    def bf16(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)

    # two rows of rank 0's tokens in one expert's buffer (on rank d)
    d, e, rows = next((d, e, np.nonzero(disp[d].recv_src_rank[e] == 0)[0][:2])
                      for d in range(ranks) for e in range(local)
                      if (disp[d].recv_src_rank[e] == 0).sum() >= 2)

    def combined(scales: np.ndarray, swap: bool = False) -> torch.Tensor:
        ys = [(x.recv_x.astype(np.float32) * scales[r * local:(r + 1) * local, None, None])
              .astype(dtypes.BFLOAT16) for r, x in enumerate(disp)]
        if swap:
            ys[d][e, rows] = ys[d][e, rows[::-1]]
        return bf16(ref.low_latency_combine(ys, disp, idxs, ws, experts)[0])

    want = workers.ll_reference(torch, torch.from_numpy(idxs[0]), torch.from_numpy(ws[0]),
                                bf16(xs[0]), torch.from_numpy(scale))
    good = workers.compare(torch, combined(scale), want, exact=False)
    assert good["passed"] and good["exact"], good
    swapped = workers.compare(torch, combined(scale, swap=True), want, exact=False)
    assert not swapped["passed"], swapped
    wrong_scale = workers.compare(torch, combined(np.roll(scale, 1)), want, exact=False)
    assert not wrong_scale["passed"], wrong_scale
