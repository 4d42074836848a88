"""Fuzz (issue 12): mutated protobuf requests on gRPC and on the fast-path ring.

One CPU daemon (1 engine, 1 s deadlines), a fuzzing session (fast path on) holding a 1-rank group
(collectives never wait for a peer), a spare 1-rank group and a spare region (what LeaveGroup and
UnregisterRegion templates name, so their valid forms only cost a cheap re-create), and a
bystander session of its own. Valid requests of every Engine operation are captured from a real
round (layout, dispatch, combine, low-latency dispatch/combine through the client API) or built
(GetStats, Ping, RegisterRegion, UnregisterRegion, JoinGroup, LeaveGroup, OpenFastPath,
ArmStreamOp, DisarmStreamOp, ReleaseHandles, RankMask, Rejoin); each case mutates one (fields set to
extremes, NaN/inf, other sessions' ids, unknown enums, empty or oversized repeated fields, swapped
descriptors; bit flips, truncation, insertion, random bytes; another method's body; a wrong
token; an unknown ring id)
and sends it raw on gRPC or on the ring. Every case is bounded, its answer must be OK or an
allowed code (never INTERNAL/UNKNOWN), an answer other than OK must leave the session's state as
it was, nothing may succeed in the bystander's name, and the engine keeps its pid. Every
REFRESH cases (and at the end, on a fresh session) a valid round is checked bit for bit against
the reference.

Short in CI (600 cases). Long: `EPD_LONG_TESTS=1 .venv/bin/python -m pytest tests/test_fuzz.py -s`
(6,000 cases). `EPD_FUZZ_SEED` / `EPD_FUZZ_CASES` override the seed and the count; case i draws
from `random.Random(f"{seed}:{i}")`, so a failure names (seed, case) and replays alone with
`EPD_FUZZ_ONLY=i`.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest
import ranklib
from conftest import running_daemon
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import Message
from ranklib import Case

from epd.client import EpdError, Session
from epd.client.transport import CHANNEL_OPTIONS, FastPathTransport, _RingCall
from epd.proto import fd_channel as fdc
from epd.proto import operations
from epd.proto import ring as R
from epd.proto.v1 import epd_pb2
from epd.server import reference as ref

pytestmark = pytest.mark.slow

LONG = os.environ.get("EPD_LONG_TESTS") == "1"
CASES = int(os.environ.get("EPD_FUZZ_CASES", 6000 if LONG else 600))
SEED = int(os.environ.get("EPD_FUZZ_SEED", "12"))
ONLY = os.environ.get("EPD_FUZZ_ONLY")  # replay one case index
SHOW = set(filter(None, os.environ.get("EPD_FUZZ_SHOW", "").split(",")))  # print these codes
REFRESH = 50  # cases between two checked valid rounds (which also refresh the templates)
DEADLINE = 1.0  # the daemon's --timeout-seconds and --max-timeout-seconds
CALL_TIMEOUT = 8.0  # the client-side bound of one case; reaching it is a hang
C = grpc.StatusCode
# Codes a mutated request may get. UNAVAILABLE is not among them: the engine never drains
# here (it is what a draining engine or an OS error such as ENOMEM/ENOSPC answers, and a
# request must not be able to provoke the latter); INTERNAL and UNKNOWN are bugs.
ALLOWED = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION, C.OUT_OF_RANGE,
           C.RESOURCE_EXHAUSTED, C.PERMISSION_DENIED, C.DEADLINE_EXCEEDED, C.ABORTED,
           C.UNIMPLEMENTED}
# Methods whose success may change what the session holds (repaired after an OK).
STATEFUL = {"JoinGroup", "LeaveGroup", "RegisterRegion", "UnregisterRegion", "OpenFastPath",
            "ArmStreamOp", "DisarmStreamOp"}
GRPC_METHODS = [op.name for op in operations.OPERATIONS.values() if not op.streaming]
RING_METHODS = list(operations.RING_METHODS)
WEIGHT = {"Dispatch": 4, "Combine": 4, "LowLatencyDispatch": 3, "LowLatencyCombine": 3,
          "GetDispatchLayout": 2, "GetStats": 1, "Ping": 0.5, "JoinGroup": 1, "LeaveGroup": 1,
          "RegisterRegion": 1, "UnregisterRegion": 1, "OpenFastPath": 0.5, "ArmStreamOp": 1,
          "DisarmStreamOp": 0.5, "ReleaseHandles": 0.5, "RankMask": 0.5, "Rejoin": 0.5}

H, E, K, T, NUM_MAX = 256, 8, 2, 16, 32
VALID = [Case("fuzz-main", 1, E, H, K, (T,), seed=s, max_tokens=NUM_MAX) for s in (3, 4, 5)]
SPARE = Case("fuzz-spare", 1, E, H, K, (T,), max_tokens=NUM_MAX)
BYSTANDER = Case("fuzz-bystander", 1, E, H, K, (T,), seed=9, max_tokens=NUM_MAX)


# ------------------------------------------------------------------------------------------------
# valid rounds, checked against the reference
# ------------------------------------------------------------------------------------------------

def _ll_expert(recv_x: np.ndarray) -> np.ndarray:
    factor = (np.arange(recv_x.shape[0], dtype=np.float32) * 0.25 + 0.5)[:, None, None]
    return (recv_x.astype(np.float32) * factor).astype(ranklib.BF16)


class Buffers:
    """The round's inputs, in regions of the session registered once (Session.empty): the
    captured requests name them, so each template stays valid until a mutated call writes
    into them (an `out=` moved onto an input), and the next valid round rewrites them."""

    def __init__(self, s: Session) -> None:
        self.x = s.empty((T, H), ranklib.BF16)
        self.idx = s.empty((T, K), np.int64)
        self.w = s.empty((T, K), np.float32)
        self.y = s.empty((T, H), ranklib.BF16)  # one rank: at most T rows come back
        self.rw = s.empty((T, K), np.float32)
        self.ll_y = s.empty((E, NUM_MAX, H), ranklib.BF16)
        self.stats = s.empty((E,), np.int32)
        self.out = s.empty((T, H), ranklib.BF16)


def valid_round(g, case: Case, b: Buffers) -> None:
    """Layout, dispatch, combine and a low-latency dispatch/combine (cumulative stats, `out=`)
    on inputs in `b`; everything exact against the reference (raises AssertionError or
    EpdError)."""
    inp = case.inputs(0)
    b.x[...], b.idx[...], b.w[...] = inp["x"], inp["topk_idx"], inp["topk_weights"]
    res: dict[str, Any] = {"rank": 0}
    res["layout"] = [ranklib.as_numpy(a) for a in g.get_dispatch_layout(b.idx)]
    out = g.dispatch(b.x, b.idx, b.w)
    for k in ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights", "recv_src_idx",
              "rank_prefix_matrix"):
        res[k] = ranklib.as_numpy(getattr(out, k))
    res["num_recv_tokens"] = out.num_recv_tokens
    res["num_recv_tokens_per_expert"] = list(out.num_recv_tokens_per_expert)
    y = ranklib.expert_out(res["recv_x"], None, res["recv_topk_idx"], res["recv_topk_weights"],
                           0, E)
    n = len(y)
    assert n > 0, "the valid cases route tokens"
    b.y[:n], b.rw[:n] = y, res["recv_topk_weights"]
    cx, cw = g.combine(b.y[:n], out.handle, topk_weights=b.rw[:n])
    res["combined_x"], res["combined_w"] = ranklib.as_numpy(cx), ranklib.as_numpy(cw)
    ranklib.check_case(case, [res])

    x, idx, w = inp["x"], inp["topk_idx"], inp["topk_weights"]
    b.stats[...] = 0
    d = g.low_latency_dispatch(b.x, b.idx, NUM_MAX, cumulative_local_expert_recv_stats=b.stats)
    want = ref.low_latency_dispatch([x], [idx], E, NUM_MAX)[0]
    ranklib.assert_exact(d.recv_count, want.recv_count, "ll recv_count")
    ranklib.assert_exact(b.stats, want.recv_count, "ll cumulative stats")
    for e in range(E):  # one source rank: rows are the tokens routed to e, as sets
        n = int(want.recv_count[e])
        got = sorted(zip(np.asarray(d.recv_src_idx)[e, :n].tolist(),
                         [r.tobytes() for r in ranklib.bits(d.recv_x[e, :n])], strict=True))
        exp = sorted(zip(want.recv_src_idx[e, :n].tolist(),
                         [r.tobytes() for r in ranklib.bits(want.recv_x[e, :n])], strict=True))
        assert got == exp, f"ll dispatch rows of expert {e} differ"
    b.ll_y[...] = _ll_expert(np.asarray(d.recv_x))
    cx = g.low_latency_combine(b.ll_y, b.idx, b.w, d.handle, out=b.out)
    wy = _ll_expert(want.recv_x)
    ranklib.assert_exact(cx, ref.low_latency_combine([wy], [want], [idx], [w], E)[0],
                         "ll combined_x")


# ------------------------------------------------------------------------------------------------
# the fuzzing session and what it holds
# ------------------------------------------------------------------------------------------------

@dataclass
class Snapshot:
    """What GetStats shows of a session: its groups (aborted or not) and regions."""

    groups: dict[str, bool]
    regions: int
    region_bytes: int


class World:
    """The fuzzing session: main group, spare group, regions, templates, and the raw senders."""

    def __init__(self, endpoint: str, bystander: dict[str, Any]) -> None:
        self.endpoint = endpoint
        self.bystander = bystander
        self.channel = grpc.insecure_channel(f"unix://{endpoint}", options=CHANNEL_OPTIONS)
        self._grpc: dict[str, Any] = {}
        self.resets: Counter = Counter()
        self.rounds = 0
        self.s: Session | None = None
        self.open()

    # -- set-up --------------------------------------------------------------------------------
    def open(self) -> None:
        s = self.s = Session(self.endpoint, client_name="fuzzer")
        assert s.transport == "fastpath", s.fast_path_error
        self.ring: FastPathTransport = s._transport  # type: ignore[assignment]
        self.token = s._channel.token
        self.metadata = ((fdc.TOKEN_METADATA, self.token),)
        self.buf = Buffers(s)
        self.spare_region = s.empty((1024,), np.uint8)
        self.spare = ranklib.join(s, SPARE, 0)
        self.templates: dict[str, Message] = {}
        self.descs: list[epd_pb2.TensorDesc] = []
        self.main = None
        self._capture(lambda: setattr(self, "main", ranklib.join(s, VALID[0], 0)))
        self.refresh()

    def close(self) -> None:
        if self.s is not None:
            self.s.close()
            self.s = None

    def reset(self, why: str) -> None:
        self.resets[why] += 1
        self.close()
        self.open()

    def _capture(self, fn) -> None:
        """Run fn with the session's transport recording every (method, request, response)."""
        t = self.s._transport
        inner, inner_async = t.call, t.call_async

        class Answered:  # (a started call, recorded once its answer is taken)
            def __init__(self, method: str, request: Message, fut) -> None:
                self.method, self.request, self.fut = method, request, fut

            def done(self) -> bool:
                return self.fut.done()

            def result(self, timeout: float | None = None) -> Message:
                return record(self.method, self.request, self.fut.result(timeout))

        def spy(method: str, request: Message, timeout: float) -> Message:
            return record(method, request, inner(method, request, timeout))

        def spy_async(method: str, request: Message, timeout: float) -> Answered:
            return Answered(method, request, inner_async(method, request, timeout))

        def record(method: str, request: Message, resp: Message) -> Message:
            req = type(request)()
            req.CopyFrom(request)
            self.templates[method] = req
            for m in (request, resp):
                for f, v in m.ListFields():
                    if f.message_type is epd_pb2.TensorDesc.DESCRIPTOR:
                        self.descs.append(epd_pb2.TensorDesc(region_id=v.region_id,
                                                             offset_bytes=v.offset_bytes,
                                                             shape=v.shape, dtype=v.dtype,
                                                             strides=v.strides))
            return resp
        t.call, t.call_async = spy, spy_async
        try:
            fn()
        finally:
            del t.call, t.call_async  # back to the class's methods

    def refresh(self) -> None:
        """A valid round, checked; its requests become the templates."""
        case = VALID[self.rounds % len(VALID)]
        self.rounds += 1
        self.descs = self.descs[-64:]
        self._capture(lambda: valid_round(self.main, case, self.buf))
        self._build_templates()
        self.expected = self.snapshot()

    def _build_templates(self) -> None:
        sid = self.s.session_id
        tp = self.templates
        tp["GetStats"] = epd_pb2.GetStatsRequest(session_id=sid)
        tp["Ping"] = epd_pb2.PingRequest()
        tp["RegisterRegion"] = epd_pb2.RegisterRegionRequest(
            session_id=sid, cuda_ipc_handle=bytes(range(64)), size_bytes=1 << 20)
        tp["UnregisterRegion"] = epd_pb2.UnregisterRegionRequest(
            session_id=sid, region_id=self.s.memory._region_of(self.spare_region).region_id)
        tp["LeaveGroup"] = epd_pb2.LeaveGroupRequest(session_id=sid,
                                                     group_id=self.spare.group_id)
        tp["OpenFastPath"] = epd_pb2.OpenFastPathRequest(session_id=sid)
        tp["ArmStreamOp"] = epd_pb2.ArmStreamOpRequest(
            session_id=sid, group_id=self.main.group_id,
            low_latency_dispatch=tp["LowLatencyDispatch"])
        tp["DisarmStreamOp"] = epd_pb2.DisarmStreamOpRequest(session_id=sid, op_id=1)
        tp["ReleaseHandles"] = epd_pb2.ReleaseHandlesRequest(
            session_id=sid, group_id=self.main.group_id, handles=[1 << 40])
        tp["RankMask"] = epd_pb2.RankMaskRequest(session_id=sid, group_id=self.main.group_id)
        tp["Rejoin"] = epd_pb2.RejoinRequest(session_id=sid, group_id=self.main.group_id,
                                             rank=0, timeout_seconds=1)
        self.arm_combine = epd_pb2.ArmStreamOpRequest(
            session_id=sid, group_id=self.main.group_id,
            low_latency_combine=tp["LowLatencyCombine"], dispatch_op=1)
        missing = set(GRPC_METHODS) - set(tp)
        assert not missing, f"no template for {sorted(missing)}"

    def ids(self) -> dict[str, str]:
        s = self.s
        return {"sid": s.session_id, "main": self.main.group_id, "spare": self.spare.group_id,
                "staging": s.memory.staging.region_id,
                **{k: s.memory._region_of(v).region_id for k, v in vars(self.buf).items()},
                "spare_region": s.memory._region_of(self.spare_region).region_id,
                "main_out": self.main._outputs.region_id}

    # -- state -----------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        st = self.ok_call("GetStats", epd_pb2.GetStatsRequest(session_id=self.s.session_id))
        return Snapshot({g.group_id: g.aborted for g in st.groups}, st.regions, st.region_bytes)

    def ok_call(self, method: str, req: Message) -> Message:
        """A valid call on gRPC (raises on any failure)."""
        return self.s._transport.inner.call(method, req, CALL_TIMEOUT)

    def repair(self, method: str, sent: bytes) -> str:
        """After an OK of a method that may change state: undo what it did (leave groups it
        joined, re-create the spare group or region), or reset the world. Returns what was
        done ("" when nothing had changed)."""
        now = self.snapshot()
        if now == self.expected:
            return ""
        sid = self.s.session_id
        exp = self.expected
        if (self.main.group_id not in now.groups or now.groups[self.main.group_id]
                or now.regions > exp.regions):
            self.reset(f"{method}: main group or regions changed")
            return "reset"
        done = []
        for gid in set(now.groups) - set(exp.groups):
            self.ok_call("LeaveGroup", epd_pb2.LeaveGroupRequest(session_id=sid, group_id=gid))
            done.append("left a joined group")
        if self.spare.group_id not in now.groups:
            self.spare._release()
            self.spare = ranklib.join(self.s, SPARE, 0)
            done.append("re-joined the spare group")
        if now.regions < exp.regions:
            req = epd_pb2.UnregisterRegionRequest()
            try:
                req.ParseFromString(sent)
            except Exception:
                req = epd_pb2.UnregisterRegionRequest()
            if now.regions != exp.regions - 1 or req.region_id != self.ids()["spare_region"]:
                self.reset(f"{method}: a region other than the spare went")
                return "reset"
            self.spare_region = self.s.empty((1024,), np.uint8)
            done.append("re-registered the spare region")
        self._build_templates()
        self.expected = self.snapshot()
        return ", ".join(done)

    # -- raw senders -------------------------------------------------------------------------
    def send_grpc(self, method: str, data: bytes, metadata) -> tuple[C, bytes | str]:
        fn = self._grpc.get(method)
        if fn is None:
            fn = self._grpc[method] = self.channel.unary_unary(
                f"/epd.v1.Engine/{method}", request_serializer=None, response_deserializer=None)
        try:
            return C.OK, fn(data, timeout=CALL_TIMEOUT, metadata=metadata)
        except grpc.RpcError as e:
            return e.code(), e.details() or ""

    def send_ring(self, ring_id: int, data: bytes, length: int | None = None
                  ) -> tuple[C, bytes | str]:
        """One request in the next ring slot with method word `ring_id` and length word
        `length` (default len(data)); the answer's status and raw bytes (or message)."""
        t = self.ring
        assert t.broken is None and t.lost is None, (t.broken, t.lost)
        op = operations.BY_RING_ID.get(ring_id, operations.get("Ping"))
        deadline = time.monotonic() + CALL_TIMEOUT
        with t._lock:
            seq = t._next
            slot = (seq - 1) % t.ring.slots
            words, payload, _ = t.ring.slot(slot)
            assert int(words[R.S_STATE]) == R.FREE  # calls are synchronous: always free
            t._next += 1
            payload[:len(data)] = data
            words[R.S_METHOD] = ring_id
            words[R.S_LENGTH] = len(data) if length is None else length
            words[R.S_STATUS] = 0
            words[R.S_DEADLINE_LO] = words[R.S_DEADLINE_HI] = 0  # (none: not an earlier call's)
            R.set_seq(words, seq)
            words[R.S_STATE] = R.SUBMITTED
            t.ring.header[R.DOORBELL] += 1
            if t.ring.header[R.ENGINE_WAITING]:
                R.futex_wake(t.ring.doorbell_addr)
        # _finish decodes an OK answer with the response type of `op`: decode it ourselves.
        call = _RingCall(t, _RawOp(op.name, op.ring_id), slot, seq, deadline)
        got = t._finish(call)
        if isinstance(got, EpdError):
            return got.code, got.message
        return C.OK, got.data


