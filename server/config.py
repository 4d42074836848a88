"""Daemon configuration: defaults < TOML file (--config) < environment (EPD_*) < flags.

Every field of `Config` is a flag `--field-name`, an environment variable `EPD_FIELD_NAME` and a
key `field_name` in the optional TOML file (top level or under `[epd]`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..proto import engine_sockets
from . import tenant_pools
from .service_classes import MAX_NUM_SMS, Policy, parse_policy, policy_text

ENV_PREFIX = "EPD_"
MAX_ENGINES = 256  # engine processes of one node: more is a typo, not a node's devices
MAX_NODES = 1024  # nodes of one cluster (node 0's lease events carry every node's engines)
# The secret the supervisor gives each engine at spawn (environment), sent by the engine as gRPC
# metadata on the Node RPCs that only engines may call (Rendezvous, ReleaseRank, GetBootstrap).
NODE_TOKEN_ENV = "EPD_NODE_TOKEN"
NODE_TOKEN_METADATA = "epd-node-token"
# The cluster's shared secret (--cluster-token-file), sent by every supervisor on every call of
# node 0's Cluster service.
CLUSTER_TOKEN_METADATA = "epd-cluster-token"


def node_metadata() -> tuple[tuple[str, str], ...]:
    """gRPC metadata that authenticates an engine's calls to its supervisor's Node service."""
    return ((NODE_TOKEN_METADATA, os.environ.get(NODE_TOKEN_ENV, "")),)


@dataclass
class Config:
    backend: str = field(default="auto", metadata={
        "help": "cpu, cuda, or auto (cuda when CuPy sees a GPU, else cpu)",
        "choices": ("auto", "cpu", "cuda")})
    engines: int = field(default=0, metadata={
        "help": "engine processes; cpu backend: default 2; cuda: one per visible GPU"})
    socket_dir: str = field(default="/run/epd", metadata={
        "help": "folder for the unix sockets (node.sock, gpu<N>.sock), created 0750"})
    shm_dir: str = field(default="/dev/shm", metadata={
        "help": "must be a writable folder; nothing is created in it (shared memory travels "
                "as memfds): only files of engines of older versions are swept from it"})
    metrics_host: str = field(default="127.0.0.1", metadata={
        "help": "address of the HTTP endpoint (/metrics, /healthz, /readyz)"})
    metrics_port: int = field(default=9464, metadata={
        "help": "port of the HTTP endpoint; 0 picks a free port"})
    timeout_seconds: float = field(default=10.0, metadata={
        "help": "default deadline of a collective and of a group rendezvous"})
    max_sessions: int = field(default=256, metadata={"help": "sessions per engine"})
    max_sessions_per_uid: int = field(default=64, metadata={
        "help": "sessions per engine of one client uid (0 = no cap below --max-sessions): one "
                "tenant cannot hold all of an engine's sessions"})
    max_regions_per_session: int = field(default=256, metadata={
        "help": "registered regions per session (each holds a mapping; RESOURCE_EXHAUSTED "
                "beyond it)"})
    max_region_bytes_per_session: int = field(default=64 << 30, metadata={
        "help": "bytes of registered regions per session, with the engine memory its groups' "
                "outputs take (cpu backend)"})
    max_groups_per_session: int = field(default=64, metadata={
        "help": "group memberships per session (also bounded by the counter page's slots)"})
    max_stream_ops_per_session: int = field(default=1024, metadata={
        "help": "armed stream-ordered calls per session (CUDA-graph captured calls among "
                "them; a group holds at most 255)"})
    max_group_label_values: int = field(default=256, metadata={
        "help": "distinct group labels (a name with its owner: each tenant's copy of a "
                "name is one) a process labels metrics with; later groups are labelled "
                "group=\"_overflow\""})
    max_handles_per_session: int = field(default=4096, metadata={
        "help": "dispatch handles a session holds at once, over all its groups (kept until "
                "the client releases them or the session ends; RESOURCE_EXHAUSTED beyond it)"})
    max_handle_bytes_per_session: int = field(default=4 << 30, metadata={
        "help": "engine memory (host and GPU) a session's dispatch handles may hold at once: "
                "a handle's routing arrays grow with its tokens (RESOURCE_EXHAUSTED beyond it)"})
    per_expert_metrics: bool = field(default=False, metadata={
        "help": "export per-expert receive counts (high cardinality)"})
    restart_backoff_seconds: float = field(default=1.0, metadata={
        "help": "delay before restarting a crashed engine (doubled for each start in a row "
                "that fails before the engine is ready)"})
    restart_backoff_max_seconds: float = field(default=60.0, metadata={
        "help": "longest delay between restarts of an engine that keeps failing to start"})
    engine_start_timeout_seconds: float = field(default=900.0, metadata={
        "help": "an engine not serving this long after its start is killed and counts as a "
                "failed start (restarted after its backoff): one stuck in its device's set-up "
                "would otherwise stay 'not ready' for good; 0: no limit"})
    engine_unresponsive_seconds: float = field(default=15.0, metadata={
        "help": "a ready engine that has not answered its health check (every few seconds) "
                "this long is marked not ready (/readyz, epd_engine_up 0) until it answers "
                "again"})
    engine_hung_seconds: float = field(default=300.0, metadata={
        "help": "... and killed (then restarted, its groups aborted) once it has not answered "
                "this long: a wedged engine otherwise holds its clients to their deadlines for "
                "good; 0: never killed"})
    drain_seconds: float = field(default=15.0, metadata={
        "help": "on SIGTERM, how long running collectives may take to finish"})
    session_keepalive_seconds: float = field(default=20.0, metadata={
        "help": "how often an engine pings a client's connection while it is idle; a client "
                "that does not answer within as long again (a stopped or frozen process) loses "
                "its session, and its groups are aborted (0: off; the OS's TCP keepalive, "
                "hours, then decides)"})
    log_level: str = field(default="info", metadata={
        "help": "debug, info, warning or error",
        "choices": ("debug", "info", "warning", "error")})
    fast_path: bool = field(default=True, metadata={
        "help": "offer clients the same-host shared-memory fast path"})
    fast_path_spin_us: int = field(default=50, metadata={
        "help": "fast path: microseconds the engine spins for the next request before it "
                "sleeps (0 = always sleep; idle CPU is ~0 either way)"})
    fast_path_spin_max_us: int = field(default=1000, metadata={
        "help": "fast path: while a session's requests come in quick succession, the engine "
                "spins through the gaps between them (1.5x their recent average) up to this "
                "long instead of sleeping, and on the cuda backend its clients spin as long "
                "for answers that come that quickly; 0 or <= fast_path_spin_us: a fixed spin "
                "(proto/spin.py SpinWindow)"})
    gil_switch_us: int = field(default=200, metadata={
        "help": "engine: the interpreter's thread switch interval (sys.setswitchinterval): "
                "how long a thread that wakes for a call (the stream-op poller, a session's "
                "fast-path thread) may wait for the GIL while another runs Python; lower "
                "favours latency groups' launches under a throughput group's load"})
    gc_freeze: bool = field(default=True, metadata={
        "help": "engine: once started, take its startup objects out of the garbage "
                "collector's walks (gc.freeze), which stop every thread serving calls; off: "
                "the collector as CPython sets it (pauses: epd_engine_gc_pause_seconds)"})
    stream_op_spin_us: int = field(default=5000, metadata={
        "help": "stream-ordered calls: microseconds the engine polls armed ops' trigger "
                "rings without sleeping after the last trigger (a GPU cannot wake a futex; then "
                "it polls every stream_op_poll_us, less often as its rings stay idle: "
                "stream_op_idle_poll_us). Long enough to span the gaps between a "
                "decode step's low-latency calls and between steps, so a serving loop's "
                "triggers are seen by a spinning poller (one core while calls come; "
                "docs/DESIGN_NOTES.md, 'The poller spins through a decode loop')"})
    stream_op_busy_spin_us: int = field(default=200, metadata={
        "help": "stream-ordered calls: the poller's spin after a trigger instead of "
                "stream_op_spin_us while this engine's sessions also serve calls (a call left "
                "less than stream_op_spin_us ago): its looks take the GIL their threads need; "
                "on one H200 the long spin in an engine serving a prefill pool too made "
                "decode 1.3x slower (docs/DESIGN_NOTES.md, 'The poller spins through a decode "
                "loop')"})
    stream_op_poll_us: int = field(default=50, metadata={
        "help": "stream-ordered calls: polling period once idle (the added latency bound "
                "for stream_op_spin_us past the spin; then it grows to stream_op_idle_poll_us)"})
    stream_op_idle_poll_us: int = field(default=500, metadata={
        "help": "stream-ordered calls: the longest polling period of rings that stay idle: "
                "stream_op_poll_us for stream_op_spin_us past the spin, then a sixteenth of "
                "the time idle beyond that, up to this (a look costs ~20-30 µs of CPU: at "
                "50 µs one captured normal-mode call kept a fifth of a core busy for as long "
                "as it was armed). The first trigger after a long idle stretch waits up to "
                "this longer; an arm restarts the spin. Below stream_op_poll_us: no back-off; at "
                "most 100000"})
    serial_enqueue: bool = field(default=True, metadata={
        "help": "cuda backend: the sessions' stream-ordered normal-mode calls enqueue their "
                "GPU work one at a time (a lock around each call's launches; the poller's "
                "armed low-latency launches stay outside it); several threads of one process "
                "launching at once made each launch 2.5-4x slower on the H200 "
                "(docs/BENCHMARKS.md)"})
    ll_chain: str = field(default="auto", metadata={
        "help": "cuda backend: run a member's armed low-latency ops on a GPU chain (the "
                "client's trigger kernel publishes the call, kernels enqueued ahead run it, "
                "no engine host on the call's path) instead of the engine's poller. on, off, "
                "or auto: on for a member whose client shares the engine's MPS server (without "
                "MPS a chained pair is ~15x slower), except in shrink groups (a rejoin takes "
                "the ranks' sequences from the engines' hosts) and groups over nodes (not run "
                "on a GPU chained), and only with --cuda-max-connections of at least 32 (fewer "
                "hardware queues: parked chains stall other streams); a bare --ll-chain is on. "
                "At most --ll-chain-members chains per engine, later members on the poller. On "
                "one H200 under MPS the chain took a sixth off a graph-replayed decode pair "
                "and a fifth off the decode pool's p50 (docs/BENCHMARKS.md, twenty-seventh "
                "session). A chained member refuses synchronous low-latency calls",
        "choices": ("auto", "on", "off"), "const": "on"})
    ll_chain_gate: bool = field(default=False, metadata={
        "help": "cuda backend: a chain waits for each trigger in a spinning one-thread kernel "
                "instead of a GPU stream wait"})
    ll_chain_graphs: bool = field(default=True, metadata={
        "help": "cuda backend: a chain enqueues each instance as one CUDA graph launch (64 "
                "graphs per chain, room for --ll-chain-members chains' made before the engine "
                "serves) instead of a stream wait and four launches: the engine's host work "
                "per low-latency call about halves (docs/BENCHMARKS.md, thirty-first session)"})
    ll_chain_poll_us: int = field(default=500, metadata={
        "help": "cuda backend: while every armed ring of an engine is chained, the poller "
                "tops the chains up every this many microseconds instead of spinning (a chain "
                "holds 64 instances ahead: no call waits for the look); 0 spins as for the "
                "poller's own rings; at most 2000"})
    ll_chain_members: int = field(default=8, metadata={
        "help": "cuda backend: members per engine with a chain (each holds one stream "
                "blocked in a GPU wait, i.e. one of the engine's hardware queues); later "
                "members' ops use the poller"})
    fast_path_slots: int = field(default=16, metadata={
        "help": "fast path: requests in flight per session (1-1024)"})
    fast_path_slot_bytes: int = field(default=16384, metadata={
        "help": "fast path: bytes of a ring slot when the client asks for no size (a message "
                "larger than a slot goes by gRPC; 4096-1048576)"})
    max_timeout_seconds: float = field(default=600.0, metadata={
        "help": "longest deadline a call may ask for (timeout_seconds of a request)"})
    num_sms: int = field(default=0, metadata={
        "help": "cuda backend: SMs used by the data kernels (0 = 24; above the "
                "GPU's SM count the engine refuses to start)"})
    ll_num_sms: int = field(default=64, metadata={
        "help": "cuda backend: blocks of the low-latency kernels (latency-bound: more blocks, "
                "more rows in flight; keep two ranks' worth under the GPU's SM count; the default "
                "is cut to the GPU's count, a larger value set is refused at start)"})
    cuda_max_connections: int = field(default=32, metadata={
        "help": "cuda backend: CUDA_DEVICE_MAX_CONNECTIONS of the engines (hardware work "
                "queues; each rank's stream may park in a GPU-side wait for its client, so "
                "one queue per rank keeps one wait from stalling another). Under MPS every "
                "client's queues come from one pool per GPU, so the engine's share leaves "
                "fewer clients: lower it on nodes with many client processes (1-32; below 32 "
                "--ll-chain auto leaves decode's armed ops on the poller)"})
    nvshmem_heap_bytes: int = field(default=4 << 30, metadata={
        "help": "cuda backend: symmetric heap per engine"})
    latency_heap_bytes: int = field(default=0, metadata={
        "help": "cuda backend with --class-engines: symmetric heap of each latency engine, "
                "sized to the latency groups; 0 = --nvshmem-heap-bytes"})
    mps: str = field(default="auto", metadata={
        "help": "CUDA MPS for the engines and their clients: on (use the node's MPS control "
                "daemon, else start a private one in <socket-dir>/mps; an error if neither "
                "can be), auto (on where the backend is cuda and nvidia-cuda-mps-control is "
                "on PATH, else off) or off; clients join with eval \"$(epd env)\"",
        "choices": ("auto", "on", "off")})
    allow_uids: str = field(default="", metadata={
        "help": "comma-separated uids whose group names are one namespace (a shared pool: "
                "list its every uid); by default each uid's group names are its own, so "
                "only its sessions meet in them"})
    allow_gids: str = field(default="", metadata={
        "help": "comma-separated gids whose members (primary gid of the client) share the "
                "--allow-uids namespace"})
    tenant_pools: str = field(default="", metadata={
        "help": "tenants that get engines of their own on every device (their own processes "
                "and GPU heaps: on the cuda backend the tenants of one engine can read each "
                "other's buffers): semicolon-separated NAME=ID[,ID...], an ID a uid or gid:N "
                "(primary gid), e.g. \"team-a=1001,1002;team-b=gid:2000\"; a pool's uids share "
                "group names and open sessions only on gpu<D>.tenant-NAME.sock (a client that "
                "opens one on gpu<D>.sock is sent there), other uids never there. One node"})
    service_class_policy: str = field(default="", metadata={
        "help": "service classes of groups: comma-separated rules "
                "PATTERN[@UID[+UID...]]=CLASS[/MOST], first match wins: groups whose name "
                "matches the fnmatch PATTERN (joined by one of the uids, if given) get CLASS "
                "(latency or throughput) unless they ask, and may ask for at most MOST "
                "(default CLASS), e.g. \"decode-*=latency, *@1001=throughput/latency, "
                "*=throughput\". Empty: any group may ask for either, default throughput; "
                "with rules, unmatched groups get throughput only"})
    class_engines: str = field(default="auto", metadata={
        "help": "two engine processes per device: one runs the latency groups (on "
                "gpu<D>.latency.sock), the other the throughput groups (on gpu<D>.sock), so "
                "a decode group's launches never wait behind a prefill group's driver calls; "
                "on the cuda backend each class's engines form their own NVSHMEM world and "
                "hold their own heap (--nvshmem-heap-bytes and --latency-heap-bytes per GPU); "
                "wants MPS. on, off, or auto: on where the backend is cuda, the daemon is one "
                "node and --service-class-policy lets some group have the latency class "
                "(a bare --class-engines is on)",
        "choices": ("auto", "on", "off"), "const": "on"})
    throughput_mps_percentage: int = field(default=0, metadata={
        "help": "with --class-engines under MPS: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of the "
                "throughput engines (1-100; 0 = none), the share of each GPU's SMs a "
                "throughput group's kernels may occupy at once, the rest left to the latency "
                "engines' kernels"})
    latency_num_sms: int = field(default=0, metadata={
        "help": "cuda backend: blocks of a latency group's data kernels (normal mode uses it "
                "instead of --num-sms, low-latency at most it); a client's num_sms is bounded "
                "by it (0 = the daemon's defaults)"})
    throughput_num_sms: int = field(default=0, metadata={
        "help": "cuda backend: blocks of a throughput group's data kernels, as "
                "--latency-num-sms (e.g. keep prefill under a share of the SMs)"})
    slow_operation_seconds: float = field(default=30.0, metadata={
        "help": "log an operation still running after this long, once, with the stack of the "
                "thread running it (a stall no deadline reaches explains itself; 0: off)"})
    throughput_pause_us: int = field(default=0, metadata={
        "help": "pacing: longest wait of a throughput group's call for latency groups' work "
                "in flight in the engine before it starts (0, the default: off; 1000 cut decode "
                "latency under prefill by a sixth and prefill throughput by a third on one "
                "H200)"})

    node_rank: int = field(default=0, metadata={
        "help": "cluster mode: this node's rank (0 serves the Cluster service and forms groups "
                "spanning nodes)"})
    num_nodes: int = field(default=1, metadata={
        "help": "nodes of the cluster; 1 (default) is a single-node daemon with no TCP port"})
    cluster_address: str = field(default="", metadata={
        "help": "cluster mode: host:port of node 0's Cluster service (node 0 listens there, "
                "the other nodes connect to it)"})
    cluster_token_file: str = field(default="", metadata={
        "help": "cluster mode: file holding the cluster's shared secret (required when "
                "num_nodes > 1; the same on every node)"})
    cluster_tls_cert: str = field(default="", metadata={
        "help": "cluster mode, optional mutual TLS on the Cluster port (with cluster_tls_key "
                "and cluster_tls_ca; all three or none): this node's certificate chain, PEM; "
                "node 0's must name the host of cluster_address"})
    cluster_tls_key: str = field(default="", metadata={
        "help": "cluster mode, mutual TLS: this node's private key, PEM"})
    cluster_tls_ca: str = field(default="", metadata={
        "help": "cluster mode, mutual TLS: the CA certificates (PEM) a peer's certificate must "
                "chain to (node 0 refuses a node without one, a node refuses a node 0 without "
                "one)"})
    cluster_plaintext: bool = field(default=False, metadata={
        "help": "cluster mode: allow the Cluster port without TLS on an address other than "
                "loopback; the cluster token then crosses the network in the clear (anyone "
                "who sees it can pose as a node, or as node 0): for a network only the "
                "cluster's nodes reach"})
    cluster_heartbeat_seconds: float = field(default=1.0, metadata={
        "help": "cluster mode: heartbeat period of a node's lease; node 0 ends a lease after "
                "3 missed heartbeats (a broken stream ends it at once); the same on every "
                "node (node 0 refuses a node whose period differs)"})
    cuda_cluster: bool = field(default=False, metadata={
        "help": "experimental, cluster mode with the cuda backend: the engines of every node "
                "form one NVSHMEM world; groups may span nodes (low-latency mode up to 64 "
                "ranks, normal mode up to 8, or 8 nodes x 8 ranks in two stages: hierarchical "
                "semantics and traffic when placed node-major, see --cuda-hierarchical); run "
                "as logical "
                "nodes on one GPU only so far (docs/DESIGN_NOTES.md)"})
    cuda_hierarchical: str = field(default="auto", metadata={
        "help": "with --cuda-cluster, how a normal-mode group placed node-major over nodes "
                "moves its rows: stages (DeepEP's traffic: a token crosses the network once "
                "per destination node, to the rank with its local index there, which forwards "
                "it inside the node; up to 8 nodes x 8 ranks), direct (a put to every "
                "destination rank, up to 8 ranks: faster on one GPU, and no run on two hosts "
                "has shown where stages win yet) or auto (the default: direct up to 8 ranks, "
                "stages beyond, except for a low-latency group, which keeps its low-latency "
                "buffers alone); the same results, every call stream-ordered",
        "choices": ("auto", "stages", "direct")})

    @property
    def cluster_mode(self) -> bool:
        return self.num_nodes > 1

    @property
    def allowed_uids(self) -> frozenset[int]:
        return parse_ids("allow_uids", self.allow_uids)

    @property
    def allowed_gids(self) -> frozenset[int]:
        return parse_ids("allow_gids", self.allow_gids)

    @property
    def tenants(self) -> tuple[tenant_pools.TenantPool, ...]:
        return tenant_pools.parse(self.tenant_pools)

    @property
    def class_engines_on(self) -> bool:
        """Two engines per device (resolved: `resolve_class_engines` decides auto)."""
        return self.class_engines == "on"

    @property
    def service_classes(self) -> Policy:
        return parse_policy(self.service_class_policy)

    @property
    def socket_path(self) -> Path:
        return Path(self.socket_dir)

    def engine_socket(self, device: int, service_class: str = "", tenant_pool: str = "") -> str:
        """gpu<D>.sock; a latency class engine's (--class-engines) gpu<D>.latency.sock; a tenant
        pool's engine's gpu<D>[.latency].tenant-<pool>.sock."""
        return engine_sockets.socket_path(self.socket_dir, device, service_class, tenant_pool)

    @staticmethod
    def engine_failure_file(socket: str) -> str:
        """Where the engine serving `socket` leaves why it could not start (gpu<D>.failed)."""
        return engine_sockets.failure_file(socket)

    @property
    def node_socket(self) -> str:
        return str(Path(self.socket_dir) / "node.sock")

    def to_env(self) -> dict[str, str]:
        """The environment that hands this configuration to an engine process."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[ENV_PREFIX + f.name.upper()] = str(int(v) if isinstance(v, bool) else v)
        return out


