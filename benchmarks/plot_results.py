"""Plot the recorded benchmark figures (docs/benchmarks_h200x2.png) from the JSON results.

    python benchmarks/plot_results.py      # needs matplotlib (not a runtime dependency)
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
KERNELS = HERE / "results" / "results_2026-11-30_h200x2.json"
DAEMON = HERE / "results" / "results_2026-11-30_daemon_h200x2.json"
OUT = HERE.parent / "docs" / "benchmarks_h200x2.png"
# DeepEP's figures from ../shared/DESIGN.md §9: an earlier run (2x H200, 2026-11-30), not
# the run plotted beside them
DEEPEP_P = {"dispatch": 325.7, "combine": 403.2, "end to end": 999.0}
TARGET_P = {"dispatch": 283.0, "combine": 350.0, "end to end": 900.0}


def main() -> None:
    k = json.loads(KERNELS.read_text())
    d = json.loads(DAEMON.read_text())
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))

    phases = ["dispatch", "combine", "end to end"]
    series = {
        "EPD kernels, 24 SMs": [k["epd"]["P_sms24"]["dispatch"], k["epd"]["P_sms24"]["combine"],
                                k["epd"]["P_sms24"]["layout_notify_dispatch_combine"]],
        "EPD kernels, 132 SMs": [k["epd"]["P_sms132"]["dispatch"],
                                 k["epd"]["P_sms132"]["combine"],
                                 k["epd"]["P_sms132"]["layout_notify_dispatch_combine"]],
        "DeepEP V1, 24 SMs (§9)": [DEEPEP_P[p] for p in phases],
    }
    width = 0.26
    for i, (name, vals) in enumerate(series.items()):
        xs = [j + (i - 1) * width for j in range(len(phases))]
        a.bar(xs, vals, width, label=name)
    for j, p in enumerate(phases):
        a.hlines(TARGET_P[p], j - 1.5 * width, j + 1.5 * width, colors="k", linestyles="--")
    a.set_xticks(range(len(phases)), phases)
    a.set_ylabel("µs (median)")
    nccl = k["nccl_pipeline_us"]["P"]
    a.set_title("Config P on 2x H200: 4096 tok/rank, hidden 7168, top-8/256\n"
                f"dashed: targets; NCCL pipeline {nccl:.0f} µs")
    a.legend(fontsize=8)

    cfgs = ["P", "D"]
    parts = ["layout", "dispatch", "combine"]
    bottom = [0.0, 0.0]
    for part in parts:
        vals = [d[c]["clients"][0]["median_us"][part] for c in cfgs]
        b.bar(cfgs, vals, bottom=bottom, label=f"{part} (client-observed, gRPC)")
        bottom = [x + y for x, y in zip(bottom, vals, strict=True)]
    kern = [k["epd"]["P_sms24"]["layout_notify_dispatch_combine"],
            k["epd"]["D_sms24"]["layout_notify_dispatch_combine"]]
    b.scatter(cfgs, kern, color="k", zorder=3, label="kernels alone, 24 SMs")
    b.set_ylabel("µs (median)")
    b.set_title("Through the daemon on the gRPC path (2 client processes)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print(OUT)


if __name__ == "__main__":
    main()