class _RawResponse:
    """Stands in for a response type in FastPathTransport._finish: keeps the bytes."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    @classmethod
    def FromString(cls, data: bytes) -> _RawResponse:  # protobuf's name)
        return cls(data)


@dataclass(frozen=True)
class _RawOp:
    name: str
    ring_id: int | None  # (the transport keys its reply spin window by it)
    response: type = _RawResponse


# ------------------------------------------------------------------------------------------------
# mutations
# ------------------------------------------------------------------------------------------------

INT_RANGE = {FD.CPPTYPE_INT32: (-2**31, 2**31 - 1), FD.CPPTYPE_INT64: (-2**63, 2**63 - 1),
             FD.CPPTYPE_UINT32: (0, 2**32 - 1), FD.CPPTYPE_UINT64: (0, 2**64 - 1)}
DOUBLES = [0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, -1.0, 5e-324, 1e-9, 0.5, 1e9,
           1e300, 1.7976931348623157e308, -1e300]


def int_value(rng: random.Random, lo: int, hi: int, cur: int) -> int:
    picks = [0, 1, -1, 2, lo, hi, lo + 1, hi - 1, cur + 1, cur - 1, cur * 2, -cur, cur + 2**32,
             2**31, 2**31 - 1, -2**31, 2**32, 2**32 - 1, 2**63 - 1, 2**53 + 1, 2**62, 2**16,
             rng.randint(0, 64), rng.randint(-64, 0), rng.randint(lo, hi),
             1 << rng.randint(0, 63), (1 << rng.randint(0, 63)) - 1]
    ok = [v for v in picks if lo <= v <= hi]
    return rng.choice(ok)


def string_value(rng: random.Random, ctx: dict[str, Any], cur: str, big: bool) -> str:
    pool = [*ctx["ids"].values(), *ctx["other_ids"], "", "\x00", " ", "x", "é漢字🙂",
            "../../../../etc/passwd", "/dev/shm/epd-x", "%s%n%x", "r" + "0" * 16, "g0",
            cur + "x", cur[:-1], cur.upper(), cur + "\x00", "a" * rng.choice([255, 4000])]
    if big:
        pool.append("a" * 100_000)
    return rng.choice(pool)


def bytes_value(rng: random.Random, big: bool) -> bytes:
    pool = [b"", b"\x00" * 64, bytes(range(64)), b"\xff" * 64,
            rng.randbytes(rng.randint(1, 200))]
    if big:
        pool.append(rng.randbytes(50_000))
    return rng.choice(pool)


def scalar_value(rng: random.Random, f: FD, cur: Any, ctx: dict[str, Any], big: bool) -> Any:
    t = f.cpp_type
    if t in INT_RANGE:
        return int_value(rng, *INT_RANGE[t], int(cur))
    if t in (FD.CPPTYPE_DOUBLE, FD.CPPTYPE_FLOAT):
        return rng.choice([*DOUBLES, cur * rng.choice([-1, 2, 1e6]), rng.uniform(-10, 10)])
    if t == FD.CPPTYPE_BOOL:
        return not cur
    if t == FD.CPPTYPE_ENUM:
        return rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 99, -1, 2**31 - 1, -2**31,
                           rng.randint(-2**31, 2**31 - 1)])
    if t == FD.CPPTYPE_STRING:
        if f.type == FD.TYPE_BYTES:
            return bytes_value(rng, big)
        return string_value(rng, ctx, cur, big)
    raise AssertionError(f"unhandled field type {t} of {f.full_name}")


def _is_repeated(f: FD) -> bool:
    return f.is_repeated


def mutate_repeated(rng: random.Random, msg: Message, f: FD, ctx, big: bool) -> str:
    rep = getattr(msg, f.name)
    lo, hi = INT_RANGE.get(f.cpp_type, (-2**63, 2**63 - 1))
    r = rng.randrange(7)
    if r == 0:
        del rep[:]
        return f"{f.name}=[]"
    if r == 1:
        rep.append(int_value(rng, lo, hi, 0))
        return f"{f.name}+=[..]"
    if r == 2 and len(rep):
        del rep[rng.randrange(len(rep))]
        return f"{f.name} drop one"
    if r == 3 and len(rep):
        i = rng.randrange(len(rep))
        rep[i] = int_value(rng, lo, hi, rep[i])
        return f"{f.name}[{i}]={rep[i]}"
    if r == 4:
        n = rng.choice([3, 8, 9, 64, 1000] + ([100_000] if big else []))
        v = rng.choice([x for x in (0, 1, -1, 2, hi) if lo <= x <= hi])  # unsigned: no -1
        del rep[:]
        rep.extend([v] * n)
        return f"{f.name}=[{v}]*{n}"
    if r == 5 and len(rep) > 1:
        vals = list(rep)
        rng.shuffle(vals)
        rep[:] = vals
        return f"{f.name} shuffled"
    vals = [int_value(rng, lo, hi, v) for v in rep] or [hi]
    rep[:] = vals
    return f"{f.name}={vals[:4]}"


def mutate_message(rng: random.Random, msg: Message, ctx: dict[str, Any], big: bool,
                   depth: int = 0) -> str:
    """One structured change to `msg`, in place; what it did."""
    fields = msg.DESCRIPTOR.fields
    if not fields:
        return "no fields"
    f = rng.choice(fields)
    if _is_repeated(f):
        return mutate_repeated(rng, msg, f, ctx, big)
    if f.message_type is not None:
        r = rng.random()
        if r < 0.12:
            msg.ClearField(f.name)
            return f"clear {f.name}"
        if r < 0.3 and f.message_type is epd_pb2.TensorDesc.DESCRIPTOR and ctx["descs"]:
            getattr(msg, f.name).CopyFrom(rng.choice(ctx["descs"]))
            return f"{f.name}=another desc"
        if r < 0.4 and f.message_type is epd_pb2.TensorDesc.DESCRIPTOR:
            others = [o for o in fields if o.message_type is f.message_type and o is not f]
            if others:
                o = rng.choice(others)
                a, b = type(getattr(msg, f.name))(), type(getattr(msg, o.name))()
                a.CopyFrom(getattr(msg, f.name))
                b.CopyFrom(getattr(msg, o.name))
                getattr(msg, f.name).CopyFrom(b)
                getattr(msg, o.name).CopyFrom(a)
                return f"swap {f.name}<->{o.name}"
        if depth >= 3:
            getattr(msg, f.name).SetInParent()
            return f"{f.name} set empty"
        return f"{f.name}." + mutate_message(rng, getattr(msg, f.name), ctx, big, depth + 1)
    cur = getattr(msg, f.name)
    v = scalar_value(rng, f, cur, ctx, big)
    try:
        setattr(msg, f.name, v)
    except (ValueError, TypeError):  # a value this field's type cannot hold
        return f"{f.name} unchanged"
    shown = repr(v) if not isinstance(v, (str, bytes)) or len(v) < 40 else f"<{len(v)}>"
    return f"{f.name}={shown}"


def mutate_bytes(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    b = bytearray(data)
    r = rng.randrange(8)
    if r == 0 and b:
        n = rng.randint(1, 8)
        for _ in range(n):
            i = rng.randrange(len(b) * 8)
            b[i // 8] ^= 1 << (i % 8)
        return bytes(b), f"{n} bit flips"
    if r == 1 and b:
        n = rng.randrange(len(b))
        return bytes(b[:n]), f"truncated to {n}/{len(b)}"
    if r == 2:
        i = rng.randint(0, len(b))
        ins = rng.randbytes(rng.randint(1, 16))
        return bytes(b[:i] + ins + b[i:]), f"{len(ins)} bytes inserted at {i}"
    if r == 3 and b:
        i = rng.randrange(len(b))
        j = rng.randint(i + 1, len(b))
        return bytes(b[:i] + b[j:]), f"bytes {i}:{j} deleted"
    if r == 4 and b:
        i = rng.randrange(len(b))
        j = rng.randint(i + 1, len(b))
        return bytes(b[:j] + b[i:j] + b[j:]), f"bytes {i}:{j} duplicated"
    if r == 5:
        num, wt = rng.choice([1, 2, 3, 15, 16, 100, 2**29 - 1]), rng.randrange(8)
        tag = (num << 3) | wt
        raw = bytearray()
        while True:
            raw.append((tag & 0x7F) | (0x80 if tag > 0x7F else 0))
            tag >>= 7
            if not tag:
                break
        raw += rng.randbytes(rng.randint(0, 12))
        return bytes(b + raw), f"field {num} wire type {wt} appended"
    if r == 6 and b:
        i = rng.randrange(len(b))
        b[i] = rng.choice([0x00, 0x7F, 0x80, 0xFF])
        return bytes(b), f"byte {i}={b[i]:#x}"
    return rng.randbytes(rng.randint(0, 256)), "random bytes"


# ------------------------------------------------------------------------------------------------
# one case
# ------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    index: int
    transport: str
    method: str
    what: str
    data: bytes
    code: C
    answer: bytes | str
    elapsed: float
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        ans = (self.answer if isinstance(self.answer, str) else f"<{len(self.answer)} bytes>")
        return (f"seed {SEED} case {self.index}: {self.transport} {self.method} [{self.what}] "
                f"-> {self.code.name} ({ans[:300]!r}) in {self.elapsed * 1e3:.1f} ms; "
                f"request {self.data[:96].hex()}{'...' if len(self.data) > 96 else ''}")


def _template(w: World, method: str, rng: random.Random) -> Message:
    src = (w.arm_combine if method == "ArmStreamOp" and rng.random() < 0.5
           else w.templates[method])
    m = type(src)()
    m.CopyFrom(src)
    return m


def make_case(w: World, rng: random.Random, ctx: dict[str, Any]
              ) -> tuple[str, str, str, bytes, Any, str]:
    """(transport, method, body type, bytes, extra, description): `extra` is the gRPC metadata
    or the ring's (method id, length word)."""
    transport = "ring" if rng.random() < 0.5 else "grpc"
    methods = RING_METHODS if transport == "ring" else GRPC_METHODS
    method = rng.choices(methods, [WEIGHT[m] for m in methods])[0]
    big = transport == "grpc"
    body = method
    r = rng.random()
    if r < 0.08:  # another method's body, maybe mutated
        body = rng.choice(GRPC_METHODS)
        msg = _template(w, body, rng)
        what = f"body of {body}"
        if rng.random() < 0.5:
            what += "; " + mutate_message(rng, msg, ctx, big)
        data = msg.SerializeToString()
    elif r < 0.11:
        data, what = (b"", "empty message") if rng.random() < 0.4 else mutate_bytes(rng, b"")
    elif r < 0.17:  # valid but for unknown fields: the success paths (and their repair)
        unknown = rng.choice([b"\xc0\x3e\x01", b"\xc2\x3e\x03abc", b"\xf8\xff\xff\xff\x0f\x00"])
        data, what = _template(w, method, rng).SerializeToString() + unknown, "unknown field"
    else:
        msg = _template(w, method, rng)
        n = rng.choices([0, 1, 2, 3, 5], [6, 50, 22, 14, 8])[0]
        notes = [mutate_message(rng, msg, ctx, big) for _ in range(n)]
        data = msg.SerializeToString()
        if r > 0.75 or n == 0:  # byte-level, on the (maybe mutated) message
            data, how = mutate_bytes(rng, data)
            notes.append(how)
        what = "; ".join(notes)
    if transport == "grpc":
        md = w.metadata
        q = rng.random()
        if q < 0.02:
            md, what = (), what + "; no token"
        elif q < 0.04:
            md, what = ((fdc.TOKEN_METADATA, rng.randbytes(32)),), what + "; random token"
        elif q < 0.05:
            md, what = ((fdc.TOKEN_METADATA, w.token[:-1]),), what + "; short token"
        elif q < 0.06:
            md, what = ((fdc.TOKEN_METADATA, ctx["bystander_sid"].encode()),), what + \
                "; bystander's id as token"
        if rng.random() < 0.01:
            method, what = "NoSuchMethod", what + "; unknown method"
        return transport, method, body, data, md, what
    rid, length = operations.get(method).ring_id, None
    q = rng.random()
    if q < 0.03:
        rid = rng.choice([len(RING_METHODS), 99, 2**31, 2**32 - 1])
        what += f"; ring id {rid}"
    elif q < 0.05:
        length = rng.choice([0, max(len(data) - 1, 0), len(data) + 1, w.ring.ring.capacity,
                             w.ring.ring.capacity + 1, 2**32 - 1])
        what += f"; length word {length}"
    if len(data) > w.ring.ring.capacity:  # as the client does: too big for a slot -> gRPC
        return "grpc", method, body, data, w.metadata, what + "; too big for the ring"
    return transport, method, body, data, (rid, length), what


