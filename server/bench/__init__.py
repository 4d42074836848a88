"""`epd bench`: the end-to-end benchmark of issue 10, what a user of the DeepEP API gets.

One invocation runs, with the same inputs (fixed seed) on one machine:

- EPD through its DeepEP facade (`from epd.client import buffer as deep_ep`), one process per
  rank with torch tensors, against a daemon the bench starts (or `--socket-dir`'s);
- DeepEP V1 in-process (a real `deep_ep`, cuda backend, one GPU per rank), else skipped with
  the reason printed;
- the MoE all-to-all with torch.distributed alone (NCCL on cuda, gloo on cpu): layout, count
  exchange with a host sync, all_to_all_single there and back, index_add.

Rows: layout + dispatch + combine, cached dispatch and combine at each shape (P = 4096, D = 128
tokens/rank), and the same layer with the experts' MLPs between the calls, with and without a
projection before it (what a forward pass does: the host work of a stream-ordered call can
hide behind the GPU work queued before it); with `--low-latency`,
FP8 low_latency_dispatch + bf16 low_latency_combine at D as plain calls, with receive hooks,
and as a CUDA graph replay (cuda). Per row: p50/p90 of the
slowest rank's host wall time per iteration (barrier, t0, calls, device synchronise, t1),
client and engine CPU per call, the issue's targets, and a correctness check of EPD's combined
output (bit-exact against DeepEP, within bf16 rounding against the pipeline). Table on stdout,
`--json` for the record, `--plot` for a chart. docs/BENCHMARKS.md says how to run it.

    epd bench --json out.json                                   # GPUs: one rank per GPU
    epd bench --backend cpu --tokens 64,16 --hidden 256 --experts 16 --topk 4
"""

from __future__ import annotations

import argparse
from typing import Any

from ..backends import BACKEND_NAMES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", choices=("auto", *BACKEND_NAMES),
                   help="backend of the daemon the bench starts (ignored with --socket-dir)")
    p.add_argument("--socket-dir", default="",
                   help="use the daemon running on this socket folder instead of starting one")
    p.add_argument("--engines", type=int, default=0,
                   help="engines of the daemon the bench starts (default: one per GPU, 2 on "
                        "the cpu backend)")
    p.add_argument("--ranks", type=int, default=0,
                   help="EP ranks, one process each (default: the number of GPUs; 2 on cpu "
                        "or with one GPU, where both share it and NCCL/DeepEP are skipped "
                        "unless --deep-ep-shared-gpu)")
    p.add_argument("--shapes", default="P,D",
                   help="comma list of P (4096 tokens/rank) and D (128 tokens/rank)")
    p.add_argument("--tokens", default="",
                   help="tokens per rank: one value for every shape, or one per shape")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=40, help="timed iterations per row")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations before them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--low-latency", action="store_true",
                   help="add the low-latency rows at shape D (plain, hooks, CUDA graph)")
    p.add_argument("--expert-intermediate", type=int, default=None, metavar="F",
                   help="the layer rows: layout + dispatch + the experts' MLPs on the "
                        "received rows (intermediate size F per expert, top-k / ranks experts "
                        "per row) + combine, as a forward pass calls them, and the same after "
                        "an [H, H] projection of x (the attention block's output); 0 leaves "
                        "them out (default: 2048, DeepSeek-V3's expert size, on cuda; 0 on cpu)")
    p.add_argument("--deep-ep-shared-gpu", action="store_true",
                   help="run DeepEP's normal mode even where ranks share a GPU (several rank "
                        "processes per GPU, on the daemon's MPS server so that their kernels "
                        "run at once): the one-GPU comparison of the daemon's hop with "
                        "DeepEP in-process. Its low-latency rows and the NCCL pipeline still "
                        "need one GPU per rank")
    p.add_argument("--skip", default="",
                   help="comma list of parts not to run: deep_ep, deep_ep_ll (DeepEP's "
                        "low-latency rows only), pipeline, graph")
    p.add_argument("--fresh-inputs", action="store_true",
                   help="hand every timed call new tensor objects (views of the same data, as "
                        "a model's next layer makes new activations at addresses its allocator "
                        "reuses) instead of the same objects each iteration: what a caller "
                        "pays where a per-object cache misses (the facade's rows; a CUDA "
                        "graph's replay and the pipeline take none)")
    p.add_argument("--json", default="", help="write every figure and check to this file")
    p.add_argument("--plot", default="", help="write a bar chart (needs matplotlib)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds for all ranks to finish every row")
    p.add_argument("--collective-timeout", type=float, default=120.0,
                   help="seconds a rendezvous or torch.distributed collective may wait")
    p.add_argument("--call-timeout", type=float, default=60.0,
                   help="deadline of an EPD call (and the started daemon's --timeout-seconds)")
    p.add_argument("--daemon-start-timeout", type=float, default=180.0,
                   help="seconds for the started daemon to become ready")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the started `epd serve` (repeat; "
                        "e.g. --serve-arg=--ll-num-sms=32)")
    p.add_argument("--quiet", action="store_true", help="only the table and the verdicts")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="on failure, print the rank's traceback or the daemon's log too")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`epd bench` under the CLI's subcommands."""
    p = subparsers.add_parser("bench", help="end-to-end benchmark: EPD's DeepEP facade vs "
                              "DeepEP vs an NCCL/gloo pipeline",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(ns: argparse.Namespace) -> int:
    from .runner import run_bench
    return run_bench(ns)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epd bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


__all__ = ["add_arguments", "add_parser", "main", "run"]
