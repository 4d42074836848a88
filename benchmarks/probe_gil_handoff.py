"""How late an engine thread sees a word another process wrote, while other threads of the
engine spin for their own words (a diagnostic of the engine's waits; no GPU needed).

The engine serves each session on a thread that spins between requests (`spin.relax()`:
`sched_yield`, which drops the GIL) and the stream-op poller spins the same way for armed
ops' triggers. Dropping the GIL in a syscall of ~1 µs may not be enough for a thread parked on
the GIL's condition variable: it must wake up before the spinner takes the GIL back, else it
waits again, up to the switch interval (200 µs in the engine). This probe measures it: a writer
process stamps `perf_counter_ns` into shared memory at random gaps, one "looker" thread spins
for the change as the poller does, and N "idle" threads spin for words that never change, as
idle session threads do; the figure is the looker's delay from the stamp to seeing it. The
`futex` rows are the other way to wait: the looker sleeps on the word's futex and the writer
wakes it after writing (as a client wakes an engine thread that sleeps between requests).

    python3 -P benchmarks/probe_gil_handoff.py [--seconds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import sys
import threading
import time

import numpy as np

from epd.proto import ring, spin


def _relax_nanosleep() -> None:
    time.sleep(2e-6)  # (with a fine timer slack: ~3-5 µs without the GIL)


RELAX = {"sched_yield": os.sched_yield, "nanosleep_2us": _relax_nanosleep}


def _writer(buf: mmap.mmap, seconds: float, seed: int, wake: bool) -> None:
    words = np.frombuffer(buf, dtype=np.int64, count=2)
    rng = np.random.default_rng(seed)
    end = time.perf_counter() + seconds
    seq = 0
    while time.perf_counter() < end:
        time.sleep(float(rng.uniform(100e-6, 400e-6)))
        seq += 1
        words[1] = time.perf_counter_ns()
        words[0] = seq  # (x86: stores are not reordered; the looker reads the seq first)
        if wake:
            ring.futex_wake(_addr(buf))


def _addr(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def run(idle: int, relax: str, seconds: float, switch_us: float, futex: bool = False) -> dict:
    sys.setswitchinterval(switch_us * 1e-6)
    buf = mmap.mmap(-1, 4096)
    words = np.frombuffer(buf, dtype=np.int64, count=2)
    idle_words = np.zeros(8, dtype=np.int64)
    stop = False
    relax_fn = RELAX[relax]
    addr = _addr(buf)

    def idle_spin(i: int) -> None:
        while not stop:  # the shape of fast_path._wait_for's spin: a word, a clock, relax
            if idle_words[i] == 1:
                break
            time.perf_counter()
            relax_fn()

    threads = [threading.Thread(target=idle_spin, args=(i,), daemon=True) for i in range(idle)]
    for t in threads:
        t.start()
    writer = mp.get_context("fork").Process(target=_writer, args=(buf, seconds, idle, futex))
    writer.start()
    delays: list[int] = []
    seen = 0
    while writer.is_alive() or int(words[0]) != seen:
        s = int(words[0])
        if s != seen:
            now = time.perf_counter_ns()
            delays.append(now - int(words[1]))
            seen = s
        if futex:  # (the low 32 bits of the sequence word: little-endian)
            ring.futex_wait(addr, seen & 0xFFFFFFFF, 0.01)
        else:
            os.sched_yield()  # the looker spins as the poller does
    writer.join()
    stop = True
    for t in threads:
        t.join()
    d = np.array(delays[5:], dtype=np.float64) / 1e3
    return {"looker": "futex" if futex else "spin", "idle_threads": idle, "idle_relax": relax,
            "switch_us": switch_us,
            "seen": int(d.size), "p50_us": float(np.percentile(d, 50)),
            "p90_us": float(np.percentile(d, 90)), "p99_us": float(np.percentile(d, 99)),
            "max_us": float(d.max())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--json")
    ns = ap.parse_args()
    spin.set_timer_slack_ns(spin.ENGINE_TIMER_SLACK_NS)  # as the engine's threads have it
    rows = []
    for idle in (0, 2):
        r = run(idle, "sched_yield", ns.seconds, 200.0, futex=True)
        rows.append(r)
        print(f"futex looker, idle {idle}:  seen {r['seen']:5d}  delay p50 {r['p50_us']:7.1f}"
              f"  p90 {r['p90_us']:7.1f}  p99 {r['p99_us']:7.1f}  max {r['max_us']:8.0f} us",
              flush=True)
    for switch in (200.0, 20.0):
        for relax in ("sched_yield", "nanosleep_2us"):
            for idle in (0, 1, 2, 4):
                if idle == 0 and relax != "sched_yield":
                    continue
                r = run(idle, relax, ns.seconds, switch)
                rows.append(r)
                print(f"switch {switch:5.0f} us  idle {idle} ({relax:13s})  seen {r['seen']:5d}"
                      f"  delay p50 {r['p50_us']:7.1f}  p90 {r['p90_us']:7.1f}  p99 "
                      f"{r['p99_us']:7.1f}  max {r['max_us']:8.0f} us", flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "python": sys.version, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
