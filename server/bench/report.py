"""`epd bench` figures: every rank's records folded into rows (the slowest rank per iteration,
then p50/p90), the issue's targets beside them, the table, the JSON record and the plot."""

from __future__ import annotations

import json
import math

import numpy as np

from .workers import (
    DEEP_EP,
    EPD,
    IMPLS,
    LAYER_ROWS,
    LL_ROWS,
    NORMAL_ROWS,
    PIPELINE,
    ROW_FULL,
    ROW_LL_GRAPH,
    ROW_LL_HOOK,
    ROW_LL_PLAIN,
    ROW_WORST,
    ROW_WORST_GRAPH,
)

# Issue 10's targets. Ratios are EPD / DeepEP p50 per row; absolute ones are EPD p50 in µs.
RATIO_TARGETS = {"P": {ROW_FULL: 1.0, "cached dispatch": 1.0, "combine": 1.0},
                 "D": {ROW_FULL: 1.5, "cached dispatch": 2.0, "combine": 2.0}}
LL_TARGETS_US = {ROW_LL_PLAIN: 250.0, ROW_LL_HOOK: 200.0, ROW_LL_GRAPH: 150.0}
NCCL_SPEEDUP = 2.0      # every row at least 2x faster than the pipeline
CPU_TARGET_US = 30.0    # client and engine CPU per operation
# Issue 10's shapes; targets are verdicts only at these (a smaller run is a rehearsal).
ISSUE_SHAPES = {"P": 4096, "D": 128}
ISSUE_MODEL = {"hidden": 7168, "experts": 256, "topk": 8}


def _us(v: float) -> float:
    return v * 1e6


def fold(results: list[dict], num_ranks: int) -> list[dict]:
    """Rows in order (shapes, then low latency), each with per-implementation figures:
    p50/p90 over iterations of the slowest rank's time, per-rank p50, client CPU per call
    (mean over ranks), engine CPU per call (all engines / (ranks x calls))."""
    by_key: dict[tuple[str, str], dict[str, list[dict]]] = {}
    order: list[tuple[str, str]] = []
    for res in sorted(results, key=lambda r: r["rank"]):
        for rec in res["records"]:
            key = (rec["shape"], rec["row"])
            if key not in by_key:
                by_key[key] = {}
                order.append(key)
            by_key[key].setdefault(rec["impl"], []).append(rec)
    rows = []
    for shape, row in order:
        figures = {}
        for impl, recs in by_key[(shape, row)].items():
            slowest = np.max(np.array([rec["times_s"] for rec in recs]), axis=0)
            calls = recs[0]["calls"]
            engine = [rec["engine_cpu_s"] for rec in recs if rec["engine_cpu_s"] is not None]
            figures[impl] = {
                "p50_us": _us(float(np.percentile(slowest, 50))),
                "p90_us": _us(float(np.percentile(slowest, 90))),
                "per_rank_p50_us": [_us(float(np.median(rec["times_s"]))) for rec in recs],
                "iters": len(slowest),
                "calls_per_rank": calls,
                "client_cpu_us_per_call": _us(float(np.mean([rec["client_cpu_s"] / calls
                                                             for rec in recs]))),
                "engine_cpu_us_per_call": (_us(engine[0] / (calls * num_ranks)) if engine
                                           else None),
                "engine_cpu_us_per_call_by_thread": next(
                    ({name: _us(sec / (calls * num_ranks)) for name, sec in
                      sorted(rec["engine_cpu_by_thread_s"].items(), key=lambda kv: -kv[1])}
                     for rec in recs if rec.get("engine_cpu_by_thread_s")), None),
                # issue 10's "host CPU per call": the work, without waits and spins
                "client_work_cpu_us_per_call": _us(float(np.mean(
                    [rec.get("client_work_cpu_s", rec["client_cpu_s"]) / calls
                     for rec in recs]))),
                "engine_work_cpu_us_per_call": next((rec["engine_work_us"] for rec in recs
                                                     if rec.get("engine_work_us") is not None),
                                                    None),
                # armed low-latency ops only: the engine poller's detection gap and launch
                "engine_host_us_per_op": next((rec["engine_host_us"] for rec in recs
                                               if rec.get("engine_host_us", {}).get(
                                                   "launch_us") is not None), None),
                # armed low-latency ops only: who ran them (the GPU chain or the poller), each
                # rank's own view, e.g. ["chain", "chain"]
                "low_latency_path": [rec["ll_path"] for rec in recs if rec.get("ll_path")]
                                    or None,
            }
        rows.append({"shape": shape, "row": row, "results": figures})
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def judge(rows: list[dict]) -> None:
    """Adds `ratios` and `targets` (each: what, value, passed or None where a figure is
    missing) to every row. The pipeline figure for low-latency rows is the pipeline's full
    row at D, the whole MoE all-to-all any user could write instead; for the worst-case row,
    its full row of the same shape (it has no call without the count)."""
    pipe_full = {r["shape"]: r["results"][PIPELINE]["p50_us"] for r in rows
                 if r["row"] == ROW_FULL and PIPELINE in r["results"]}
    for row in rows:
        res = row["results"]
        epd = res.get(EPD, {}).get("p50_us")
        dep = res.get(DEEP_EP, {}).get("p50_us")
        pipe = res.get(PIPELINE, {}).get("p50_us")
        if row["row"] in LL_ROWS:
            pipe = pipe_full.get("D")
        elif row["row"] in (ROW_WORST, ROW_WORST_GRAPH):
            pipe = pipe_full.get(row["shape"])
        row["pipeline_reference_us"] = pipe
        row["ratios"] = {"epd_over_deep_ep": _ratio(epd, dep),
                         "epd_over_pipeline": _ratio(epd, pipe)}
        targets = []
        row["targets"] = targets
        if row["row"] in LAYER_ROWS:  # (a forward pass's layer: compared, no target)
            continue
        limit = RATIO_TARGETS.get(row["shape"], {}).get(row["row"])
        if limit is not None:
            v = row["ratios"]["epd_over_deep_ep"]
            targets.append({"what": f"EPD <= {limit:g}x DeepEP", "short": f"<={limit:g}x DeepEP",
                            "value": v, "passed": None if v is None else v <= limit})
        if row["row"] in LL_TARGETS_US:
            limit = LL_TARGETS_US[row["row"]]
            targets.append({"what": f"EPD <= {limit:g} us", "short": f"<={limit:g} us",
                            "value": epd, "passed": None if epd is None else epd <= limit})
        v = row["ratios"]["epd_over_pipeline"]
        targets.append({"what": f"EPD >= {NCCL_SPEEDUP:g}x faster than the pipeline",
                        "short": f">={NCCL_SPEEDUP:g}x pipeline", "value": v,
                        "passed": None if v is None else v <= 1 / NCCL_SPEEDUP})
        for which in ("client", "engine"):
            c = res.get(EPD, {}).get(f"{which}_cpu_us_per_call")
            targets.append({"what": f"{which} CPU <= {CPU_TARGET_US:g} us/call",
                            "short": f"{which} CPU <={CPU_TARGET_US:g} us", "value": c,
                            "passed": None if c is None else c <= CPU_TARGET_US})


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if unit == "x":
        return f"{v:.2f}x"
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def _verdicts(row: dict) -> str:
    marks = []
    for t in row["targets"]:
        if t["passed"] is None:
            continue
        marks.append(f"{t['short']} {'pass' if t['passed'] else 'MISS'}")
    return ", ".join(marks) if marks else "-"