def run_case(w: World, index: int, ctx: dict[str, Any]) -> Outcome:
    rng = random.Random(f"{SEED}:{index}")
    transport, method, _body, data, extra, what = make_case(w, rng, ctx)
    t0 = time.monotonic()
    if transport == "grpc":
        code, answer = w.send_grpc(method, data, extra)
    else:
        code, answer = w.send_ring(extra[0], data, extra[1])
    return Outcome(index, transport, method, what, data, code, answer, time.monotonic() - t0)


# Unmutated templates that must succeed (the others name state the engine refuses: a group the
# session holds, a second fast path, CUDA-only calls on the cpu backend, an op never armed, a
# rejoin in a group without shrink).
BASELINE_OK = {"GetDispatchLayout", "Dispatch", "Combine", "LowLatencyDispatch",
               "LowLatencyCombine", "GetStats", "Ping", "LeaveGroup", "UnregisterRegion",
               "ReleaseHandles", "RankMask"}


def baseline(w: World, ctx: dict[str, Any]) -> list[Outcome]:
    """Every template unmutated, on gRPC and (where it travels) on the ring, in the client's
    order; LeaveGroup and UnregisterRegion hit the spare group and region, exercising the
    repair. A failure here means the fuzzer's templates are wrong, not the daemon."""
    order = ["GetDispatchLayout", "Dispatch", "Combine", "LowLatencyDispatch",
             "LowLatencyCombine", "GetStats", "Ping", "JoinGroup", "LeaveGroup", "RegisterRegion",
             "UnregisterRegion", "OpenFastPath", "ArmStreamOp", "DisarmStreamOp",
             "ReleaseHandles", "RankMask", "Rejoin"]
    assert sorted(order) == sorted(GRPC_METHODS)
    out = []
    for transport in ("grpc", "ring"):
        for method in order:
            if transport == "ring" and method not in RING_METHODS:
                continue
            data = w.templates[method].SerializeToString()
            t0 = time.monotonic()
            code, answer = (w.send_grpc(method, data, w.metadata) if transport == "grpc" else
                            w.send_ring(operations.get(method).ring_id, data))
            o = Outcome(-1, transport, method, "unmutated", data, code, answer,
                        time.monotonic() - t0)
            bad = check_outcome(w, o, ctx)
            assert not bad, bad
            if method in BASELINE_OK:
                assert code == C.OK, o.describe()
            if method == "LowLatencyDispatch":  # (it overwrote the receive buffer whose
                w.refresh()  # dispatch the combine template names: a fresh round's templates)
            out.append(o)
    return out


