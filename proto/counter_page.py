"""Layout of the per-session counter page, shared by the engine (writer) and the client (reader).

The page is a file under /dev/shm mapped by both processes; the CUDA engine also registers it as
mapped pinned memory so the notify kernel writes it directly. It holds one slot per group
membership of the session. A writer stores the payload, fences, then stores the sequence word;
a reader spins on the sequence word reaching the value it expects, then reads the payload.

Slot layout (little-endian, 8-byte words):
    word 0      sequence (u64): the dispatch sequence number the payload belongs to
    word 1      num_recv_tokens (i64)
    word 2      num_local_experts (i64)
    word 3      status (i64): 0 ok, otherwise an error code (the RPC carries the message)
    word 4      on error: the rank that did not arrive (-1 when unknown), written by the GPU
    word 5..7   reserved
    word 8..    num_recv_tokens_per_expert[i] (i64), aligned as requested
"""

from __future__ import annotations

import time

import numpy as np

from .abi import NUM_SLOTS, SLOT_BYTES
from .abi import SLOT_HEADER as HEADER_WORDS
from .abi import SLOT_NUM_EXPERTS as NUM_EXPERTS
from .abi import SLOT_NUM_RECV as NUM_RECV
from .abi import SLOT_SEQ as SEQ
from .abi import SLOT_STATUS as STATUS

MAX_LOCAL_EXPERTS = SLOT_BYTES // 8 - HEADER_WORDS  # 504
PAGE_BYTES = SLOT_BYTES * NUM_SLOTS


def slot_words(buf: memoryview | np.ndarray, slot: int) -> np.ndarray:
    """An int64 view of one slot of a mapped page (host side)."""
    arr = np.frombuffer(buf, dtype=np.int64, count=SLOT_BYTES // 8, offset=slot * SLOT_BYTES)
    return arr


def publish(words: np.ndarray, sequence: int, num_recv_tokens: int,
            per_expert: list[int] | np.ndarray, status: int = 0) -> None:
    """Host-side writer (CPU backend). x86 stores are not reordered with other stores, and NumPy
    writes the payload before the sequence store below, so a reader that sees the new sequence
    sees the payload too."""
    n = len(per_expert)
    words[HEADER_WORDS:HEADER_WORDS + n] = per_expert
    words[NUM_RECV] = num_recv_tokens
    words[NUM_EXPERTS] = n
    words[STATUS] = status
    words[SEQ] = sequence


def wait(words: np.ndarray, sequence: int, timeout: float) -> tuple[int, list[int]] | None:
    """Spin (then back off) until the slot carries `sequence`; None on timeout."""
    deadline = time.monotonic() + timeout
    spins = 0
    while int(words[SEQ]) < sequence:
        spins += 1
        if spins > 2000:
            if time.monotonic() > deadline:
                return None
            time.sleep(20e-6)
    n = int(words[NUM_EXPERTS])
    return int(words[NUM_RECV]), [int(v) for v in words[HEADER_WORDS:HEADER_WORDS + n]]
