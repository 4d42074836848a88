"""The Rejoin collective on the cuda engine: a replacement process takes a gone rank's place
in a shrink group (DeepEP's shrink mode), host-driven through words of the ranks' control
blocks (abi CTRL_REJOIN_*), with no kernel of its own.

1. The replacement writes a nonce (HELLO) into the control block of every rank that takes
   part.
2. Each of those ranks, once its own kernels are done, answers in its own block with its
   low-latency sequences and READY = nonce.
3. The replacement takes the sequences (they must agree: the ranks call Rejoin at the same
   point), the gone and live masks, and writes ACK = nonce (or nonce | REFUSED).
4. Each taking-part rank clears the rank's bit in its own mask; from the next call on every
   rank waits for the replacement.

A deadline anywhere leaves the rank masked and the group going on without it.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import TYPE_CHECKING

from ...proto import abi
from ...proto.errors import DeadlineExceeded, FailedPrecondition
from .cuda_memory import DeviceWords

if TYPE_CHECKING:
    from .cuda import CudaRankComm

log = logging.getLogger("epd.cuda")

REFUSED = 1 << 62  # ACK = nonce | REFUSED: the ranks' sequences disagree
POLL_SECONDS = 200e-6


class _Words:
    """A rank's reads and writes of control-block words (its comm's `device_words`: device
    memory through NVLink peer mappings, or a test's stand-in)."""

    def __init__(self, comm: CudaRankComm) -> None:
        self.mem: DeviceWords = comm.device_words

    def get(self, base: int, word: int) -> int:
        return self.mem.read(base + 8 * word)

    def set(self, base: int, word: int, value: int) -> None:
        self.mem.write(base + 8 * word, [value])

    def fill(self, base: int, first: int, count: int, value: int) -> None:
        """Words first .. first + count - 1 of a control block, all to `value`."""
        self.mem.write(base + 8 * first, [value] * count)


def as_replacement(comm: CudaRankComm, deadline: float) -> None:
    """Steps 1 and 3, on the replacement (`comm` is its rank)."""
    spec, q, bases, rt = comm.spec, comm.rank, comm.peer_bases, comm.runner
    words = _Words(comm)
    gone = comm.backend.host_words.read(comm.host_slot)[1]
    for r in range(spec.num_ranks):  # (a gone rank's own block may be cleared)
        if r != q:
            gone |= words.get(bases[r], abi.CTRL_MASK)
    gone &= ~(1 << q)
    peers = [r for r in range(spec.num_ranks) if r != q and not (gone >> r) & 1]
    nonce = secrets.randbits(61) | 1
    for r in peers:
        words.set(bases[r], abi.CTRL_REJOIN_HELLO, nonce)
    while not all(words.get(bases[r], abi.CTRL_REJOIN_READY) == nonce for r in peers):
        if time.monotonic() > deadline:
            missing = [r for r in peers if words.get(bases[r], abi.CTRL_REJOIN_READY) != nonce]
            raise DeadlineExceeded(f"group {spec.name!r}: rank(s) {missing} did not call Rejoin "
                                   f"for rank {q} before the deadline")
        time.sleep(POLL_SECONDS)
    seqs = {(words.get(bases[r], abi.CTRL_REJOIN_LL_DISPATCH),
             words.get(bases[r], abi.CTRL_REJOIN_LL_COMBINE)) for r in peers}
    if len(seqs) > 1:
        for r in peers:
            words.set(bases[r], abi.CTRL_REJOIN_ACK, nonce | REFUSED)
        raise FailedPrecondition(f"group {spec.name!r}: the ranks that take part are at "
                                 f"different low-latency calls {sorted(seqs)}: call Rejoin at "
                                 f"the same point on every rank")
    if seqs:
        rt.seq["ll_dispatch"], rt.seq["ll_combine"] = seqs.pop()
        words.set(rt.base, abi.CTRL_LIVE_MASK, words.get(bases[peers[0]], abi.CTRL_LIVE_MASK))
    # A low-latency call first waits until every rank published the previous dispatch
    # (READY >= seq - 1) and reduced the previous combine: flags the peers wrote into this
    # block before it was cleared at attach. Say so for every rank, this one included.
    words.fill(rt.base, abi.CTRL_LL_READY_FLAG, spec.num_ranks, rt.seq["ll_dispatch"])
    words.fill(rt.base, abi.CTRL_LL_COMBINE_READY, spec.num_ranks, rt.seq["ll_combine"])
    words.set(rt.base, abi.CTRL_MASK, gone)
    comm.backend.host_words.unmark_gone(comm.group_key, q)
    comm.rejoining = False
    for r in peers:
        words.set(bases[r], abi.CTRL_REJOIN_ACK, nonce)
    log.warning("group %r: rank %d rejoined (taking part from low-latency dispatch #%d)",
                spec.name, q, rt.seq["ll_dispatch"] + 1)


def as_peer(comm: CudaRankComm, q: int, deadline: float) -> None:
    """Steps 2 and 4, on a rank that takes part (`q`: the rank being replaced)."""
    name, rt, base = comm.spec.name, comm.runner, comm.runner.base
    words = _Words(comm)
    rt.stream.synchronize()  # this rank's calls before the rejoin are done
    rt.side_stream.synchronize()
    published = 0
    try:
        while True:
            hello = words.get(base, abi.CTRL_REJOIN_HELLO)
            if hello and hello != published:  # (a newer replacement: answer it)
                words.set(base, abi.CTRL_REJOIN_LL_DISPATCH, rt.seq["ll_dispatch"])
                words.set(base, abi.CTRL_REJOIN_LL_COMBINE, rt.seq["ll_combine"])
                words.set(base, abi.CTRL_REJOIN_READY, hello)
                published = hello
            ack = words.get(base, abi.CTRL_REJOIN_ACK) if published else 0
            if published and ack == published:
                break
            if published and ack == published | REFUSED:
                raise FailedPrecondition(f"group {name!r}: the ranks that take part disagreed "
                                         f"on their low-latency calls; rank {q} stays masked")
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"group {name!r}: the replacement for rank {q} did not "
                                       f"rejoin before the deadline; the group goes on "
                                       f"without it")
            time.sleep(POLL_SECONDS)
    finally:
        for w in (abi.CTRL_REJOIN_HELLO, abi.CTRL_REJOIN_READY, abi.CTRL_REJOIN_ACK):
            words.set(base, w, 0)
    # The next call waits for the replacement's READY / COMBINE_READY of the previous one
    # (seq - 1), which the rank it replaces never wrote: as if it had.
    words.set(base, abi.CTRL_LL_READY_FLAG + q, rt.seq["ll_dispatch"])
    words.set(base, abi.CTRL_LL_COMBINE_READY + q, rt.seq["ll_combine"])
    rt.unmask_rank(q)
    comm.backend.host_words.unmark_gone(comm.group_key, q)