def check_outcome(w: World, o: Outcome, ctx: dict[str, Any]) -> list[str]:
    """The case's violations (empty when it is fine); repairs what a success changed."""
    bad = []
    hang = o.elapsed >= CALL_TIMEOUT * 0.9 or (o.transport == "ring" and w.ring.broken)
    if hang:
        bad.append(f"HANG: {o.describe()}")
    elif o.code not in ALLOWED:
        bad.append(f"{o.code.name}: {o.describe()}")
    elif isinstance(o.answer, str) and ("Stream removed" in o.answer
                                        or "metadata size exceeds" in o.answer):
        # Not the daemon's answer but gRPC's: the status did not reach the client.
        bad.append(f"transport error instead of the daemon's status: {o.describe()}")
    op = operations.OPERATIONS.get(o.method)
    if o.code == C.OK and op is not None:
        try:
            op.response.FromString(o.answer)
        except Exception as e:
            bad.append(f"OK answer does not parse as {op.response.__name__} ({e}): "
                       f"{o.describe()}")
        req = op.request()
        try:
            req.ParseFromString(o.data)
        except Exception:
            req = None
        if req is not None and getattr(req, "session_id", None) == ctx["bystander_sid"]:
            bad.append(f"OK in the bystander's name: {o.describe()}")
    if hang or w.ring.broken or w.ring.lost:
        w.reset("hang" if hang else "ring unusable")
        return bad
    try:
        if o.code == C.OK and o.method in STATEFUL:
            done = w.repair(o.method, o.data)
            if done:
                o.notes.append(done)
        else:
            now = w.snapshot()
            if now != w.expected:
                bad.append(f"state changed by a request answered {o.code.name} "
                           f"(expected {w.expected}, now {now}): {o.describe()}")
                w.reset("state changed")
    except EpdError as e:  # the session itself is gone
        bad.append(f"session unusable after the case ({e}): {o.describe()}")
        w.reset("session unusable")
    return bad