AUTO_CHAIN_QUEUES = 32  # --ll-chain auto chains nothing with fewer hardware queues


def chain_limit(config: Any) -> int:
    """Chains per engine. Each parks one of the engine's hardware queues in a GPU wait, and a
    stream that shares a queue with a parked chain stalls behind it: on one H200 under MPS two
    ranks' chains on CUDA's default 8 queues stalled each other for 5-7 ms per pair, and on
    EPD's 32 (`--cuda-max-connections`) they did not (docs/DESIGN_NOTES.md, "The low-latency
    chain, built and measured"). So auto chains only with at least those 32 queues, at most
    --ll-chain-members; `on` takes --ll-chain-members as given."""
    if config.ll_chain == "on" or config.cuda_max_connections >= AUTO_CHAIN_QUEUES:
        return config.ll_chain_members
    return 0


def in_pool(uid: int, gid: int, allow_uids: frozenset[int], allow_gids: frozenset[int]) -> bool:
    """Whether a client of `uid` (primary `gid`) names its groups in the shared pool of
    --allow-uids / --allow-gids, not in its uid's own namespace (the coordinator's scope, the
    metrics' owner label)."""
    return uid in allow_uids or gid in allow_gids


def parse_ids(name: str, text: str) -> frozenset[int]:
    """"1001,1002" -> {1001, 1002}; ValueError naming the setting otherwise (an id is a
    uid_t / gid_t: 0 to 2**32 - 2, since 2**32 - 1 is the kernel's "no id")."""
    try:
        ids = frozenset(int(t) for t in str(text).replace(" ", "").split(",") if t)
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated numeric ids, got {text!r}") from None
    bad = sorted(i for i in ids if not 0 <= i < 2**32 - 1)
    if bad:
        raise ValueError(f"{name}: ids lie in [0, {2**32 - 2}], got {bad}")
    return ids


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
_SWITCH = ("auto", "on", "off")