def table(summary: dict) -> str:
    """The markdown table of p50 figures with verdicts, then one of p90."""
    pipe_name = summary["pipeline_name"]
    head = (f"| p50 µs | DeepEP in-process | EPD | {pipe_name} | EPD/DeepEP | EPD/{pipe_name} | "
            "client CPU µs/call | engine CPU µs/call | targets |")
    lines = [head, "|" + "---|" * 9]
    for row in summary["rows"]:
        res = row["results"]
        pipe = row["pipeline_reference_us"]  # (judge: the row's own, or its reference row's)
        borrowed = row["row"] in LL_ROWS or row["row"] in (ROW_WORST, ROW_WORST_GRAPH)
        pipe_s = _fmt(pipe) + ("*" if borrowed and pipe is not None else "")
        e = res.get(EPD, {})
        lines.append(
            f"| {row['shape']} {row['row']} | {_fmt(res.get(DEEP_EP, {}).get('p50_us'))} | "
            f"{_fmt(e.get('p50_us'))} | {pipe_s} | "
            f"{_fmt(row['ratios']['epd_over_deep_ep'], 'x')} | "
            f"{_fmt(row['ratios']['epd_over_pipeline'], 'x')} | "
            f"{_fmt(e.get('client_cpu_us_per_call'))} | {_fmt(e.get('engine_cpu_us_per_call'))}"
            f" | {_verdicts(row)} |")
    lines += ["", f"| p90 µs | DeepEP in-process | EPD | {pipe_name} |", "|---|---|---|---|"]
    for row in summary["rows"]:
        res = row["results"]
        lines.append(f"| {row['shape']} {row['row']} | "
                     + " | ".join(_fmt(res.get(i, {}).get("p90_us"))
                                  for i in (DEEP_EP, EPD, PIPELINE)) + " |")
    if any(row["row"] in LL_ROWS for row in summary["rows"]):
        lines.append(f"\n* low-latency rows: the {pipe_name}'s {ROW_FULL} at D")
    if any(row["row"] in (ROW_WORST, ROW_WORST_GRAPH) for row in summary["rows"]):
        lines.append(f"\n* {ROW_WORST} (and its CUDA graph replay): the {pipe_name}'s "
                     f"{ROW_FULL} of the same shape")
    inter = summary.get("expert_intermediate")
    if inter:
        lines.append(f"\nlayer rows (no target: what a forward pass sees): {ROW_FULL} with "
                     f"each received row through an MLP of the FLOPs of top-k / ranks experts "
                     f"of intermediate size {inter} between dispatch and combine; with "
                     f"projection: x @ [hidden, hidden] before the layout, as the attention "
                     f"block's output projection precedes a MoE layer")
    host = [(row, row["results"].get(EPD, {}).get("engine_host_us_per_op"))
            for row in summary["rows"]]
    host = [(row, h) for row, h in host if h]
    if host:
        lines.append("\nengine host per armed op (mean µs): "
                     + "; ".join(f"{row['shape']} {row['row']}: detect {h['detect_us']:.1f}, "
                                 f"launch {h['launch_us']:.1f}" for row, h in host))
    paths = [(row, row["results"].get(EPD, {}).get("low_latency_path"))
             for row in summary["rows"]]
    paths = [(row, ps) for row, ps in paths if ps]
    if paths:
        lines.append("\nEPD's low-latency calls, per rank (armed ops on the GPU chain or the "
                     "engine's poller, or synchronous calls): "
                     + "; ".join(f"{row['row']}: {', '.join(ps)}" for row, ps in paths))
    work = [(row, row["results"].get(EPD, {})) for row in summary["rows"]]
    work = [(row, e) for row, e in work if e.get("client_work_cpu_us_per_call") is not None]
    if work:  # (the targets are on the process CPU above; this is where it goes)
        lines.append("\nEPD host work CPU per call, µs (client thread without its spins for "
                     "replies / engine threads serving requests, without their waits): "
                     + "; ".join(f"{row['shape']} {row['row']}: "
                                 f"{_fmt(e.get('client_work_cpu_us_per_call'))} / "
                                 f"{_fmt(e.get('engine_work_cpu_us_per_call'))}"
                                 for row, e in work))
    threads = [(row, row["results"].get(EPD, {}).get("engine_cpu_us_per_call_by_thread"))
               for row in summary["rows"]]
    threads = [(row, t) for row, t in threads if t]
    if threads:  # (the engine process's CPU above, by its threads' names: the top four)
        lines.append("\nEPD engine process CPU per call by thread, µs: "
                     + "; ".join(f"{row['shape']} {row['row']}: "
                                 + ", ".join(f"{name} {us:.1f}"
                                             for name, us in list(t.items())[:4])
                                 for row, t in threads))
    idle = summary.get("engine_idle")
    if idle and idle.get("core_share") is not None:
        armed = " (the graph rows' captured calls armed)" if idle.get("armed_graphs") else ""
        lines.append(f"\nEPD engine process CPU while idle for {idle['seconds']:.1f} s{armed}: "
                     f"{100 * idle['core_share']:.1f}% of a core"
                     + "".join(f"{', ' if i else ' ('}{name} {100 * share:.1f}%"
                               for i, (name, share)
                               in enumerate(list(idle["core_share_by_thread"].items())[:4]))
                     + (")" if idle["core_share_by_thread"] else ""))
    return "\n".join(lines)


