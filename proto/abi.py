"""The binary interface shared by Python (client, engine, CUDA driver) and the CUDA kernels.

One definition of every number both sides must agree on. cuda/epd_common.cuh and the kernel
files repeat them as #defines (NVRTC compiles them without Python); tests/test_abi.py parses the
CUDA sources and fails when a value drifts, and checks every launch's argument list against the
kernel's signature.
"""

from __future__ import annotations

# -- ranks -------------------------------------------------------------------------------------
MAX_RANKS = 8  # EPD_MAX_RANKS: most ranks of a normal-mode CUDA group (a bit each in a mask)
LL_MAX_RANKS = 64  # most ranks of a low-latency CUDA group (one bit each in the u64 masks)
LL_MAX_EXPERTS = 8192  # low-latency mode: experts of a group (the dispatch's per-expert counts)
MAX_TOPK = 32  # largest num_topk the intranode kernels take
LL_MAX_LOCAL_EXPERTS = 1024  # low-latency mode: local experts per rank
LL_ROW_OVERFLOW = -(1 << 62)  # bad-input value of a low-latency row past m: this - row
ALIGN = 256  # alignment of every sub-buffer of a rank's heap slot (bytes)

# -- launch shapes (the kernels' __launch_bounds__) ----------------------------------------------
NOTIFY_THREADS = 1024
DATA_THREADS = 512
LL_THREADS = 512
DEFAULT_NUM_SMS = 24  # blocks of the normal-mode data kernels unless --num-sms says otherwise
DEFAULT_LL_NUM_SMS = 64  # blocks of the low-latency kernels unless --ll-num-sms says otherwise

# -- control block at the start of every rank buffer (u64 words) -------------------------------
CTRL_ABORT = 0  # nonzero: the group was aborted (value = code)
CTRL_ERR_CODE = 1  # first error seen by this rank's kernels
CTRL_ERR_RANK = 2  # the rank that did not arrive (or -1)
CTRL_ERR_PHASE = 3  # which wait failed (PHASE_*)
CTRL_ERR_SEQ = 4  # sequence of the failed collective
CTRL_CALL_ERR = 5  # a layout's bad input, this rank's own (code; cleared when reported)
CTRL_CALL_ERR_VALUE = 7  # the offending value (an expert id)
# CTRL_CALL_ERR while its first reporter writes the value (then the code): a host that reads
# the words while the kernel runs (the client's layout check) waits for the code
CALL_ERR_CLAIMED = 0xFFFF
CTRL_TICKET = 6
CTRL_NOTIFY_FLAG = 8
CTRL_DISPATCH_FLAG = 16
CTRL_DISPATCH_ENTRY = 24
CTRL_COMBINE_FLAG = 32
CTRL_COMBINE_ENTRY = 40
# [R] hierarchical normal mode (a group over nodes placed node-major): source s's tokens with
# an expert on this rank's node, posted by its notify (the forwarder's rail rows before it)
CTRL_NODE_TOKENS = 48
# [R] source s's engine refused its part of the combine of this sequence (its refused kernel
# writes it before its push flag; the peers' reduces report ERR_REFUSED naming s)
CTRL_COMBINE_REFUSED = 56
CTRL_MASK = 80  # bit r: rank r went away (shrink groups): the kernels' waits skip it
CTRL_HOST_WORDS = 96  # device address of the rank's host words (mapped host memory; 0: none)
HOST_WORD_ABORT = 0  # host word: the group's abort code, written by the engine's host
HOST_WORD_GONE = 1  # host word: bit r = rank r went away (shrink groups)
HOST_POLL_AFTER_NS = 1_000_000  # a kernel's wait reads the host words only after 1 ms
CTRL_LIVE_MASK = 97  # bit r: rank r is masked by a call (alive, so its flags are still awaited)
# Rejoin of a replacement (server/backends/cuda.py, CudaRankComm.rejoin), host-written words:
CTRL_REJOIN_HELLO = 98  # the replacement's nonce, written into each taking-part rank's block
CTRL_REJOIN_READY = 99  # a taking-part rank arrived (= the nonce); its sequences below
CTRL_REJOIN_LL_DISPATCH = 100  # that rank's low-latency dispatch sequence
CTRL_REJOIN_LL_COMBINE = 101  # that rank's low-latency combine sequence
CTRL_REJOIN_ACK = 102  # the replacement took the sequences (= the nonce)
# low-latency flags, [LL_MAX_RANKS] each
CTRL_LL_DISPATCH_FLAG = 128
CTRL_LL_COMBINE_FLAG = 192
CTRL_LL_READY_FLAG = 256
CTRL_LL_COMBINE_READY = 320
CTRL_LL_HIST_FLAG = 384  # source s posted its low-latency dispatch histogram
CTRL_LL_SEEN = 448  # the ranks source s saw masked or gone when it posted its histogram
CTRL_PAYLOAD_BYTES = 4096  # notify payload: [MAX_RANKS][NOTIFY_HEAD + L] int32 per source slot
NOTIFY_TOKENS = 8  # EPD_MAX_RANKS: a payload's word holding the source's token count
NOTIFY_BAD = 9  # then its bad input: code, value's low and high 32 bits (a whole group's dispatch)
NOTIFY_HEAD = 12  # words before a payload's per-expert counts (counts, tokens, bad input)
# A notify-only slot of more than MAX_RANKS ranks (a two-stage group's whole-group notify,
# epd_wide_notify): its flags, then [R][R + 4 + L] int32 per source (counts, tokens, bad
# input, experts), in the payload region.
WIDE_NOTIFY_FLAG = CTRL_PAYLOAD_BYTES // 8  # u64 word: [LL_MAX_RANKS] flags
WIDE_PAYLOAD_BYTES = CTRL_PAYLOAD_BYTES + LL_MAX_RANKS * 8

