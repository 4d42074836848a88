"""Summarise py-spy's raw (collapsed) output per process: where the sampled CPU went.

    python3 benchmarks/spy_summary.py spy_raw.txt.gz [--top 30] [--match dispatch]

Each line of py-spy's raw format is `frame;frame;...;frame COUNT`, the first frames naming the
process (with --subprocesses) and thread (with --threads). Per process: samples, the leaf
frames (self time) and the frames on the stack (inclusive), most first; `--match` keeps the
stacks that pass through a frame containing that text.
"""

from __future__ import annotations

import argparse
import collections
import gzip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--match", default="")
    ns = ap.parse_args()
    opener = gzip.open if ns.path.endswith(".gz") else open
    total: collections.Counter[str] = collections.Counter()
    leaf: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    incl: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with opener(ns.path, "rt") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            # (with --subprocesses a child's frames follow its parent's process frame)
            at = max(i for i, fr in enumerate(frames) if fr.startswith("process ") or i == 0)
            proc = frames[at][:90]
            body = [fr for fr in frames[at + 1:] if not fr.startswith("thread ")]
            if ns.match and not any(ns.match in fr for fr in body):
                continue
            total[proc] += n
            if body:
                leaf[proc][body[-1]] += n
            for fr in set(body):
                incl[proc][fr] += n
    for proc, n in total.most_common():
        print(f"\n=== {proc}: {n} samples")
        print("  -- self")
        for fr, c in leaf[proc].most_common(ns.top):
            print(f"  {c:7d} {100 * c / n:5.1f}%  {fr[:150]}")
        print("  -- on the stack")
        for fr, c in incl[proc].most_common(ns.top):
            print(f"  {c:7d} {100 * c / n:5.1f}%  {fr[:150]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
