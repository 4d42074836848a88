"""What the replays of DeepEP's own tests (tests/test_deepep_*_replay.py) share: ranks as threads
of this process, the ProcessGroup those tests hand DeepEP with the collectives they run on it
(all-gather, all-reduce), and their helper arithmetic (FP8 back to bf16, DeepEP's diff)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from epd.client import EpdError


class ThreadGroup:
    """rank()/size() as a torch.distributed ProcessGroup, plus all_gather/all_reduce/barrier
    between the rank threads of one `run_ranks` call."""

    def __init__(self, rank: int, size: int, shared: dict) -> None:
        self._rank, self._size, self._shared = rank, size, shared

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def _exchange(self, t) -> list:
        self._shared["parts"][self._rank] = t.clone()
        self._shared["barrier"].wait(timeout=60)
        parts = list(self._shared["parts"])
        self._shared["barrier"].wait(timeout=60)
        return parts

    def barrier(self) -> None:
        self._shared["barrier"].wait(timeout=60)

    def all_gather(self, t):
        return torch.stack(self._exchange(t))

    def all_reduce(self, t):
        parts = self._exchange(t)
        return sum(parts[1:], parts[0].clone())


def use_daemon(daemon, monkeypatch) -> None:
    """The user's environment: EPD_SOCKET_DIR names the daemon; engine 0 (no CUDA here)."""
    monkeypatch.setenv("EPD_SOCKET_DIR", daemon.socket_dir)
    for k in ("EPD_ENGINE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def run_ranks(fn, num_ranks: int, timeout: float = 240) -> list[Any]:
    """fn(rank, group) on every rank at once; the results by rank. A failing rank makes its
    peers fail too (its leave aborts the group): the first failure is raised, not theirs."""
    shared = {"parts": [None] * num_ranks, "barrier": threading.Barrier(num_ranks)}
    results: list[Any] = [None] * num_ranks

    def run(r: int) -> None:
        try:
            results[r] = fn(r, ThreadGroup(r, num_ranks, shared))
        except BaseException as e:  # raised below
            results[r] = e
            shared["barrier"].abort()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"ranks {hung} did not finish within {timeout} s"
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise min(errors, key=lambda e: isinstance(e, EpdError) and e.code.name == "ABORTED")
    return results


def dequant(fp8, scales):
    """FP8 rows [N, H] times their per-128-channel scales [N, H/128] (float32, or int32 words
    of four UE8M0 exponent bytes), as bf16."""
    n, h = fp8.shape
    if scales.dtype == torch.int32:
        exps = scales.contiguous().view(torch.uint8).view(n, -1).to(torch.int32)
        scales = (exps << 23).view(torch.float32)
    x = fp8.float().view(n, h // 128, 128) * scales.float().view(n, h // 128, 1)
    return x.view(n, h).to(torch.bfloat16)


def diff(x, y) -> float:
    """1 - cosine-like similarity of x + 1 and y + 1 (the metric of DeepEP's tests)."""
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())