# abort word = ((rank + 1) << ABORT_RANK_SHIFT) | ERR_ABORTED: peers learn who left
ABORT_RANK_SHIFT = 8

# -- error codes (control block, counter-page status, stream-op done word) ---------------------
ERR_DEADLINE = 1
ERR_ABORTED = 2
ERR_WORST_OVERFLOW = 3
ERR_BAD_INPUT = 4  # an expert id out of range
ERR_BAD_COUNT = 5  # a negative num_tokens_per_expert of a dispatch without top-k
ERR_NOT_FILLED = 6  # a chained combine whose receive buffer holds another dispatch (not run)
ERR_RING_FULL = 7  # a trigger found no free entry in its member's ring before its deadline
# a source dispatched more tokens than max_tokens_per_rank: every rank fails the call alike
# (counter slot: NUM_RECV = the largest token count, ERR_RANK = its rank); the group goes on
ERR_CAPACITY = 8
# A rank's engine refused its part of a stream-ordered dispatch (its descriptors): it took part
# with no tokens and this verdict, so every rank fails the call (counter slot: ERR_RANK = it).
ERR_REFUSED = 9
# A low-latency dispatch's token names one expert twice (its verdict, as ERR_BAD_INPUT for an id
# outside [-1, E)): every rank fails the call, nothing moves, the group goes on.
ERR_BAD_DUPLICATE = 10
# A low-latency combine's top-k names an expert its dispatch did not send that token to (its
# verdict; ERR_BAD_DUPLICATE: an expert twice in the row): that rank's combine fails and its
# output leaves the entry out; the other ranks' combines are exact, nothing aborts.
ERR_NOT_DISPATCHED = 11
# The ranks of a low-latency dispatch passed different num_max_dispatch_tokens_per_rank or
# use_fp8 (its verdict): every rank fails the call, nothing moves, the group goes on.
ERR_DISAGREE = 12
ERROR_NAMES = {ERR_DEADLINE: "deadline exceeded", ERR_ABORTED: "aborted",
               ERR_WORST_OVERFLOW: "more tokens received than num_worst_tokens",
               ERR_BAD_INPUT: "bad expert id", ERR_BAD_COUNT: "negative token count",
               ERR_NOT_FILLED: "the receive buffer holds another dispatch",
               ERR_RING_FULL: "the member's trigger ring stayed full",
               ERR_CAPACITY: "more tokens than max_tokens_per_rank",
               ERR_REFUSED: "a rank's engine refused its part of the call",
               ERR_BAD_DUPLICATE: "an expert named twice in a token's top-k",
               ERR_NOT_DISPATCHED: "a combine entry its dispatch did not send",
               ERR_DISAGREE: "the ranks passed different arguments"}

