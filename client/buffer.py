"""A DeepEP-compatible `Buffer` over an EPD daemon.

Code written for `deep_ep.Buffer` (normal mode) runs with an import change:

    from epd.client import buffer as deep_ep       # instead of: import deep_ep
    buf = deep_ep.Buffer(group, num_nvl_bytes)       # torch.distributed group: rank/size from it
    n_rank, n_rdma, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=n_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    combined_x, combined_w, _ = buf.combine(expert_out, handle, topk_weights=recv_w)

Or, opted in with `pip install ./client/deep_ep_shim`, plain `import deep_ep`. DeepEP V1's
names, argument order, defaults and return tuples (commit 567632dd5981); the table of what is
supported and what raises is in the README's DeepEP section. In short: the layout tensors passed
to `dispatch` are recomputed by the daemon from `topk_idx`; `config` is validated and the daemon
does its own tuning; `previous_event` / `async_finish` / `allocate_on_comm_stream` have DeepEP's
stream meaning with torch CUDA tensors (client/deep_ep_compat.py `run_on_streams`) and are
immediate on the CPU backend, whose calls have finished when they return; handles index like
DeepEP's tuples where EPD has the data and raise `Unsupported` where it does not. Bad arguments
raise `EpdError` with INVALID_ARGUMENT, as every EPD call does.

Low-latency mode (`Buffer(..., low_latency_mode=True)`):

    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
        x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True)
    combined_x, event, hook = buf.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

On the cpu backend calls return when their data has arrived, so `return_recv_hook=True` returns
a hook that does nothing and `async_finish` has no effect. On the cuda backend, a call made
while the current stream captures a CUDA graph, or with `return_recv_hook=True`, is
stream-ordered (client/stream_ops.py): it is armed once per set of tensors, triggered from the
stream by a trigger kernel, and the hook enqueues the wait for its data. FP8
scales come in DeepEP's layout: float32 `[L, R*num_max, H/128]`, column-major in the last two
dimensions; with `use_ue8m0` (which implies `round_scale`) the exponent bytes packed four to an
int32, `[L, R*num_max, H/512]`, column-major too (deep_ep_compat.LowLatencyScales).
`use_logfmt`, `zero_copy`, `dispatch_wait_recv_cost_stats` and `combine_wait_recv_cost_stats`
are accepted and ignored: combine always carries exact bf16.

The daemon group behind a Buffer is formed lazily at the first call, from the call's shapes
(hidden, top-k, dtype, number of experts), so one Buffer serves several layer shapes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, NamedTuple

import grpc
import numpy as np

from ..proto import dtypes, engine_sockets, group_names
from ..proto.errors import EpdError, FailedPrecondition, InvalidArgument, TokenCapacityExceeded
from . import cuda_ipc
from . import deep_ep_compat as C
from . import tensors as T
from .buffer_low_latency import LowLatencyMixin, plain_op_limit
from .deep_ep_compat import Config, EventHandle, EventOverlap, Unsupported
from .frameworks import torch_if_loaded
from .group import Group, service_class_value
from .handles import BufferHandle, LowLatencyBufferHandle, repacked
from .session import UNANSWERED, Session
from .stream_op_cache import StreamOpCache
from .tensors import Array

SERVICE_CLASS_ENV = "EPD_SERVICE_CLASS"  # a Buffer's service class when it names none
MAX_TOKENS_ENV = "EPD_MAX_TOKENS_PER_RANK"  # a Buffer's normal-mode capacity when it names none
DEFAULT_MAX_TOKENS = 4096
log = logging.getLogger("epd.client")
LAYOUT_GROUP_HIDDEN = 128  # hidden size of a group formed only to compute layouts

__all__ = ["Buffer", "BufferHandle", "Config", "EventHandle", "EventOverlap",
           "LowLatencyBufferHandle", "Unsupported"]


def __getattr__(name: str) -> Any:
    """`topk_idx_t` is torch.int64 (DeepEP's default build), resolved when first read so that
    importing the client never imports torch."""
    if name == "topk_idx_t":
        import torch
        return torch.int64
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MAX_INT32 = 2**31 - 1  # (token counts travel as int32)
DEFAULT_GROUP_NAME = "deep_ep"


def _distributed_of(group: Any) -> Any:
    """torch.distributed when `group` is one of its initialised process groups, else None (a
    stand-in object, an mpi4py comm, no group)."""
    torch = torch_if_loaded()
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if (group is not None and dist is not None and dist.is_available() and dist.is_initialized()
            and isinstance(group, dist.ProcessGroup)):
        return dist
    return None


def job_instance_tag(group: Any) -> str:
    """An instance tag for a shrink Buffer's groups that a replacement process recomputes: from
    the job (torchelastic's run id, else the rendezvous address: MASTER_ADDR / MASTER_PORT, or
    the default store's, as a `tcp://` init method makes it) and the group's global ranks, so
    that two EP groups, or two jobs, do not meet in one daemon group. "" without a job
    identity."""
    import hashlib
    dist = _distributed_of(group)
    job = os.environ.get("TORCHELASTIC_RUN_ID") or ":".join(
        v for v in (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")) if v)
    if not job and dist is not None:
        try:  # (vLLM's workers rendezvous by init_method="tcp://host:port", no environment)
            store = dist.distributed_c10d._get_default_store()
            while hasattr(store, "underlying_store"):  # (PrefixStores around the TCPStore)
                store = store.underlying_store
            host, port = getattr(store, "host", ""), getattr(store, "port", 0)
            job = f"{host}:{port}" if host and port else ""
        except Exception:  # (no default store, or a store without an address)
            job = ""
    if not job:
        return ""
    ranks = dist.get_process_group_ranks(group) if dist is not None else None
    return "s" + hashlib.sha256(f"{job}|{ranks}".encode()).hexdigest()[:12]


def agreed_instance_tag(group: Any, comm: Any) -> str:
    """An instance tag for one Buffer's daemon groups (proto/group_names.py), the same on all
    its ranks and unlike any other Buffer's: the daemon's rendezvous is node-wide by name, so
    two EP groups, two jobs or two Buffers of one group must not share one (their ranks would
    meet in one daemon group). Rank 0's random token, shared with a collective over the
    Buffer's group (as DeepEP's constructor exchanges its IPC handles); none for a Buffer made
    with rank=/num_ranks= only (no group to agree over: its caller names it, group_name=)."""
    import secrets
    token = secrets.token_hex(6)
    if comm is not None and group is None and hasattr(comm, "bcast"):  # mpi4py
        return str(comm.bcast(token, root=0))
    dist = _distributed_of(group)
    if dist is not None:
        tokens: list[Any] = [None] * group.size()
        dist.all_gather_object(tokens, token, group=group)
        return str(tokens[0])
    return ""


class _GroupKey(NamedTuple):
    """The shape a daemon group is formed for (a Buffer forms one per shape, lazily; a named
    tuple: made and hashed on every call, which a frozen dataclass does several times slower)."""

    hidden: int
    num_topk: int
    dtype: str  # numpy dtype.str of the combine dtype
    num_experts: int
    low_latency_tokens: int  # num_max_dispatch_tokens_per_rank of a low-latency group, else 0


def _max_tokens(given: int | None) -> int:
    """The normal-mode capacity: the keyword, else EPD_MAX_TOKENS_PER_RANK, else 4096."""
    raw = given if given is not None else (os.environ.get(MAX_TOKENS_ENV) or DEFAULT_MAX_TOKENS)
    try:
        n = int(raw)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{MAX_TOKENS_ENV}={raw!r} is not a number of tokens") from None
    if n <= 0:
        where = "max_tokens_per_rank" if given is not None else MAX_TOKENS_ENV
        raise InvalidArgument(f"{where} must be positive, got {n}")
    return n


class Buffer(LowLatencyMixin):
    """DeepEP V1's `deep_ep.Buffer` over an EPD daemon (see the module docstring).

    Constructor arguments are DeepEP's, in its order, with its defaults (V1 commit
    567632dd5981):

    - `group`: a torch.distributed ProcessGroup (`rank()`/`size()` are read), or None with
      `comm` (an mpi4py communicator: `Get_rank()`/`Get_size()`) or with EPD's `rank=` and
      `num_ranks=`. Kept as `.group` (the communicator when `comm` is used, as in DeepEP).
    - `num_nvl_bytes`, `num_rdma_bytes`: kept as attributes. The daemon owns and sizes its
      buffers; the token capacity of a normal-mode group is `max_tokens_per_rank=`.
    - `low_latency_mode`, `num_qps_per_rank`, `allow_nvlink_for_low_latency_mode`: kept; the
      daemon chooses transports and queue pairs. Low-latency calls work in either mode.
    - `allow_mnnvl`, `use_fabric`: multi-node NVLink and fabric memory concern buffers a
      process shares with its peers; EPD's buffers live in the node's daemon, so there is
      nothing to allocate either way. Accepted, kept as attributes.
    - `explicitly_destroy`: as in DeepEP, True means resources go only at `destroy()`, else
      also when the Buffer is collected. `destroy()` works either way (DeepEP asserts the flag).
    - `enable_shrink`: rank masking in the low-latency groups (DeepEP's shrink mode): a rank
      that goes away is masked by the daemon and the others' low-latency calls go on without
      it; `low_latency_update_mask_buffer` / `query` / `clean` work on the group's mask, which
      its ranks share (DeepEP's is per rank). Both backends mask a rank that went away and a
      live rank by a call; a replacement comes back with `low_latency_rejoin`.
    - `comm`: see `group`.

    EPD's own keyword-only arguments: `rank`, `num_ranks`, `endpoint`, `socket_dir`, `engine`
    (default: `EPD_ENGINE`, else the current CUDA device when torch CUDA is available, else
    `LOCAL_RANK`, else 0), `group_name` (the prefix of this Buffer's daemon group names,
    which the daemon's rendezvous matches node-wide; default "deep_ep", and then, built with
    `group` / `comm`, its groups also carry an instance tag its ranks agree on at
    construction, a collective as DeepEP's constructor is, so that no two Buffers meet in one
    daemon group (with `enable_shrink` a tag a replacement recomputes: the job's
    torchelastic run id or rendezvous address, and the group's global ranks); a caller
    that passes rank= and num_ranks= names its Buffers where several share a node; the
    service-class policy and the metrics see the name without its tag),
    `max_tokens_per_rank` (the normal-mode token capacity per rank and call that groups
    start with; default
    `EPD_MAX_TOKENS_PER_RANK`, else 4096; a call beyond it grows the group, see `_grow`),
    `timeout`, `session`,
    `service_class` ("latency" for decode, "throughput" for prefill and training; default
    `EPD_SERVICE_CLASS`, else the daemon's policy default for the group's name): every group
    this Buffer joins gets it.
    """

    num_sms: int = 20

    def __init__(self, group: Any = None,  # a torch.distributed ProcessGroup
                 num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm: Any = None, *, rank: int | None = None,
                 num_ranks: int | None = None, endpoint: str | None = None,
                 socket_dir: str | None = None, engine: int | None = None,
                 group_name: str | None = None, max_tokens_per_rank: int | None = None,
                 timeout: float | None = None, session: Session | None = None,
                 service_class: str | None = None) -> None:
        if group is not None:
            rank, num_ranks = group.rank(), group.size()
        elif comm is not None:
            rank, num_ranks = comm.Get_rank(), comm.Get_size()
        if rank is None or num_ranks is None:
            raise InvalidArgument("Buffer needs a torch.distributed group, an mpi4py comm, or "
                                  "rank= and num_ranks=")
        self.group = group if group is not None else comm
        self.rank, self.group_size = int(rank), int(num_ranks)
        self._destroyed = False  # destroy() ran: the handles made here fail (_owner_of)
        # This Buffer's groups carry an instance tag its ranks agree on (a collective, as
        # DeepEP's constructor is), unless named, or found again by a replacement (shrink).
        if group_name is not None and group_names.INSTANCE_SEP in group_name:
            raise InvalidArgument(f"group_name {group_name!r}: {group_names.INSTANCE_SEP!r} "
                                  f"starts the instance tag of a group name")
        if group_name is not None:
            self._instance = ""
        elif enable_shrink:  # (a replacement must find the groups: a tag it can recompute)
            self._instance = job_instance_tag(group)
            if not self._instance:
                # No job identity: the tag its ranks agree on now, as for any Buffer. Two jobs
                # of no identity met in one daemon group and swapped tokens (a review); a
                # replacement cannot find these groups again (it needs group_name= then).
                self._instance = agreed_instance_tag(group, comm)
                log.warning("Buffer(enable_shrink=True) without a job identity "
                            "(TORCHELASTIC_RUN_ID, MASTER_ADDR/MASTER_PORT or a tcp:// store): "
                            "a replacement rank cannot find its groups; pass group_name= to "
                            "let it")
        else:
            self._instance = agreed_instance_tag(group, comm)
        group_name = group_name or DEFAULT_GROUP_NAME
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl, self.use_fabric = allow_mnnvl, use_fabric
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.group_name = group_name
        self.max_tokens_per_rank = _max_tokens(max_tokens_per_rank)
        self._first_max_tokens = self.max_tokens_per_rank
        # The service class of this Buffer's groups: the keyword, else EPD_SERVICE_CLASS (for
        # frameworks that build the Buffer themselves), else the daemon's policy default.
        if service_class is None:
            service_class = os.environ.get(SERVICE_CLASS_ENV) or None
        service_class_value(service_class)  # InvalidArgument now, not at the first call
        self.service_class = service_class
        self.timeout = timeout
        self._comm_stream: Any = None
        self._client_name = f"{group_name}-rank{rank}"
        plain_ops = plain_op_limit()  # (InvalidArgument before a session is opened)
        if session is None:
            if engine is None:
                engine = C.default_engine()
            session = Session(endpoint, socket_dir=socket_dir, engine=engine,
                              client_name=self._client_name, timeout=timeout,
                              service_class=service_class)
            self._owns_session = True
        else:
            self._owns_session = False
        self.session = session
        self._groups: dict[_GroupKey, Group] = {}
        # Groups replaced by larger ones (token growth): kept while this rank holds handles
        # made on them (_leave_retired), else left.
        self._retired: list[Group] = []
        self._num_experts: int | None = None
        self._combine_buffers: dict[tuple[str, tuple[int, ...], bool], Array] = {}
        # Armed low-latency calls by the tensors they read (cuda backend).
        self._stream_ops = StreamOpCache(session.device_ordinal, plain_ops)
        self._ll_buffer = 0  # DeepEP's double buffer: low-latency dispatches alternate
        self._pending_masks: set[int] = set()
        self._buffer_keys = cuda_ipc.BufferKeys(session.device_ordinal)

    # -- DeepEP's static helpers -------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: DeepEP answers whether its SM90 (FP8) kernels were built; EPD's daemon takes
        FP8 payloads on every backend, so callers that gate FP8 paths on it may use them."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """The SM count the recommended configs carry (even, as in DeepEP)."""
        if new_num_sms % 2 != 0:
            raise InvalidArgument(f"The SM count must be even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current stream (DeepEP's `capture`): pass it as
        `previous_event`. Without CUDA, an event that waits for nothing."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch config for `num_ranks` ranks (with `Buffer.num_sms`)."""
        return C.recommended_config(C.DISPATCH_CONFIGS, Buffer.num_sms, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine config for `num_ranks` ranks (with `Buffer.num_sms`)."""
        return C.recommended_config(C.COMBINE_CONFIGS, Buffer.num_sms, num_ranks)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """DeepEP's minimum `num_rdma_bytes` for low-latency mode (its formula)."""
        return C.low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden,
                                            num_ranks, num_experts)

    def get_comm_stream(self) -> Any:
        """The stream this Buffer runs `async_finish` calls on: a `torch.cuda.Stream` of the
        current device (created at first use) when torch CUDA is available, else a
        `HostStream` whose methods are immediate."""
        if self._comm_stream is None:
            torch = torch_if_loaded()
            if torch is not None and torch.cuda.is_available():
                self._comm_stream = torch.cuda.Stream()
            else:
                self._comm_stream = C.HostStream()
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: Any, size: Any = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> Any:
        """Unsupported: DeepEP returns its raw NVL/RDMA buffer; EPD's buffers belong to the
        node's daemon and are not mapped into the client."""
        which = "RDMA" if use_rdma_buffer else "NVL"
        raise C.Unsupported(f"get_local_buffer_tensor: the {which} buffer lives in the EPD "
                            "daemon's engine and is not mapped into this process")

    def _run(self, template: Array, call, previous_event: EventOverlap | None,
             async_finish: bool, allocate_on_comm_stream: bool = False,
             inputs: tuple = ()) -> tuple[Any, EventOverlap]:
        return C.run_on_streams(self.get_comm_stream, template, call, previous_event,
                                async_finish, allocate_on_comm_stream, inputs)

    @staticmethod
    def _sms(g: Group, config: Config | None) -> int:
        """The SMs a call asks the daemon for, as DeepEP sizes its kernels: the config's, else
        `Buffer.num_sms` (the daemon bounds it by its own --num-sms). The cpu backend has no
        SMs to share."""
        if not g._ordered:  # (answered calls: the daemon's)
            return 0
        return int(config.num_sms) if config is not None else int(Buffer.num_sms)

    def _grow(self, old: Group, needed: int) -> Group:
        """Replace the normal-mode group of `key` by one holding `needed` tokens per rank and
        call (at least twice the old capacity). Every rank calls this at the same point with
        the same `needed` (each learnt it from the same failed collective, or from an argument
        that every rank passes alike), so all join the same new group; the old group stays for
        the handles made on it."""
        key = next(k for k, g in self._groups.items() if g is old)
        cap = max(needed, 2 * old.spec.max_tokens_per_rank)
        if cap > MAX_INT32:
            raise InvalidArgument(f"a group of {cap} tokens per rank is more than the daemon "
                                  f"takes ({MAX_INT32})")
        before = self.max_tokens_per_rank
        self.max_tokens_per_rank = max(before, cap)
        del self._groups[key]
        try:  # (a join that fails changes nothing: the old group stays this shape's)
            new = self._group(key.hidden, key.num_topk, dtypes.to_numpy(old.spec.x_dtype),
                              key.num_experts)
        except BaseException:
            self.max_tokens_per_rank = before
            self._groups[key] = old
            raise
        self._retired.append(old)
        return new

    def _leave_retired(self) -> None:
        """Leave the replaced groups of which this rank holds no handle any more: every call on
        them is a combine or cached dispatch of a handle, which this rank would have to make
        too (its peers' such calls would wait for it in vain; they fail at once instead)."""
        # (nor one holding calls captured in a CUDA graph: a replay triggers them there)
        for g in [g for g in self._retired if not g.live_handles and not g._captured]:
            self._retired.remove(g)
            if not g._left:
                g.leave()

    def _dispatch_growing(self, g: Group, num_worst_tokens: int, run):
        """run(g) on the normal-mode group `g`, growing it when the dispatch needs more
        tokens per rank than it holds: by num_worst_tokens (an argument every rank passes
        alike) before the call, else when the collective fails on every rank with
        TokenCapacityExceeded, then the same call again on the larger group. Replaced groups
        whose handles are all gone are left first."""
        if self._retired:
            self._leave_retired()
        if not 0 <= num_worst_tokens <= MAX_INT32:
            raise InvalidArgument(f"num_worst_tokens={num_worst_tokens} must lie in "
                                  f"[0, {MAX_INT32}]")
        try:
            g.settle_dispatches()  # (an earlier worst-case dispatch's failure, before growing)
            # One growth for both: what an earlier worst-case dispatch needed (its failure
            # raised already) and this call's num_worst_tokens.
            need = max(g.capacity_owed, -(-num_worst_tokens // g.num_ranks)
                       if num_worst_tokens > g.num_ranks * g.spec.max_tokens_per_rank else 0)
            if need:
                g = self._grow(g, need)
            return g, run(g)
        except TokenCapacityExceeded as e:
            if e.earlier:  # an earlier worst-case dispatch failed, not this call (not sent on
                # any rank): grow for the next call, and tell the caller of the lost one
                self._grow(g, e.tokens_needed)
                raise
            g = self._grow(g, e.tokens_needed)
            return g, run(g)

    @staticmethod
    def _check_config(config: Config | None) -> None:
        if config is not None and not isinstance(config, Config):
            raise InvalidArgument(f"config must be a deep_ep Config, got {type(config).__name__}")

    # -- groups ------------------------------------------------------------------------------
    def _group(self, hidden: int, num_topk: int, dtype: np.dtype, num_experts: int,
               low_latency_tokens: int = 0) -> Group:
        """The daemon group of one shape. Low-latency calls get their own group whose buffers
        are sized by num_max_dispatch_tokens_per_rank (as DeepEP sizes its RDMA buffer)."""
        key = _GroupKey(hidden, num_topk, dtype.str, num_experts, low_latency_tokens)
        g = self._groups.get(key)
        if g is None:
            name = f"{self.group_name}/h{hidden}-k{num_topk}-{dtype.name}-e{num_experts}"
            if low_latency_tokens:
                name += f"-ll{low_latency_tokens}"
            elif self.max_tokens_per_rank != self._first_max_tokens:  # grown (see _grow)
                name += f"-t{self.max_tokens_per_rank}"
            name = group_names.tagged(name, self._instance)
            g = self._join(name, rank=self.rank, num_ranks=self.group_size,
                           num_experts=num_experts, hidden=hidden,
                           max_tokens_per_rank=low_latency_tokens or self.max_tokens_per_rank,
                           num_topk=num_topk, dtype=dtypes.name(dtypes.from_numpy(dtype)),
                           low_latency_mode=bool(low_latency_tokens),
                           timeout=self.timeout, service_class=self.service_class,
                           shrink=self.enable_shrink and bool(low_latency_tokens))
            self._groups[key] = g
            if low_latency_tokens and self.enable_shrink:
                self._apply_pending_masks(g)
        return g

    def _join(self, name: str, **kw: Any) -> Group:
        """Join `name`; where the daemon runs class engines and the group's class (its policy's,
        when the Buffer asked for none) is served by the device's other engine, the engine
        refuses naming that engine's socket, and a Buffer that owns its session and has joined
        nothing yet moves its session there once (no tensor was registered on the old one)."""
        try:
            return self.session.join(name, **kw)
        except EpdError as e:
            other = (engine_sockets.hinted_socket(e.details, self.session.endpoint)
                     if e.code == grpc.StatusCode.FAILED_PRECONDITION else None)
            if other is None or not self._owns_session or self._groups or self._retired:
                raise
        old = self.session
        self.session = Session(other, client_name=self._client_name, timeout=old.timeout)
        old.close()
        self._stream_ops = StreamOpCache(self.session.device_ordinal, plain_op_limit())
        self._buffer_keys = cuda_ipc.BufferKeys(self.session.device_ordinal)
        return self.session.join(name, **kw)

    # -- the DeepEP API ----------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: Array, num_experts: int,
                            previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
        is_token_in_rank, event). num_tokens_per_rdma_rank (tokens per destination node, in
        ascending node order) is None unless the group spans nodes, as DeepEP intranode."""
        C.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        idx_shape, _ = T.meta(topk_idx, "topk_idx")
        if len(idx_shape) != 2:
            raise InvalidArgument(f"topk_idx must be 2-D, got shape {list(idx_shape)}")
        # Layout needs a group only for its engine (the round trip, or on the cuda backend the
        # group's local layout kernel); any hidden size will do, so use the normal-mode group
        # with this routing shape that holds the most tokens, or a small layout group. Every
        # rank makes the same calls, so every rank picks the same group (never by the token
        # count, which differs across ranks: forming a group is collective).
        g = max((g for key, g in self._groups.items()
                 if key.num_topk == idx_shape[1] and key.num_experts == num_experts
                 and not key.low_latency_tokens),
                key=lambda g: g.spec.max_tokens_per_rank, default=None)
        if g is None:
            g = self._group(LAYOUT_GROUP_HIDDEN, idx_shape[1], dtypes.BFLOAT16, num_experts)
        local = g._local_layout
        if idx_shape[0] > g.spec.max_tokens_per_rank and local is not None:
            # More tokens than the group holds (its dispatch grows it): the layout kernel runs
            # on the caller's stream as for any layout (it has no capacity), reading nothing
            # back to the host.
            call = lambda: local(topk_idx, beyond_capacity=True)  # noqa: E731
        elif idx_shape[0] > g.spec.max_tokens_per_rank:
            # The same without the kernel (the cpu backend, EPD_LOCAL_LAYOUT=0): computed here,
            # exactly as the engine would (a bad id is found by reading the ids back).
            call = lambda: C.layout_of(topk_idx, num_experts, self.group_size)  # noqa: E731
        else:
            call = lambda: g.get_dispatch_layout(topk_idx)  # noqa: E731
        (per_rank, per_expert, in_rank), event = self._run(
            topk_idx, call, previous_event, async_finish, allocate_on_comm_stream, (topk_idx,))
        self._num_experts = num_experts  # (a dispatch without num_tokens_per_expert)
        per_node = None
        if len(set(g.rank_nodes)) > 1:  # cluster mode, a group over several nodes
            per_node = C.tokens_per_node(in_rank, g.rank_nodes)
        return per_rank, per_node, per_expert, in_rank, event

    def dispatch(self, x: Array, handle: BufferHandle | None = None,
                 num_tokens_per_rank: Array = None, num_tokens_per_rdma_rank: Array = None,
                 is_token_in_rank: Array = None, num_tokens_per_expert: Array = None,
                 topk_idx: Array = None, topk_weights: Array = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event); recv_x is a (fp8, scales) tuple when x was (scales float32 or int32 [T, H/128],
        e.g. vLLM's MXFP8 packed UE8M0 words: carried bit for bit, returned in the same dtype;
        every rank the same dtype). The tuple's payload may be any one-byte type, as DeepEP's
        (int8 or uint8 of int8 block quantisation, float8_e5m2): its bytes travel as e4m3 and
        recv_x comes back in the caller's type. Cached mode (handle given) returns
        (recv_x, None, None, None, None, event), as DeepEP does. The handle is indexable as
        DeepEP's tuple (see BufferHandle)."""
        self._check_config(config)
        C.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        for name, v in (("expert_alignment", expert_alignment),
                        ("num_worst_tokens", num_worst_tokens)):
            if not 0 <= int(v) <= MAX_INT32:  # (before a group is joined for the call)
                raise InvalidArgument(f"{name}={v} must lie in [0, {MAX_INT32}] (it does not "
                                      f"fit in 32 bits otherwise)")
        if isinstance(x, tuple) and len(x) != 2:
            raise InvalidArgument(f"x is a tensor or an (fp8 x, scales) pair, got a tuple of "
                                  f"{len(x)}")
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        payload = None  # a one-byte type other than e4m3: carried as e4m3 bytes, returned as
        if x_scales is not None:  # the caller's type
            x, payload = T.as_fp8_bytes(x)
        # (DeepEP's tests pass scales column-major: the call makes them row-dense, inside the
        # call so that the copy runs on the stream the call runs on, after previous_event)
        x_shape, x_dtype = T.meta(x, "x")
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise InvalidArgument("cached dispatch (handle given) takes no "
                                      "topk_idx/topk_weights")
            _, handle = self._owner_of(handle, BufferHandle, "dispatch")
            g = handle.handle.group  # (the group of the Buffer that made it: _owner_of)
            out, event = self._run(
                x, lambda: g.dispatch(x, x_scales=T.rows_dense(x_scales), handle=handle.handle,
                                      expert_alignment=expert_alignment, timeout=self.timeout,
                                      num_worst_tokens=num_worst_tokens,
                                      num_sms=self._sms(g, config)),
                previous_event, async_finish, allocate_on_comm_stream, (x, x_scales))
            recv = ((T.viewed_as(out.recv_x, payload), out.recv_x_scales)
                    if x_scales is not None else out.recv_x)
            return recv, None, None, None, None, event
        if topk_idx is None and topk_weights is None:
            recv, *rest = self._dispatch_without_topk(
                x, x_scales, x_shape, x_dtype, is_token_in_rank, num_tokens_per_expert,
                expert_alignment, num_worst_tokens, previous_event, async_finish,
                allocate_on_comm_stream)
            if payload is not None:
                recv = (T.viewed_as(recv[0], payload), recv[1])
            return (recv, *rest)
        if topk_idx is None or topk_weights is None:
            raise InvalidArgument("dispatch needs both topk_idx and topk_weights (or neither, "
                                  "routing by is_token_in_rank; or a cached handle)")
        num_experts = (len(num_tokens_per_expert) if num_tokens_per_expert is not None
                       else self._num_experts)
        if num_experts is None:
            raise InvalidArgument("pass num_tokens_per_expert (from get_dispatch_layout) so the "
                             "number of experts is known")
        idx_shape, _ = T.meta(topk_idx, "topk_idx")
        if len(x_shape) != 2 or len(idx_shape) != 2:
            raise InvalidArgument(f"x and topk_idx must be 2-D, got shapes {list(x_shape)} and "
                                  f"{list(idx_shape)}")
        combine_dtype = dtypes.BFLOAT16 if x_scales is not None else x_dtype
        g = self._group(x_shape[1], idx_shape[1], combine_dtype, int(num_experts))
        g, (out, event) = self._dispatch_growing(
            g, num_worst_tokens, lambda g: self._run(
                x, lambda: g.dispatch(x, topk_idx, topk_weights,
                                      x_scales=T.rows_dense(x_scales),
                                      expert_alignment=expert_alignment, timeout=self.timeout,
                                      num_worst_tokens=num_worst_tokens,
                                      num_sms=self._sms(g, config)),
                previous_event, async_finish, allocate_on_comm_stream,
                (x, x_scales, topk_idx, topk_weights)))
        recv = ((T.viewed_as(out.recv_x, payload), out.recv_x_scales)
                if x_scales is not None else out.recv_x)
        counts = [] if num_worst_tokens else out.num_recv_tokens_per_expert
        h = BufferHandle(out.handle, int(num_experts), rank_prefix_matrix=out.rank_prefix_matrix,
                         recv_src_idx=out.recv_src_idx, is_token_in_rank=is_token_in_rank,
                         topk_idx=topk_idx, owner=self)
        return recv, out.recv_topk_idx, out.recv_topk_weights, counts, h, event

    def _dispatch_without_topk(self, x, x_scales, x_shape, x_dtype, is_token_in_rank,
                               num_tokens_per_expert, expert_alignment, num_worst_tokens,
                               previous_event, async_finish, allocate_on_comm_stream):
        """DeepEP V1's dispatch without top-k: tokens go where `is_token_in_rank` says,
        `num_tokens_per_expert` gives the receive counts; recv_topk_idx/weights are None."""
        if is_token_in_rank is None or num_tokens_per_expert is None:
            raise InvalidArgument("dispatch without topk_idx routes by is_token_in_rank and "
                                  "needs num_tokens_per_expert (both from get_dispatch_layout)")
        if len(x_shape) != 2:
            raise InvalidArgument(f"x must be 2-D, got shape {list(x_shape)}")
        per_expert_shape, _ = T.meta(num_tokens_per_expert, "num_tokens_per_expert")
        if len(per_expert_shape) != 1:
            raise InvalidArgument(f"num_tokens_per_expert must be 1-D, got shape "
                                  f"{list(per_expert_shape)}")
        (num_experts,) = per_expert_shape
        combine_dtype = dtypes.BFLOAT16 if x_scales is not None else x_dtype
        # Any normal-mode group of this shape serves (its top-k only sizes buffers that a
        # top-k-free dispatch does not use); the first call of a shape forms one with top-1.
        g = next((grp for key, grp in self._groups.items()
                  if key.hidden == x_shape[1] and key.dtype == combine_dtype.str
                  and key.num_experts == num_experts and not key.low_latency_tokens), None)
        if g is None:
            g = self._group(x_shape[1], 1, combine_dtype, int(num_experts))
        g, (out, event) = self._dispatch_growing(
            g, num_worst_tokens, lambda g: self._run(
                x, lambda: g.dispatch(x, x_scales=T.rows_dense(x_scales),
                                      expert_alignment=expert_alignment,
                                      num_worst_tokens=num_worst_tokens, timeout=self.timeout,
                                      is_token_in_rank=is_token_in_rank,
                                      num_tokens_per_expert=num_tokens_per_expert),
                previous_event, async_finish, allocate_on_comm_stream,
                (x, x_scales, is_token_in_rank, num_tokens_per_expert)))
        recv = (out.recv_x, out.recv_x_scales) if x_scales is not None else out.recv_x
        h = BufferHandle(out.handle, int(num_experts), rank_prefix_matrix=out.rank_prefix_matrix,
                         recv_src_idx=out.recv_src_idx, is_token_in_rank=is_token_in_rank,
                         owner=self)
        return recv, None, None, out.num_recv_tokens_per_expert, h, event

    def combine(self, x: Array, handle: BufferHandle, topk_weights: Array = None,
                bias: Array = None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """(combined_x, combined_topk_weights, event). `handle` may come from another Buffer
        of the same group (a framework that replaced its Buffer between forward and backward,
        as Megatron-LM's fused_a2a does): the call runs on the handle's own daemon group."""
        self._check_config(config)
        C.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        _, handle = self._owner_of(handle, BufferHandle, "dispatch")
        if bias is None:
            bias_0 = bias_1 = None
        elif isinstance(bias, tuple):
            if len(bias) > 2:
                raise InvalidArgument("bias takes at most two tensors")
            bias_0, bias_1 = (*bias, None, None)[:2]
        else:
            bias_0, bias_1 = bias, None
        g = handle.handle.group  # (the group of the Buffer that made it: _owner_of)
        (cx, cw), event = self._run(
            x, lambda: g.combine(x, handle.handle, topk_weights=topk_weights, bias_0=bias_0,
                                 bias_1=bias_1, timeout=self.timeout,
                                 num_sms=self._sms(g, config)),
            previous_event, async_finish, allocate_on_comm_stream,
            (x, topk_weights, bias_0, bias_1))
        return cx, cw, event

    # DeepEP V1's Buffer has these as public methods (its `dispatch` / `combine` call them when
    # the group spans nodes), with the same parameters in the same order; callers may call them
    # directly. EPD's dispatch and combine serve every placement (internode included, with the
    # intranode-shaped handle: README, DeepEP section), so they are the same calls.
    def internode_dispatch(self, x: Array, handle: BufferHandle | None = None,
                           num_tokens_per_rank: Array = None,
                           num_tokens_per_rdma_rank: Array = None,
                           is_token_in_rank: Array = None, num_tokens_per_expert: Array = None,
                           topk_idx: Array = None, topk_weights: Array = None,
                           expert_alignment: int = 1, num_worst_tokens: int = 0,
                           config: Config | None = None,
                           previous_event: EventOverlap | None = None,
                           async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP V1's internode dispatch: `dispatch`, the same arguments and results."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                             is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                             expert_alignment, num_worst_tokens, config, previous_event,
                             async_finish, allocate_on_comm_stream)

    def internode_combine(self, x: Array, handle: BufferHandle, topk_weights: Array = None,
                          bias: Array = None, config: Config | None = None,
                          previous_event: EventOverlap | None = None,
                          async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP V1's internode combine: `combine`, the same arguments and results."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event,
                            async_finish, allocate_on_comm_stream)

    def _owner_of(self, handle: Any, cls: type, made_by: str) -> tuple[Buffer, Any]:
        """(the Buffer that made `handle`, the `cls` handle): `handle` may be its unpacked parts
        (handles.repacked). The owner is this Buffer, or another Buffer of the same group (same
        group object, rank and size), whose daemon group the call then runs on, as DeepEP's
        handle (plain tensors) works with any Buffer of its group. The handle keeps that
        Buffer alive (client/handles.py); only its destroy() ends the handle."""
        handle = repacked(handle, cls)
        if not isinstance(handle, cls):
            raise InvalidArgument(f"handle must be one a {made_by} of a Buffer of this group "
                                  f"returned (or its parts, tuple(handle)), got "
                                  f"{type(handle).__name__}")
        owner = handle.owner if handle.owner is not None else self
        if owner is not self and ((owner.rank, owner.group_size) != (self.rank, self.group_size)
                                  or (owner.group is not self.group
                                      and owner.group != self.group)):
            raise InvalidArgument(
                f"handle made by a Buffer of another group (rank {owner.rank} of "
                f"{owner.group_size}): this Buffer is rank {self.rank} of {self.group_size} of "
                f"its own group; a handle goes to a Buffer of the group that made it")
        if owner._destroyed:
            raise FailedPrecondition(
                "this handle's Buffer was destroyed (destroy()): it left the daemon groups its "
                "handles name; destroy a Buffer once no handle of it is used any more")
        return owner, handle

    def destroy(self) -> None:
        """Leave every group and close the session (idempotent). Every group is left and the
        session closed even when a leave fails (the daemon went away); the first failure is
        raised after that. The handles of this Buffer fail from then on (FAILED_PRECONDITION),
        with this Buffer or any other. In a forked child (whose copy of the session is the
        parent's: client/fork_guard.py) it only forgets them."""
        self._destroyed = True
        if not self.session.usable_here:
            self._groups.clear()
            self._retired.clear()
            return
        failed: EpdError | None = None
        try:
            for g in [*self._groups.values(), *self._retired]:
                if not g._left:
                    try:
                        g.leave()
                    except EpdError as e:
                        failed = failed or e
                        if e.code in UNANSWERED:  # (a stopped or wedged engine: each leave
                            break  # would wait its whole deadline; the session's close, or
                            # its lease's end, takes the rest)
        finally:
            self._groups.clear()
            self._retired.clear()
            self._stream_ops.clear()
            self._combine_buffers.clear()  # (cuda: freed; cpu: regions until the session ends)
            if self._owns_session:
                self.session.close()
        if failed is not None:
            raise failed

    def __del__(self) -> None:
        # (not while a handle of this Buffer lives: each holds it, client/handles.py). Not at
        # interpreter exit either: closing the session's gRPC channel then waits for threads
        # that no longer run, and the process hung; its exit ends the lease anyway, which
        # leaves its groups as a crashed client's.
        if sys.is_finalizing():
            return
        if not getattr(self, "explicitly_destroy", True):
            with contextlib.suppress(Exception):
                self.destroy()