def _convert(f: dataclasses.Field, raw: Any) -> Any:
    kind = type(f.default)
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(f"{f.name}: expected a boolean, got {raw!r}")
    if f.metadata.get("choices") == _SWITCH:  # (a boolean spelling too: EPD_CLASS_ENGINES=1)
        text = str(raw).strip().lower() if not isinstance(raw, bool) else str(int(raw))
        if text in _TRUE:
            return "on"
        if text in _FALSE[:-1]:
            return "off"
    if ((kind in (int, float) and isinstance(raw, bool))
            or (kind is int and isinstance(raw, float))):
        # (TOML: `engines = 2.7` was 2, `timeout_seconds = true` 1.0, without a word)
        raise ValueError(f"{f.name}: expected {kind.__name__}, got {raw!r}")
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{f.name}: expected {kind.__name__}, got {raw!r}") from None
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ValueError(f"{f.name}: {value!r} is not one of {list(choices)}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=os.environ.get(ENV_PREFIX + "CONFIG"),
                        help="TOML file with any of the settings below (env: EPD_CONFIG)")
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        env = ENV_PREFIX + f.name.upper()
        help_text = f"{f.metadata.get('help', '')} (default {f.default!r}; env {env})"
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif "const" in f.metadata:  # (the flag alone means its const: --class-engines)
            parser.add_argument(flag, type=str, default=None, help=help_text, nargs="?",
                                const=f.metadata["const"], metavar=f.name.upper())
        else:
            parser.add_argument(flag, type=str, default=None, help=help_text,
                                metavar=f.name.upper())
        if f.metadata.get("choices") == _SWITCH:  # (--no-FLAG is off, as for the booleans:
            # --ll-chain was one until it had auto)
            parser.add_argument("--no-" + flag[2:], dest=f.name, action="store_const",
                                const="off", default=None, help=f"the same as {flag} off")