# ------------------------------------------------------------------------------------------------
# the test
# ------------------------------------------------------------------------------------------------

def _usage(pid: int) -> tuple[int, int]:
    """(open descriptors, resident KiB) of a process."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return fds, rss


def _fd_targets(pid: int) -> Counter:
    out: Counter = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            out[link.split(":")[0] if link.startswith(("socket:", "pipe:", "anon_inode:"))
                else link.rsplit("-", 1)[0] if link.startswith("/memfd:epd-client")
                else "/memfd:epd-<gid>.comm" if link.endswith(".comm (deleted)")
                else link] += 1
    return out


def _bystander_stats(s: Session) -> list[tuple]:
    return [(g.group_id, g.dispatches, g.combines, g.aborted) for g in s.stats().groups]


def test_fuzz_grpc_and_ring() -> None:
    extra = ["--max-timeout-seconds", str(DEADLINE)]
    with running_daemon(engines=1, timeout_seconds=DEADLINE, extra=extra) as d:
        endpoint = d.socket(0)
        pid = d.engine_pid(0)
        log_start = len(d.log())
        with Session(endpoint, client_name="bystander") as by:
            bg = ranklib.join(by, BYSTANDER, 0)
            ranklib.check_case(BYSTANDER, [ranklib.case_round(by, bg, BYSTANDER, 0)])
            by_before = _bystander_stats(by)
            bystander = {"sid": by.session_id, "gid": bg.group_id,
                         "region": by.memory.staging.region_id}
            w = World(endpoint, bystander)
            try:
                fds0, rss0 = _usage(pid)
                targets0 = _fd_targets(pid)
                indices = [int(ONLY)] if ONLY is not None else range(CASES)
                codes: Counter = Counter()
                by_transport: Counter = Counter()
                by_method: dict[str, Counter] = {}
                violations: list[str] = []
                slowest: list[tuple[float, str]] = []
                ctx = {"ids": w.ids(), "other_ids": list(bystander.values()),
                       "bystander_sid": by.session_id, "descs": w.descs}
                base = baseline(w, ctx)
                assert sum(w.resets.values()) == 0, w.resets
                t0 = time.monotonic()
                for n, i in enumerate(indices):
                    ctx = {"ids": w.ids(), "other_ids": list(bystander.values()),
                           "bystander_sid": by.session_id, "descs": w.descs}
                    o = run_case(w, i, ctx)
                    codes[o.code.name] += 1
                    by_transport[o.transport] += 1
                    by_method.setdefault(o.method, Counter())[o.code.name] += 1
                    slowest = sorted([*slowest, (o.elapsed, o.describe()[:200])])[-3:]
                    violations += check_outcome(w, o, ctx)
                    if o.code.name in SHOW or "ALL" in SHOW:
                        print(o.describe()[:400], o.notes or "")
                    if (n + 1) % REFRESH == 0:
                        assert d.engine_pid(0) == pid, f"engine restarted by case {i}"
                        try:
                            w.refresh()
                        except (EpdError, AssertionError) as e:
                            violations.append(f"valid round failed after case {i}: {e}")
                            w.reset("valid round failed")
                elapsed = time.monotonic() - t0
                w.refresh()
                fds1, rss1 = _usage(pid)
                engine_sessions = w.ok_call("GetStats", epd_pb2.GetStatsRequest()).sessions
                targets1 = _fd_targets(pid)
                grown = {k: targets1[k] - targets0[k] for k in targets0 | targets1
                         if targets1[k] != targets0[k]}
            finally:
                w.close()
            # The bystander saw nothing: same counters, and a valid round still exact.
            assert _bystander_stats(by) == by_before, "the bystander's group changed"
            ranklib.check_case(BYSTANDER, [ranklib.case_round(by, bg, BYSTANDER, 0)])
        # A fresh session after the fuzzing: a valid round, exact.
        ranklib.check_case(VALID[1], [ranklib.run_case(endpoint, VALID[1], 0)])
        assert d.engine_pid(0) == pid, "the engine restarted"
        log = d.log()[log_start:]
        tracebacks = log.count("Traceback")
        internal = codes["INTERNAL"] + codes["UNKNOWN"]
        hangs = sum(v.startswith("HANG") for v in violations)
        print(f"\nfuzz: baseline {len(base)} unmutated calls "
              f"{dict(Counter(o.code.name for o in base))}")
        print(f"fuzz: seed {SEED}, {sum(codes.values())} cases in {elapsed:.1f} s "
              f"({dict(by_transport)}), by code {dict(codes.most_common())}, crashes 0, "
              f"hangs {hangs}, INTERNAL/UNKNOWN {internal}, violations {len(violations)}, "
              f"resets {dict(w.resets)}, valid rounds {w.rounds} exact, engine fds "
              f"{fds0}->{fds1} {dict(grown) or ''}, RSS {rss0 // 1024}->{rss1 // 1024} MiB, "
              f"log tracebacks {tracebacks}, engine sessions at the end {engine_sessions} (2 "
              f"expected)")
        for m, c in sorted(by_method.items()):
            print(f"  {m}: {dict(c.most_common())}")
        for s, text in reversed(slowest):
            print(f"  slow {s * 1e3:.0f} ms: {text}")
        assert not violations, f"{len(violations)} violation(s):\n" + "\n".join(violations[:30])
        assert tracebacks == 0, f"the engine logged tracebacks:\n{log[-6000:]}"
        assert fds1 <= fds0 + 2, f"engine descriptors {fds0} -> {fds1}: more {dict(grown)}"
        assert rss1 <= rss0 + 128 * 1024, f"engine RSS {rss0} -> {rss1} KiB"