def correctness_lines(checks: list[dict]) -> list[str]:
    """One line per (shape, what, impl, against): passed on every rank or not."""
    grouped: dict[tuple, list[dict]] = {}
    for c in checks:
        grouped.setdefault((c["shape"], c["what"], c["impl"], c["against"], c["rule"]),
                           []).append(c)
    out = []
    for (shape, what, impl, against, rule), cs in grouped.items():
        ok = all(c["passed"] for c in cs)
        exact = all(c["exact"] for c in cs)
        diff = max((c["max_abs_diff"] or 0.0) for c in cs)
        bad = "; ".join(f"rank {c['rank']}: {c['detail']}" for c in cs if not c["passed"])
        out.append(f"{'PASS' if ok else 'FAIL'}  {shape} {what}: {impl} vs {against} "
                   f"({rule}; {'bit-exact' if exact else f'max |diff| {diff:.3g}'})"
                   + (f"  {bad}" if bad else ""))
    return out


def issue_shapes(args: dict, shapes: list[tuple[str, int]]) -> bool:
    """Whether this run is at the issue's model and shapes (else targets are indicative)."""
    return (all(args.get(k) == v for k, v in ISSUE_MODEL.items())
            and all(ISSUE_SHAPES.get(n) == t for n, t in shapes))


def write_json(path: str, summary: dict) -> None:
    with open(path, "w") as f:
        json.dump(summary, f, indent=1, default=str)
        f.write("\n")


def plot(path: str, summary: dict) -> str:
    """Grouped bars of p50 per row and implementation (log scale); a sentence when skipped."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed"
    rows = summary["rows"]
    impls = [i for i in IMPLS if any(i in r["results"] for r in rows)]
    labels = {EPD: "EPD", DEEP_EP: "DeepEP in-process", PIPELINE: summary["pipeline_name"]}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows)), 4.5))
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(rows))]
        ys = [r["results"].get(impl, {}).get("p50_us", float("nan")) for r in rows]
        ax.bar(xs, ys, width, label=labels[impl])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['shape']} {r['row']}" for r in rows], rotation=30, ha="right",
                       fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("p50 µs (slowest rank)")
    ax.set_title(f"epd bench: {summary['ranks']} ranks, {summary.get('gpu') or 'cpu'}, "
                 f"MPS {'on' if summary['mps']['on'] else 'off'}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["LL_ROWS", "NORMAL_ROWS", "correctness_lines", "fold", "issue_shapes", "judge",
           "plot", "table", "write_json"]