PHASE_NOTIFY = 1
PHASE_DISPATCH_ENTRY = 2
PHASE_DISPATCH_DONE = 3
PHASE_COMBINE_ENTRY = 4
PHASE_COMBINE_DONE = 5
PHASE_LL_DISPATCH = 6
PHASE_LL_COMBINE = 7
PHASE_NAMES = {PHASE_NOTIFY: "notify", PHASE_DISPATCH_ENTRY: "dispatch entry",
               PHASE_DISPATCH_DONE: "dispatch completion", PHASE_COMBINE_ENTRY: "combine entry",
               PHASE_COMBINE_DONE: "combine completion",
               PHASE_LL_DISPATCH: "low-latency dispatch", PHASE_LL_COMBINE: "low-latency combine"}

# -- counter page (proto/counter_page.py describes the protocol) -------------------------------
SLOT_BYTES = 4096
NUM_SLOTS = 64
SLOT_SEQ = 0
SLOT_NUM_RECV = 1
SLOT_NUM_EXPERTS = 2
SLOT_STATUS = 3
SLOT_ERR_RANK = 4  # on error: the rank that did not arrive, or whose input failed it (or -1)
SLOT_HEADER = 8  # per-expert counts start at this word

# Stream-ordered normal-mode calls: int32 words of the membership's counter slot (after the
# int64 header words 0..4; the ready ring at the slot's end). The client's stream writes
# READY[seq % READY_RING] = seq, the engine's stream waits for it before the call's kernels, and
# the call's last kernel writes FAIL_* (on failure) then DONE = seq, which the client's stream
# waits for.
SLOT32_DONE = 10
SLOT32_FAIL_SEQ = 11  # the latest stream sequence that failed (0: none yet)
SLOT32_FAIL_CODE = 12  # its error code | phase << 8
SLOT32_FAIL_RANK = 13  # the rank at fault (bad input: this rank; deadline: the missing one)
SLOT_FAIL_VALUE = 7  # int64 word: the offending value (bad input) or the failed sequence
READY_RING = 32
SLOT32_READY = SLOT_BYTES // 4 - READY_RING  # 992

# -- stream-ordered ops: int32 words of the op's record ------------------------------------------
# An armed op's words are a record of OP_RECORD_BYTES in a counter slot (OP_RECORDS to a slot, so
# that a session's captured calls are not bounded by its 64 slots; ArmStreamOpResponse names the
# slot and the record). A client that does not ask for records gets record 0 of a slot of its own.
OP_RECORD_BYTES = 64
OP_RECORDS = SLOT_BYTES // OP_RECORD_BYTES
# (STREAM_REQUEST: the request word of the earlier doorbell design, which the engine no longer
# reads; the ring below replaced it. STREAM_DONE: the done word the op's last kernel writes.)
STREAM_REQUEST, STREAM_DONE = 0, 1
# A low-latency dispatch that a source's bad ids failed on every rank (done = DONE_FAILED | code
# << DONE_CODE_SHIFT | (source + 1) << DONE_RANK_SHIFT | (sequence & 0x7F) << DONE_SEQ_SHIFT):
# the id (int64 word) and its token (int32 word) in the op's record, written before the done word.
STREAM_FAIL_TOKEN = 2  # int32 word
STREAM_FAIL_VALUE = 2  # int64 word (bytes 16..23)
STREAM_FAIL_DONE = 6  # int32 word: that failed done value again, sticky (no trigger clears it)
# The earlier design's trigger wrote request = REQUEST_BUFFER0 + b (a client still does, facing
# an engine of that design). b is the low-latency receive buffer (0 or 1; now in the ring entry)
# the dispatch fills, or whose dispatch the combine brings back (DeepEP's double buffer).
REQUEST_BUFFER0 = 1
LL_BUFFERS = 2
# Bytes before a receive buffer's topk copy: u64 words of the dispatch's left-out set, its
# verdict (0, or code | source << 8 | token << 32: a source's bad ids failed it on every rank),
# the verdict's value (the expert id) and the dispatch's sequence; from word LL_COMBINE_VERDICT
# on, the same three words of a combine of that dispatch whose own top-k had a bad entry (its
# reduce writes them, the kernel that writes its done word reads and clears them; the
# dispatch's last block clears them too).
LL_TOPK_HEADER = 64
LL_COMBINE_VERDICT = 4
# A source's low-latency histogram row: its E per-expert counts, then its verdict on its own ids
# (int32: code, token, the id's low and high halves), which every rank reads.
LL_HIST_VERDICT = 4
DONE_OK, DONE_FAILED, DONE_RELEASED = 1, 2, 3  # done = DONE_FAILED | code << DONE_CODE_SHIFT
DONE_CODE_SHIFT = 8
DONE_RANK_SHIFT = 16  # a low-latency dispatch's verdict: the failing source + 1, 8 bits
# ... and its sequence's low 7 bits (two failed triggers differ; bit 31 stays clear: a stream
# waits for done >= 1, a cyclic comparison that a set bit 31 would never satisfy)
DONE_SEQ_SHIFT = 24

