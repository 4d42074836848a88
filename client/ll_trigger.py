"""The trigger of an armed low-latency op (cuda engine): one single-thread kernel on the
caller's stream.

It clears the op's done word (or, once the client's session has ended and set the ring's
released word, reports RELEASED there and stops: nothing would run it), takes the member's
next ring entry (the ring, its tail and head are int32 words of the member's ring slot in the
session's counter page, mapped host memory), writes `entry` there and publishes
`tail = k + 1`; the engine's poller (server/engine/stream_ops.py), or the member's GPU chain
waiting for that tail (or, with its instances as CUDA graphs, for the entry itself:
server/backends/cuda_chain.py), runs the op, in ring order. A kernel rather than stream
memory writes because k is only known on the GPU: a CUDA graph replays the same writes, and
the same kernel reads the tail anew each time. The ring holds 64 entries; when the engine is
that far behind, the kernel waits for the head (back-pressure) up to its deadline, then fails
the call through the done word instead of overwriting an entry; a session that ends during
that wait (the released word) ends it at once with RELEASED.
"""

from __future__ import annotations

from ..proto import abi
from .cuda_ipc import compiled_kernel, launch_packed

_SOURCE = rf"""
extern "C" __global__ void epd_ll_trigger(unsigned* done, unsigned* ring, unsigned entry,
                                          long long timeout_ns) {{
    if (threadIdx.x != 0) return;
    volatile unsigned* r = ring;
    *reinterpret_cast<volatile unsigned*>(done) = 0u;
    // Cleared first, then the released word read after a system fence: the client sets that
    // word before it writes RELEASED into the done word, so either this thread sees it, or
    // the client's RELEASED lands after the clear (release() and the trigger cannot both miss).
    __threadfence_system();
    if (r[{abi.LL_RING_RELEASED}] != 0u) {{
        *reinterpret_cast<volatile unsigned*>(done) = {abi.DONE_RELEASED}u;
        return;
    }}
    const unsigned k = r[{abi.LL_RING_TAIL}];
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    while (k - r[{abi.LL_RING_HEAD}] >= {abi.LL_RING}u) {{
        if (r[{abi.LL_RING_RELEASED}] != 0u) {{  // the session ended meanwhile: nobody will
            // free an entry, so waiting out the deadline would only hold the caller's stream
            *reinterpret_cast<volatile unsigned*>(done) = {abi.DONE_RELEASED}u;
            return;
        }}
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if ((long long)(now - start) > timeout_ns) {{
            __threadfence_system();
            *reinterpret_cast<volatile unsigned*>(done) =
                {abi.DONE_FAILED}u | ({abi.ERR_RING_FULL}u << {abi.DONE_CODE_SHIFT});
            return;
        }}
    }}
    // The head read above before the entry's store (a read and a fence: an acquire), as the
    // chain's last kernel clears this position before it publishes that head.
    __threadfence_system();
    r[k % {abi.LL_RING}u] = entry;
    __threadfence_system();
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(ring + {abi.LL_RING_TAIL}),
                 "r"(k + 1u) : "memory");
}}
"""

TRIGGER_ARGS = "QQIq"  # the kernel's parameters: done, ring, entry (u32), timeout (ns)
MAX_TIMEOUT_NS = 2**63 - 1  # (a finite deadline of centuries still packs as an i64)


def load(device: int) -> None:
    """Compile and load the kernel now (when a group is made: never inside a CUDA graph
    capture)."""
    compiled_kernel(_SOURCE, "epd_ll_trigger", device)


def trigger(stream: int, device: int, done_ptr: int, ring_ptr: int, entry: int,
            timeout: float) -> None:
    """Enqueue the trigger on `stream` (a raw handle); pointers as this process's streams
    address the counter page."""
    launch_packed(compiled_kernel(_SOURCE, "epd_ll_trigger", device), (1, 1), 32, stream,
                  TRIGGER_ARGS, (done_ptr, ring_ptr, entry & 0xFFFFFFFF,
                                 min(int(timeout * 1e9), MAX_TIMEOUT_NS)), device)