def load(ns: argparse.Namespace | None = None, env: dict[str, str] | None = None) -> Config:
    """Merge the sources; raises ValueError with the offending setting named."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = getattr(ns, "config", None) if ns is not None else env.get(ENV_PREFIX + "CONFIG")
    fields = {f.name: f for f in dataclasses.fields(Config)}
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as e:
            raise ValueError(f"--config {path}: cannot read it ({e.strerror or e}): give an "
                             f"existing TOML file") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"--config {path}: not a TOML file ({e}): fix its syntax") from None
        data = data.get("epd", data)
        if not isinstance(data, dict):
            raise ValueError(f"--config {path}: `epd` must be a table ([epd]) of settings, "
                             f"got {type(data).__name__}")
        unknown = set(data) - set(fields)
        if unknown:
            raise ValueError(f"{path}: unknown settings {sorted(unknown)}")
        if "service_class_policy" in data:  # a string, or a list of tables
            data = dict(data, service_class_policy=policy_text(data["service_class_policy"]))
        values.update(data)
    for name in fields:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = raw
    if ns is not None:
        for name in fields:
            raw = getattr(ns, name, None)
            if raw is not None:
                values[name] = raw
    cfg = Config(**{k: _convert(fields[k], v) for k, v in values.items()})
    for f in dataclasses.fields(Config):  # (NaN passes every `<` check below: no deadline,
        v = getattr(cfg, f.name)            # a backoff no clock ever reaches)
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{f.name} must be a finite number, got {v}")
    if cfg.timeout_seconds <= 0:
        raise ValueError("timeout_seconds must be positive")
    if cfg.max_timeout_seconds <= 0:
        raise ValueError("max_timeout_seconds must be positive")
    if cfg.timeout_seconds > cfg.max_timeout_seconds:  # (was: every default deadline clamped)
        raise ValueError(f"timeout_seconds ({cfg.timeout_seconds:g}) must be at most "
                         f"max_timeout_seconds ({cfg.max_timeout_seconds:g})")
    _check_range(cfg, "metrics_port", 0, 65535)
    if not cfg.metrics_host.strip():  # (an empty one bound every interface, unsaid: /metrics
        # names every tenant's groups)
        raise ValueError("metrics_host must be an address (0.0.0.0 or :: to serve the HTTP "
                         "endpoint on every interface)")
    for name in ("restart_backoff_seconds", "restart_backoff_max_seconds",
                 "engine_start_timeout_seconds", "drain_seconds", "engine_hung_seconds"):
        _check_range(cfg, name, 0)
    # (gRPC takes the keepalive in int32 milliseconds: beyond, every engine start failed)
    _check_range(cfg, "session_keepalive_seconds", 0, 86400)
    _check_range(cfg, "engine_unresponsive_seconds", 1)
    if 0 < cfg.engine_hung_seconds < cfg.engine_unresponsive_seconds:
        raise ValueError(f"engine_hung_seconds ({cfg.engine_hung_seconds:g}) must be 0 or at "
                         f"least engine_unresponsive_seconds "
                         f"({cfg.engine_unresponsive_seconds:g})")
    _check_range(cfg, "engines", 0, MAX_ENGINES, "0: one per device; cpu backend 2")
    _check_limits(cfg)
    cfg.allowed_uids, cfg.allowed_gids  # noqa: B018  (ValueError naming the setting)
    tenant_pools.check_apart(cfg.tenants, cfg.allowed_uids, cfg.allowed_gids)
    _check_socket_paths(cfg)
    if cfg.tenants and cfg.num_nodes > 1:
        raise ValueError("tenant_pools is for one node (num_nodes 1): a world over several "
                         "nodes has one engine per device")
    cfg.service_classes  # noqa: B018  (ValueError naming the rule)
    for name in ("latency_num_sms", "throughput_num_sms"):
        _check_range(cfg, name, 0, MAX_NUM_SMS, "0: the daemon's defaults")
    _check_range(cfg, "cuda_max_connections", 1, 32)
    _check_range(cfg, "slow_operation_seconds", 0, note="0: off")
    _check_range(cfg, "throughput_pause_us", 0, 1_000_000, "0: no pacing")
    check_cluster(cfg)
    _check_range(cfg, "latency_heap_bytes", 0, note="0: nvshmem_heap_bytes")
    _check_range(cfg, "throughput_mps_percentage", 0, 100, "0: none")
    if cfg.throughput_mps_percentage and cfg.class_engines == "off":
        raise ValueError(_NO_SHARE)
    if cfg.class_engines == "on" and cfg.num_nodes > 1:
        raise ValueError("class_engines is for one node (num_nodes 1): a world over several "
                         "nodes has one engine per device")
    return cfg


MAX_SOCKET_PATH = 107  # bytes of a unix socket's path (sun_path, its NUL excluded)


def _check_socket_paths(cfg: Config) -> None:
    """Every engine's socket path fits a unix socket (up to --engines devices, else 10): a
    longer one failed only when its engine bound it, which then restarted for ever (a review,
    with a tenant pool's longer names)."""
    for name in ("socket_dir", "shm_dir"):  # (an empty or NUL-bearing path was a traceback)
        value = getattr(cfg, name)
        if not value or "\0" in value:
            raise ValueError(f"{name} {value!r}: must name a folder (non-empty, no NUL byte)")
    pools = [""] + [p.name for p in cfg.tenants]
    classes = ("",) if cfg.class_engines == "off" else ("", "latency")
    device = cfg.engines - 1 if cfg.engines > 0 else 9
    longest = max((cfg.engine_socket(device, cls, pool) for pool in pools for cls in classes),
                  key=lambda p: len(os.fsencode(p)))
    if len(os.fsencode(longest)) > MAX_SOCKET_PATH:
        raise ValueError(f"socket_dir: an engine's socket path would be "
                         f"{len(os.fsencode(longest))} bytes ({longest}), more than a unix "
                         f"socket takes ({MAX_SOCKET_PATH}): use a shorter --socket-dir"
                         f"{' or shorter --tenant-pools names' if cfg.tenants else ''}")


_NO_SHARE = ("throughput_mps_percentage needs class_engines: on one engine per GPU it would "
             "cap the latency groups' kernels too")


def resolve_class_engines(cfg: Config, backend: str, pays: bool) -> tuple[Config, str]:
    """`cfg` with class_engines on or off (auto decided for the resolved `backend`, on which
    class engines `pays`: backends.class_engines_pay), and why.

    auto is on where it pays: a backend whose engine process serialises the classes' launches
    (cuda), one node, and a policy under which some group may be latency (a policy that names
    no latency class has no decode pool to protect; the empty policy lets anyone ask, and a
    second heap per GPU for what may never come is not a default)."""
    if cfg.class_engines != "auto":
        on, why = cfg.class_engines == "on", f"--class-engines {cfg.class_engines}"
    elif not pays:
        on, why = False, f"auto: the {backend} backend gains nothing from them"
    elif cfg.num_nodes > 1:
        on, why = False, "auto: cluster mode runs one engine per device"
    elif not any(r.most == "latency" for r in cfg.service_classes.rules):
        on, why = False, "auto: the service-class policy gives no group the latency class"
    else:
        on, why = True, "auto: the service-class policy has latency groups"
    if cfg.throughput_mps_percentage and not on:
        raise ValueError(f"{_NO_SHARE} (class engines are off: {why})")
    return dataclasses.replace(cfg, class_engines="on" if on else "off"), why


def _check_limits(cfg: Config) -> None:
    """The engines' sizes and counts: each in the range its user takes (the fast-path ring's
    limits are the ones the engine checks a client's request against, proto/ring.py)."""
    from ..proto import ring

    for name in ("max_sessions", "max_regions_per_session", "max_region_bytes_per_session",
                 "max_groups_per_session", "max_handles_per_session",
                 "max_handle_bytes_per_session", "nvshmem_heap_bytes"):
        _check_range(cfg, name, 1)
    _check_range(cfg, "max_stream_ops_per_session", 0, note="0: none armed")
    _check_range(cfg, "fast_path_slots", 1, ring.MAX_SLOTS)
    _check_range(cfg, "fast_path_slot_bytes", ring.MIN_SLOT_BYTES, ring.MAX_SLOT_BYTES)
    for name in ("num_sms", "ll_num_sms"):
        _check_range(cfg, name, 0, MAX_NUM_SMS, "0: the per-GPU default")
    _check_range(cfg, "max_group_label_values", 0, note="0: every group labelled _overflow")
    _check_range(cfg, "max_sessions_per_uid", 0, note="0: no cap below --max-sessions")
    _check_range(cfg, "ll_chain_members", 0, note="0: no chain")
    for name in ("fast_path_spin_us", "fast_path_spin_max_us",
                 "stream_op_spin_us", "stream_op_busy_spin_us", "stream_op_poll_us"):
        _check_range(cfg, name, 0)
    # (the peers' kernels wait for this rank's late look: a tenth of a second at most)
    _check_range(cfg, "stream_op_idle_poll_us", 0, 100_000)
    # (2^63 µs aborted every engine in CPython's GIL wait: a restart loop, not an error)
    _check_range(cfg, "gil_switch_us", 0, 1_000_000)
    # (a chain holds 64 instances, a pair uses 2: naps much longer would let a busy decode
    # loop's chain run dry, and its calls wait for the poller again)
    _check_range(cfg, "ll_chain_poll_us", 0, 2000)


def _check_range(cfg: Config, name: str, low: float, high: float | None = None,
                 note: str = "") -> None:
    """ValueError naming setting `name` when it lies below `low` or above `high`."""
    v = getattr(cfg, name)
    if low <= v and (high is None or v <= high):
        return
    bound = f"lie in [{low}, {high}]" if high is not None else f"be >= {low}"
    raise ValueError(f"{name} must {bound}{f' ({note})' if note else ''}, got {v}")


def check_cluster(cfg: Config) -> None:
    """The cluster settings agree (ValueError naming the setting): a cluster needs an address
    and a shared secret, never an open port by default."""
    if cfg.num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {cfg.num_nodes}")
    if cfg.num_nodes > MAX_NODES:  # (node 0's topology answer grows with it: 10^6 passed
        # gRPC's 4 MiB and took seconds of the supervisor's loop per GetTopology)
        raise ValueError(f"num_nodes must be at most {MAX_NODES}, got {cfg.num_nodes}")
    if not 0 <= cfg.node_rank < cfg.num_nodes:
        raise ValueError(f"node_rank {cfg.node_rank} is out of range for num_nodes "
                         f"{cfg.num_nodes} (0..{cfg.num_nodes - 1})")
    if cfg.cluster_heartbeat_seconds <= 0:
        raise ValueError("cluster_heartbeat_seconds must be positive")
    tls = {"cluster_tls_cert": cfg.cluster_tls_cert, "cluster_tls_key": cfg.cluster_tls_key,
           "cluster_tls_ca": cfg.cluster_tls_ca}
    if any(tls.values()):
        missing = [k for k, v in tls.items() if not v]
        if missing:
            raise ValueError(f"mutual TLS on the Cluster port needs cluster_tls_cert, "
                             f"cluster_tls_key and cluster_tls_ca together; missing "
                             f"{', '.join(missing)}")
        if not cfg.cluster_mode:
            raise ValueError("cluster_tls_cert, cluster_tls_key and cluster_tls_ca are for "
                             "cluster mode (num_nodes > 1)")
    if not cfg.cluster_mode:
        return
    if not cfg.cluster_token_file:
        raise ValueError(f"num_nodes {cfg.num_nodes} needs cluster_token_file (a file holding "
                         f"the cluster's shared secret, the same on every node)")
    host, _, port = cfg.cluster_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"num_nodes {cfg.num_nodes} needs cluster_address host:port of node "
                         f"0's Cluster service, got {cfg.cluster_address!r}")
    if not any(tls.values()) and not cfg.cluster_plaintext and not _loopback(host):
        raise ValueError(f"cluster_address {cfg.cluster_address} is not loopback: the Cluster "
                         f"port needs mutual TLS there (cluster_tls_cert, cluster_tls_key, "
                         f"cluster_tls_ca), or cluster_plaintext on a network only the "
                         f"cluster's nodes reach (the token would cross it in the clear)")


def _loopback(host: str) -> bool:
    import ipaddress
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_pem(setting: str, path: str) -> bytes:
    """The PEM file of a TLS setting; ValueError naming the setting when it is missing,
    unreadable or holds no PEM block."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{setting} {path}: cannot read it ({e.strerror or e})") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{setting} {path}: no PEM block in it (expected -----BEGIN ...)")
    return data


def read_cluster_token(path: str) -> str:
    """The shared secret of --cluster-token-file (surrounding whitespace stripped); ValueError
    naming the setting when it is missing, unreadable or empty."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cluster_token_file {path}: cannot read it "
                         f"({getattr(e, 'strerror', None) or e})") from None
    if not token:
        raise ValueError(f"cluster_token_file {path}: the file is empty; put the cluster's "
                         f"shared secret in it")
    return token