# -- a member's trigger ring (client/ll_trigger.py; run by server/engine/stream_ops.py's poller
# or the GPU chain, cuda/epd_low_latency.cu and server/backends/cuda_chain.py) ----------------
# A member's ring slot: uint32 ring[LL_RING] of entries (op index | buffer << 8 | generation <<
# 16), then tail (published by the client's trigger kernel) and head (run, or being run).
LL_RING = 64
LL_RING_TAIL = 64
LL_RING_HEAD = 65
# Set by the client when its session ends (StreamOp.release): a trigger that runs after it (a
# CUDA graph replayed once the engine died) reports RELEASED in its done word instead of
# clearing it for an engine that will never write it.
LL_RING_RELEASED = 66
# The chain's log: int32 words LL_RING_LOG + j hold the entry the chain last finished at ring
# position j (its last kernel then clears ring[j]: an instance launched as a CUDA graph waits for
# ring[j] to be nonzero, i.e. published; every entry is nonzero). The host reads which op ran here.
LL_RING_LOG = 128
# Armed ops per member (an entry's 8-bit index; LL_ENTRY_RELEASED's, 0xFF, stays beyond): an
# entry naming an index beyond runs nothing.
LL_CHAIN_OPS = 255
# The latest dispatch of a member holding captured normal-mode calls that notify failed on every
# rank (server/engine/captured_calls.py): its counter-slot status, ERR_RANK, NUM_RECV, its
# num_worst_tokens and its counter sequence, copied into int64 words of the member's poller ring
# slot (past the ring's words) when the engine resolves its count, the sequence last; the client
# raises each sequence once.
RING_FAIL_STATUS, RING_FAIL_RANK, RING_FAIL_VALUE, RING_FAIL_WORST = 40, 41, 42, 43
RING_FAIL_SEQ = 44
# ... and the member's latest worst-case dispatch (replayed or eager): its counter sequence and
# num_worst_tokens (what the client names when it finds that dispatch failed in the counter slot).
RING_FIRED_SEQ, RING_FIRED_WORST = 45, 46
LL_ENTRY_RELEASED = 0xFF  # the entry the engine writes to drain pending instances
LLX_WORDS = 64  # u64 words of a descriptor (device memory)
LLX_KIND = 0
LLX_DISPATCH = 1
LLX_COMBINE = 2
LLX_GEN = 1
LLX_DONE = 2
LLX_STATS = 3
LLX_STATS_STRIDE = 4
LLX_SOURCE = 5
LLX_TRAIT = 6
LLX_BUFFER_STRIDE = 7
LLX_STAMP = 8
LLX_ARGS = 16  # the op's packed kernel arguments, in the kernel's parameter order
LLX_ARGS2 = 40
LLS_SEQ_D = 0  # member state (device u64 words)
LLS_SEQ_C = 1
LLS_FILLED = 2
LLS_K = 4  # the chain instances finished (the next one's k): the head the last kernel publishes
LLS_WORDS = 5

# -- FP8 (DeepEP's per-token, per-128-channel e4m3 with float32 scales) -------------------------
FP8_BLOCK = 128  # channels per scale
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_AMAX_MIN = 1e-4  # amax is clamped to at least this before scale = amax / FP8_MAX
