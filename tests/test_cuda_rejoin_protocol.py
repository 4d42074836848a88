"""The CUDA engine's Rejoin collective (server/backends/cuda_rejoin.py, behind
CudaRankComm.rejoin), a host protocol over words of the ranks' control blocks, run here with
the device memory replaced by a dictionary (`device_words`) and the rank streams by stand-ins:
three ranks, rank 2 gone and replaced. What the GPU half needs (the kernels reading those
words) is tests/gpu/test_rank_masking_gpu.py::test_a_replacement_rejoins_on_the_cuda_engine."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from epd.proto import abi
from epd.proto.errors import DeadlineExceeded, EpdError, FailedPrecondition
from epd.server.backends import cuda_rejoin
from epd.server.backends.cuda import CudaRankComm

R, GONE = 3, 2
BLOCK = 1 << 16  # bytes between the ranks' control blocks in the stand-in memory


class Memory:
    """64-bit words by address, shared by every rank (as NVLink peer mappings are)."""

    def __init__(self) -> None:
        self.words: dict[int, int] = {}
        self.lock = threading.Lock()

    def read(self, addr: int) -> int:
        with self.lock:
            return self.words.get(addr, 0)

    def write(self, addr: int, values: list[int]) -> None:
        with self.lock:
            for i, v in enumerate(values):
                self.words[addr + 8 * i] = int(v)

    def word(self, rank: int, word: int) -> int:
        return self.read(rank * BLOCK + 8 * word)


class HostWords:
    def __init__(self, gone: int) -> None:
        self.gone = gone

    def read(self, slot: int) -> tuple[int, int]:
        return 0, self.gone

    def unmark_gone(self, group: int, rank: int) -> None:
        self.gone &= ~(1 << rank)


def _comm(mem: Memory, host: HostWords, rank: int, seqs: tuple[int, int],
          rejoining: bool) -> CudaRankComm:
    c = object.__new__(CudaRankComm)
    idle = SimpleNamespace(synchronize=lambda: None)

    def unmask(q: int) -> None:  # the one-thread kernel: this rank's CTRL_MASK bit
        addr = rank * BLOCK + 8 * abi.CTRL_MASK
        mem.write(addr, [mem.read(addr) & ~(1 << q)])

    c.rank, c.spec = rank, SimpleNamespace(num_ranks=R, name="g")
    c.runner = SimpleNamespace(seq={"ll_dispatch": seqs[0], "ll_combine": seqs[1]},
                               base=rank * BLOCK, stream=idle, side_stream=idle,
                               unmask_rank=unmask)
    c.backend = SimpleNamespace(host_words=host)
    c.peer_bases = [r * BLOCK for r in range(R)]
    c.host_slot, c.group_key, c.rejoining = 0, 0, rejoining
    c.device_words = mem
    return c


def _setup(seqs=((5, 4), (5, 4))):
    mem, host = Memory(), HostWords(1 << GONE)
    for r in (0, 1):  # the survivors' masks say rank 2 went away; its own block was cleared
        mem.write(r * BLOCK + 8 * abi.CTRL_MASK, [1 << GONE])
        mem.write(r * BLOCK + 8 * abi.CTRL_LIVE_MASK, [0])
        mem.write(r * BLOCK + 8 * (abi.CTRL_LL_READY_FLAG + GONE), [1])  # its last call: #1
    comms = [_comm(mem, host, r, seqs[r], False) for r in (0, 1)]
    comms.append(_comm(mem, host, GONE, (0, 0), True))
    return mem, host, comms


def _all(calls) -> list:
    def one(call):
        try:
            return call()
        except EpdError as e:
            return e
    with ThreadPoolExecutor(len(calls)) as ex:
        return list(ex.map(one, calls))


def test_a_replacement_takes_the_sequences_and_every_rank_waits_for_it_again() -> None:
    mem, host, comms = _setup()
    deadline = time.monotonic() + 5
    out = _all([lambda c=c: cuda_rejoin.as_peer(c, GONE, deadline) for c in comms[:2]]
               + [lambda: cuda_rejoin.as_replacement(comms[2], deadline)])
    assert out == [None, None, None], out
    rep = comms[2]
    assert rep.runner.seq == {"ll_dispatch": 5, "ll_combine": 4} and not rep.rejoining
    # Its next call (#6) waits for READY >= 5 and COMBINE_READY >= 4 of every rank: as if all
    # had published #5 into the block cleared at its attach.
    for r in range(R):
        assert mem.word(GONE, abi.CTRL_LL_READY_FLAG + r) == 5
        assert mem.word(GONE, abi.CTRL_LL_COMBINE_READY + r) == 4
    assert mem.word(GONE, abi.CTRL_MASK) == 0 and host.gone == 0
    for r in (0, 1):  # the survivors: rank 2 unmasked, its previous-call flags as if written
        assert mem.word(r, abi.CTRL_MASK) == 0
        assert mem.word(r, abi.CTRL_LL_READY_FLAG + GONE) == 5
        assert mem.word(r, abi.CTRL_LL_COMBINE_READY + GONE) == 4
        for w in (abi.CTRL_REJOIN_HELLO, abi.CTRL_REJOIN_READY, abi.CTRL_REJOIN_ACK):
            assert mem.word(r, w) == 0  # clean for a later rejoin


def test_ranks_at_different_calls_refuse_and_the_rank_stays_masked() -> None:
    mem, _, comms = _setup(seqs=((5, 4), (6, 5)))
    deadline = time.monotonic() + 5
    out = _all([lambda c=c: cuda_rejoin.as_peer(c, GONE, deadline) for c in comms[:2]]
               + [lambda: cuda_rejoin.as_replacement(comms[2], deadline)])
    assert all(isinstance(e, FailedPrecondition) for e in out), out
    assert "different low-latency calls" in out[2].details
    assert comms[2].rejoining  # still refused
    for r in (0, 1):
        assert mem.word(r, abi.CTRL_MASK) == 1 << GONE


@pytest.mark.parametrize("who", ["replacement", "survivor"])
def test_a_missing_party_ends_the_call_at_the_deadline(who: str) -> None:
    mem, _, comms = _setup()
    deadline = time.monotonic() + 0.5
    if who == "replacement":  # rank 1 never calls
        (err,) = _all([lambda: cuda_rejoin.as_replacement(comms[2], deadline)])
        assert isinstance(err, DeadlineExceeded) and "rank(s) [0, 1]" in err.details
        assert comms[2].rejoining
    else:  # the replacement never comes
        (err,) = _all([lambda: cuda_rejoin.as_peer(comms[0], GONE, deadline)])
        assert isinstance(err, DeadlineExceeded) and "replacement for rank 2" in err.details
        assert mem.word(0, abi.CTRL_MASK) == 1 << GONE  # the group goes on without it
