from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT8_E4M3: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    BOOL: _ClassVar[DType]
    UINT8: _ClassVar[DType]

class Backend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_UNSPECIFIED: _ClassVar[Backend]
    CPU: _ClassVar[Backend]
    CUDA: _ClassVar[Backend]

class ServiceClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVICE_CLASS_UNSPECIFIED: _ClassVar[ServiceClass]
    LATENCY: _ClassVar[ServiceClass]
    THROUGHPUT: _ClassVar[ServiceClass]
DTYPE_UNSPECIFIED: DType
BFLOAT16: DType
FLOAT16: DType
FLOAT32: DType
FLOAT8_E4M3: DType
INT64: DType
INT32: DType
BOOL: DType
UINT8: DType
BACKEND_UNSPECIFIED: Backend
CPU: Backend
CUDA: Backend
SERVICE_CLASS_UNSPECIFIED: ServiceClass
LATENCY: ServiceClass
THROUGHPUT: ServiceClass

class TensorDesc(_message.Message):
    __slots__ = ("region_id", "offset_bytes", "shape", "dtype", "strides")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    offset_bytes: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    strides: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, region_id: _Optional[str] = ..., offset_bytes: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., strides: _Optional[_Iterable[int]] = ...) -> None: ...

class GetTopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("index", "socket_path", "backend", "device_name", "device_uuid", "ready", "pid", "restarts", "sessions_without_mps", "failed_starts", "last_failure", "device", "service_class", "tenant_pool")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_WITHOUT_MPS_FIELD_NUMBER: _ClassVar[int]
    FAILED_STARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    TENANT_POOL_FIELD_NUMBER: _ClassVar[int]
    index: int
    socket_path: str
    backend: Backend
    device_name: str
    device_uuid: str
    ready: bool
    pid: int
    restarts: int
    sessions_without_mps: int
    failed_starts: int
    last_failure: str
    device: int
    service_class: str
    tenant_pool: str
    def __init__(self, index: _Optional[int] = ..., socket_path: _Optional[str] = ..., backend: _Optional[_Union[Backend, str]] = ..., device_name: _Optional[str] = ..., device_uuid: _Optional[str] = ..., ready: _Optional[bool] = ..., pid: _Optional[int] = ..., restarts: _Optional[int] = ..., sessions_without_mps: _Optional[int] = ..., failed_starts: _Optional[int] = ..., last_failure: _Optional[str] = ..., device: _Optional[int] = ..., service_class: _Optional[str] = ..., tenant_pool: _Optional[str] = ...) -> None: ...

class GetTopologyResponse(_message.Message):
    __slots__ = ("version", "node_name", "engines", "metrics_url", "mps_mode", "mps_pipe_directory", "service_class_policy", "latency_num_sms", "throughput_num_sms", "latency_groups", "throughput_groups", "cluster")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    MPS_MODE_FIELD_NUMBER: _ClassVar[int]
    MPS_PIPE_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_POLICY_FIELD_NUMBER: _ClassVar[int]
    LATENCY_NUM_SMS_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_NUM_SMS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    version: str
    node_name: str
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    metrics_url: str
    mps_mode: str
    mps_pipe_directory: str
    service_class_policy: str
    latency_num_sms: int
    throughput_num_sms: int
    latency_groups: int
    throughput_groups: int
    cluster: ClusterInfo
    def __init__(self, version: _Optional[str] = ..., node_name: _Optional[str] = ..., engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ..., metrics_url: _Optional[str] = ..., mps_mode: _Optional[str] = ..., mps_pipe_directory: _Optional[str] = ..., service_class_policy: _Optional[str] = ..., latency_num_sms: _Optional[int] = ..., throughput_num_sms: _Optional[int] = ..., latency_groups: _Optional[int] = ..., throughput_groups: _Optional[int] = ..., cluster: _Optional[_Union[ClusterInfo, _Mapping]] = ...) -> None: ...

class GroupSpec(_message.Message):
    __slots__ = ("name", "num_ranks", "num_experts", "hidden", "max_tokens_per_rank", "num_topk", "x_dtype", "low_latency_mode", "service_class", "shrink")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_TOPK_FIELD_NUMBER: _ClassVar[int]
    X_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOW_LATENCY_MODE_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    SHRINK_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_ranks: int
    num_experts: int
    hidden: int
    max_tokens_per_rank: int
    num_topk: int
    x_dtype: DType
    low_latency_mode: bool
    service_class: ServiceClass
    shrink: bool
    def __init__(self, name: _Optional[str] = ..., num_ranks: _Optional[int] = ..., num_experts: _Optional[int] = ..., hidden: _Optional[int] = ..., max_tokens_per_rank: _Optional[int] = ..., num_topk: _Optional[int] = ..., x_dtype: _Optional[_Union[DType, str]] = ..., low_latency_mode: _Optional[bool] = ..., service_class: _Optional[_Union[ServiceClass, str]] = ..., shrink: _Optional[bool] = ...) -> None: ...

class RendezvousRequest(_message.Message):
    __slots__ = ("spec", "rank", "engine_index", "session_id", "timeout_seconds", "attached", "group_id", "peer_uid", "peer_gid", "has_peer")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_UID_FIELD_NUMBER: _ClassVar[int]
    PEER_GID_FIELD_NUMBER: _ClassVar[int]
    HAS_PEER_FIELD_NUMBER: _ClassVar[int]
    spec: GroupSpec
    rank: int
    engine_index: int
    session_id: str
    timeout_seconds: float
    attached: bool
    group_id: str
    peer_uid: int
    peer_gid: int
    has_peer: bool
    def __init__(self, spec: _Optional[_Union[GroupSpec, _Mapping]] = ..., rank: _Optional[int] = ..., engine_index: _Optional[int] = ..., session_id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., attached: _Optional[bool] = ..., group_id: _Optional[str] = ..., peer_uid: _Optional[int] = ..., peer_gid: _Optional[int] = ..., has_peer: _Optional[bool] = ...) -> None: ...

class RendezvousResponse(_message.Message):
    __slots__ = ("group_id", "rank_engines", "plan", "rank_nodes", "rejoining")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_ENGINES_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    RANK_NODES_FIELD_NUMBER: _ClassVar[int]
    REJOINING_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    rank_engines: _containers.RepeatedScalarFieldContainer[int]
    plan: bytes
    rank_nodes: _containers.RepeatedScalarFieldContainer[int]
    rejoining: bool
    def __init__(self, group_id: _Optional[str] = ..., rank_engines: _Optional[_Iterable[int]] = ..., plan: _Optional[bytes] = ..., rank_nodes: _Optional[_Iterable[int]] = ..., rejoining: _Optional[bool] = ...) -> None: ...

class GetBootstrapRequest(_message.Message):
    __slots__ = ("engine_index",)
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    def __init__(self, engine_index: _Optional[int] = ...) -> None: ...

class GetBootstrapResponse(_message.Message):
    __slots__ = ("nvshmem_uid", "pe", "num_pes", "generation", "node_first_pe", "heap_bytes")
    NVSHMEM_UID_FIELD_NUMBER: _ClassVar[int]
    PE_FIELD_NUMBER: _ClassVar[int]
    NUM_PES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_FIRST_PE_FIELD_NUMBER: _ClassVar[int]
    HEAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    nvshmem_uid: bytes
    pe: int
    num_pes: int
    generation: int
    node_first_pe: _containers.RepeatedScalarFieldContainer[int]
    heap_bytes: int
    def __init__(self, nvshmem_uid: _Optional[bytes] = ..., pe: _Optional[int] = ..., num_pes: _Optional[int] = ..., generation: _Optional[int] = ..., node_first_pe: _Optional[_Iterable[int]] = ..., heap_bytes: _Optional[int] = ...) -> None: ...

class ReleaseRankRequest(_message.Message):
    __slots__ = ("group_id", "rank", "reason", "left")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    rank: int
    reason: str
    left: bool
    def __init__(self, group_id: _Optional[str] = ..., rank: _Optional[int] = ..., reason: _Optional[str] = ..., left: _Optional[bool] = ...) -> None: ...

class ReleaseRankResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name", "pid", "mps_pipe_directory", "mps_pipe_present", "channel_ticket")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MPS_PIPE_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    MPS_PIPE_PRESENT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_TICKET_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    pid: int
    mps_pipe_directory: str
    mps_pipe_present: bool
    channel_ticket: bytes
    def __init__(self, client_name: _Optional[str] = ..., pid: _Optional[int] = ..., mps_pipe_directory: _Optional[str] = ..., mps_pipe_present: _Optional[bool] = ..., channel_ticket: _Optional[bytes] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("opened", "group_aborted")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    GROUP_ABORTED_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    group_aborted: GroupAborted
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., group_aborted: _Optional[_Union[GroupAborted, _Mapping]] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session_id", "counter_page_bytes", "backend", "engine_index", "device_ordinal", "version", "default_timeout_seconds", "session_token", "fd_socket_path", "mps_pipe_directory", "client_on_engine_mps")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTER_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FD_SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    MPS_PIPE_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ON_ENGINE_MPS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    counter_page_bytes: int
    backend: Backend
    engine_index: int
    device_ordinal: int
    version: str
    default_timeout_seconds: float
    session_token: bytes
    fd_socket_path: str
    mps_pipe_directory: str
    client_on_engine_mps: bool
    def __init__(self, session_id: _Optional[str] = ..., counter_page_bytes: _Optional[int] = ..., backend: _Optional[_Union[Backend, str]] = ..., engine_index: _Optional[int] = ..., device_ordinal: _Optional[int] = ..., version: _Optional[str] = ..., default_timeout_seconds: _Optional[float] = ..., session_token: _Optional[bytes] = ..., fd_socket_path: _Optional[str] = ..., mps_pipe_directory: _Optional[str] = ..., client_on_engine_mps: _Optional[bool] = ...) -> None: ...

class GroupAborted(_message.Message):
    __slots__ = ("group_id", "reason")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    reason: str
    def __init__(self, group_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class JoinGroupRequest(_message.Message):
    __slots__ = ("session_id", "spec", "rank", "timeout_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    spec: GroupSpec
    rank: int
    timeout_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., spec: _Optional[_Union[GroupSpec, _Mapping]] = ..., rank: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class JoinGroupResponse(_message.Message):
    __slots__ = ("group_id", "rank", "output_region_id", "output_region_ipc", "output_region_bytes", "counter_slot", "service_class", "rank_nodes", "hierarchical", "two_stage")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_REGION_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_REGION_IPC_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    COUNTER_SLOT_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    RANK_NODES_FIELD_NUMBER: _ClassVar[int]
    HIERARCHICAL_FIELD_NUMBER: _ClassVar[int]
    TWO_STAGE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    rank: int
    output_region_id: str
    output_region_ipc: bytes
    output_region_bytes: int
    counter_slot: int
    service_class: ServiceClass
    rank_nodes: _containers.RepeatedScalarFieldContainer[int]
    hierarchical: bool
    two_stage: bool
    def __init__(self, group_id: _Optional[str] = ..., rank: _Optional[int] = ..., output_region_id: _Optional[str] = ..., output_region_ipc: _Optional[bytes] = ..., output_region_bytes: _Optional[int] = ..., counter_slot: _Optional[int] = ..., service_class: _Optional[_Union[ServiceClass, str]] = ..., rank_nodes: _Optional[_Iterable[int]] = ..., hierarchical: _Optional[bool] = ..., two_stage: _Optional[bool] = ...) -> None: ...

class LeaveGroupRequest(_message.Message):
    __slots__ = ("session_id", "group_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    group_id: str
    def __init__(self, session_id: _Optional[str] = ..., group_id: _Optional[str] = ...) -> None: ...

class LeaveGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterRegionRequest(_message.Message):
    __slots__ = ("session_id", "cuda_ipc_handle", "size_bytes", "device_ordinal")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cuda_ipc_handle: bytes
    size_bytes: int
    device_ordinal: int
    def __init__(self, session_id: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., device_ordinal: _Optional[int] = ...) -> None: ...

class RegisterRegionResponse(_message.Message):
    __slots__ = ("region_id", "size_bytes")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    size_bytes: int
    def __init__(self, region_id: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class UnregisterRegionRequest(_message.Message):
    __slots__ = ("session_id", "region_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    region_id: str
    def __init__(self, session_id: _Optional[str] = ..., region_id: _Optional[str] = ...) -> None: ...

class UnregisterRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDispatchLayoutRequest(_message.Message):
    __slots__ = ("session_id", "group_id", "topk_idx", "ready_event", "stream_ordered", "num_tokens_per_rank_out", "num_tokens_per_expert_out", "is_token_in_rank_out")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDX_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    STREAM_ORDERED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_PER_RANK_OUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_PER_EXPERT_OUT_FIELD_NUMBER: _ClassVar[int]
    IS_TOKEN_IN_RANK_OUT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    group_id: str
    topk_idx: TensorDesc
    ready_event: bytes
    stream_ordered: bool
    num_tokens_per_rank_out: TensorDesc
    num_tokens_per_expert_out: TensorDesc
    is_token_in_rank_out: TensorDesc
    def __init__(self, session_id: _Optional[str] = ..., group_id: _Optional[str] = ..., topk_idx: _Optional[_Union[TensorDesc, _Mapping]] = ..., ready_event: _Optional[bytes] = ..., stream_ordered: _Optional[bool] = ..., num_tokens_per_rank_out: _Optional[_Union[TensorDesc, _Mapping]] = ..., num_tokens_per_expert_out: _Optional[_Union[TensorDesc, _Mapping]] = ..., is_token_in_rank_out: _Optional[_Union[TensorDesc, _Mapping]] = ...) -> None: ...

class GetDispatchLayoutResponse(_message.Message):
    __slots__ = ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank", "stream_seq")
    NUM_TOKENS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_PER_EXPERT_FIELD_NUMBER: _ClassVar[int]
    IS_TOKEN_IN_RANK_FIELD_NUMBER: _ClassVar[int]
    STREAM_SEQ_FIELD_NUMBER: _ClassVar[int]
    num_tokens_per_rank: TensorDesc
    num_tokens_per_expert: TensorDesc
    is_token_in_rank: TensorDesc
    stream_seq: int
    def __init__(self, num_tokens_per_rank: _Optional[_Union[TensorDesc, _Mapping]] = ..., num_tokens_per_expert: _Optional[_Union[TensorDesc, _Mapping]] = ..., is_token_in_rank: _Optional[_Union[TensorDesc, _Mapping]] = ..., stream_seq: _Optional[int] = ...) -> None: ...

class DispatchRequest(_message.Message):
    __slots__ = ("session_id", "group_id", "x", "x_scales", "topk_idx", "topk_weights", "expert_alignment", "num_worst_tokens", "cached_handle", "timeout_seconds", "ready_event", "release_handles", "is_token_in_rank", "num_tokens_per_expert", "stream_ordered", "num_sms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    X_FIELD_NUMBER: _ClassVar[int]
    X_SCALES_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDX_FIELD_NUMBER: _ClassVar[int]
    TOPK_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    NUM_WORST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_HANDLE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    IS_TOKEN_IN_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_PER_EXPERT_FIELD_NUMBER: _ClassVar[int]
    STREAM_ORDERED_FIELD_NUMBER: _ClassVar[int]
    NUM_SMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    group_id: str
    x: TensorDesc
    x_scales: TensorDesc
    topk_idx: TensorDesc
    topk_weights: TensorDesc
    expert_alignment: int
    num_worst_tokens: int
    cached_handle: int
    timeout_seconds: float
    ready_event: bytes
    release_handles: _containers.RepeatedScalarFieldContainer[int]
    is_token_in_rank: TensorDesc
    num_tokens_per_expert: TensorDesc
    stream_ordered: bool
    num_sms: int
    def __init__(self, session_id: _Optional[str] = ..., group_id: _Optional[str] = ..., x: _Optional[_Union[TensorDesc, _Mapping]] = ..., x_scales: _Optional[_Union[TensorDesc, _Mapping]] = ..., topk_idx: _Optional[_Union[TensorDesc, _Mapping]] = ..., topk_weights: _Optional[_Union[TensorDesc, _Mapping]] = ..., expert_alignment: _Optional[int] = ..., num_worst_tokens: _Optional[int] = ..., cached_handle: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., ready_event: _Optional[bytes] = ..., release_handles: _Optional[_Iterable[int]] = ..., is_token_in_rank: _Optional[_Union[TensorDesc, _Mapping]] = ..., num_tokens_per_expert: _Optional[_Union[TensorDesc, _Mapping]] = ..., stream_ordered: _Optional[bool] = ..., num_sms: _Optional[int] = ...) -> None: ...

class DispatchResponse(_message.Message):
    __slots__ = ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert", "handle", "num_recv_tokens", "recv_src_idx", "rank_prefix_matrix", "counter_sequence", "stream_seq")
    RECV_X_FIELD_NUMBER: _ClassVar[int]
    RECV_X_SCALES_FIELD_NUMBER: _ClassVar[int]
    RECV_TOPK_IDX_FIELD_NUMBER: _ClassVar[int]
    RECV_TOPK_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECV_TOKENS_PER_EXPERT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RECV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECV_SRC_IDX_FIELD_NUMBER: _ClassVar[int]
    RANK_PREFIX_MATRIX_FIELD_NUMBER: _ClassVar[int]
    COUNTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STREAM_SEQ_FIELD_NUMBER: _ClassVar[int]
    recv_x: TensorDesc
    recv_x_scales: TensorDesc
    recv_topk_idx: TensorDesc
    recv_topk_weights: TensorDesc
    num_recv_tokens_per_expert: _containers.RepeatedScalarFieldContainer[int]
    handle: int
    num_recv_tokens: int
    recv_src_idx: TensorDesc
    rank_prefix_matrix: TensorDesc
    counter_sequence: int
    stream_seq: int
    def __init__(self, recv_x: _Optional[_Union[TensorDesc, _Mapping]] = ..., recv_x_scales: _Optional[_Union[TensorDesc, _Mapping]] = ..., recv_topk_idx: _Optional[_Union[TensorDesc, _Mapping]] = ..., recv_topk_weights: _Optional[_Union[TensorDesc, _Mapping]] = ..., num_recv_tokens_per_expert: _Optional[_Iterable[int]] = ..., handle: _Optional[int] = ..., num_recv_tokens: _Optional[int] = ..., recv_src_idx: _Optional[_Union[TensorDesc, _Mapping]] = ..., rank_prefix_matrix: _Optional[_Union[TensorDesc, _Mapping]] = ..., counter_sequence: _Optional[int] = ..., stream_seq: _Optional[int] = ...) -> None: ...

class CombineRequest(_message.Message):
    __slots__ = ("session_id", "group_id", "x", "handle", "topk_weights", "bias_0", "bias_1", "timeout_seconds", "ready_event", "stream_ordered", "num_sms", "out", "out_topk_weights")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    X_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    TOPK_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    BIAS_0_FIELD_NUMBER: _ClassVar[int]
    BIAS_1_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    STREAM_ORDERED_FIELD_NUMBER: _ClassVar[int]
    NUM_SMS_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    OUT_TOPK_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    group_id: str
    x: TensorDesc
    handle: int
    topk_weights: TensorDesc
    bias_0: TensorDesc
    bias_1: TensorDesc
    timeout_seconds: float
    ready_event: bytes
    stream_ordered: bool
    num_sms: int
    out: TensorDesc
    out_topk_weights: TensorDesc
    def __init__(self, session_id: _Optional[str] = ..., group_id: _Optional[str] = ..., x: _Optional[_Union[TensorDesc, _Mapping]] = ..., handle: _Optional[int] = ..., topk_weights: _Optional[_Union[TensorDesc, _Mapping]] = ..., bias_0: _Optional[_Union[TensorDesc, _Mapping]] = ..., bias_1: _Optional[_Union[TensorDesc, _Mapping]] = ..., timeout_seconds: _Optional[float] = ..., ready_event: _Optional[bytes] = ..., stream_ordered: _Optional[bool] = ..., num_sms: _Optional[int] = ..., out: _Optional[_Union[TensorDesc, _Mapping]] = ..., out_topk_weights: _Optional[_Union[TensorDesc, _Mapping]] = ...) -> None: ...

class CombineResponse(_message.Message):
    __slots__ = ("combined_x", "combined_topk_weights", "stream_seq")
    COMBINED_X_FIELD_NUMBER: _ClassVar[int]
    COMBINED_TOPK_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    STREAM_SEQ_FIELD_NUMBER: _ClassVar[int]
    combined_x: TensorDesc
    combined_topk_weights: TensorDesc
    stream_seq: int
    def __init__(self, combined_x: _Optional[_Union[TensorDesc, _Mapping]] = ..., combined_topk_weights: _Optional[_Union[TensorDesc, _Mapping]] = ..., stream_seq: _Optional[int] = ...) -> None: ...

class LowLatencyDispatchRequest(_message.Message):
    __slots__ = ("session_id", "group_id", "x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts", "use_fp8", "round_scale", "use_ue8m0", "cumulative_local_expert_recv_stats", "timeout_seconds", "ready_event", "release_handles", "buffer")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    X_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDX_FIELD_NUMBER: _ClassVar[int]
    NUM_MAX_DISPATCH_TOKENS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    USE_FP8_FIELD_NUMBER: _ClassVar[int]
    ROUND_SCALE_FIELD_NUMBER: _ClassVar[int]
    USE_UE8M0_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOCAL_EXPERT_RECV_STATS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    group_id: str
    x: TensorDesc
    topk_idx: TensorDesc
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    cumulative_local_expert_recv_stats: TensorDesc
    timeout_seconds: float
    ready_event: bytes
    release_handles: _containers.RepeatedScalarFieldContainer[int]
    buffer: int
    def __init__(self, session_id: _Optional[str] = ..., group_id: _Optional[str] = ..., x: _Optional[_Union[TensorDesc, _Mapping]] = ..., topk_idx: _Optional[_Union[TensorDesc, _Mapping]] = ..., num_max_dispatch_tokens_per_rank: _Optional[int] = ..., num_experts: _Optional[int] = ..., use_fp8: _Optional[bool] = ..., round_scale: _Optional[bool] = ..., use_ue8m0: _Optional[bool] = ..., cumulative_local_expert_recv_stats: _Optional[_Union[TensorDesc, _Mapping]] = ..., timeout_seconds: _Optional[float] = ..., ready_event: _Optional[bytes] = ..., release_handles: _Optional[_Iterable[int]] = ..., buffer: _Optional[int] = ...) -> None: ...

class LowLatencyDispatchResponse(_message.Message):
    __slots__ = ("recv_x", "recv_x_scales", "recv_count", "handle", "recv_src_rank", "recv_src_idx")
    RECV_X_FIELD_NUMBER: _ClassVar[int]
    RECV_X_SCALES_FIELD_NUMBER: _ClassVar[int]
    RECV_COUNT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    RECV_SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    RECV_SRC_IDX_FIELD_NUMBER: _ClassVar[int]
    recv_x: TensorDesc
    recv_x_scales: TensorDesc
    recv_count: TensorDesc
    handle: int
    recv_src_rank: TensorDesc
    recv_src_idx: TensorDesc
    def __init__(self, recv_x: _Optional[_Union[TensorDesc, _Mapping]] = ..., recv_x_scales: _Optional[_Union[TensorDesc, _Mapping]] = ..., recv_count: _Optional[_Union[TensorDesc, _Mapping]] = ..., handle: _Optional[int] = ..., recv_src_rank: _Optional[_Union[TensorDesc, _Mapping]] = ..., recv_src_idx: _Optional[_Union[TensorDesc, _Mapping]] = ...) -> None: ...

class LowLatencyCombineRequest(_message.Message):
    __slots__ = ("session_id", "group_id", "x", "topk_idx", "topk_weights", "handle", "out", "timeout_seconds", "ready_event")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    X_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDX_FIELD_NUMBER: _ClassVar[int]
    TOPK_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    group_id: str
    x: TensorDesc
    topk_idx: TensorDesc
    topk_weights: TensorDesc
    handle: int
    out: TensorDesc
    timeout_seconds: float
    ready_event: bytes
    def __init__(self, session_id: _Optional[str] = ..., group_id: _Optional[str] = ..., x: _Optional[_Union[TensorDesc, _Mapping]] = ..., topk_idx: _Optional[_Union[TensorDesc, _Mapping]] = ..., topk_weights: _Optional[_Union[TensorDesc, _Mapping]] = ..., handle: _Optional[int] = ..., out: _Optional[_Union[TensorDesc, _Mapping]] = ..., timeout_seconds: _Optional[float] = ..., ready_event: _Optional[bytes] = ...) -> None: ...

class LowLatencyCombineResponse(_message.Message):
    __slots__ = ("combined_x",)
    COMBINED_X_FIELD_NUMBER: _ClassVar[int]
    combined_x: TensorDesc
    def __init__(self, combined_x: _Optional[_Union[TensorDesc, _Mapping]] = ...) -> None: ...

class ArmStreamOpRequest(_message.Message):
    __slots__ = ("session_id", "group_id", "low_latency_dispatch", "low_latency_combine", "dispatch", "combine", "dispatch_op", "ring_trigger", "op_records")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    LOW_LATENCY_DISPATCH_FIELD_NUMBER: _ClassVar[int]
    LOW_LATENCY_COMBINE_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_FIELD_NUMBER: _ClassVar[int]
    COMBINE_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_OP_FIELD_NUMBER: _ClassVar[int]
    RING_TRIGGER_FIELD_NUMBER: _ClassVar[int]
    OP_RECORDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    group_id: str
    low_latency_dispatch: LowLatencyDispatchRequest
    low_latency_combine: LowLatencyCombineRequest
    dispatch: DispatchRequest
    combine: CombineRequest
    dispatch_op: int
    ring_trigger: bool
    op_records: bool
    def __init__(self, session_id: _Optional[str] = ..., group_id: _Optional[str] = ..., low_latency_dispatch: _Optional[_Union[LowLatencyDispatchRequest, _Mapping]] = ..., low_latency_combine: _Optional[_Union[LowLatencyCombineRequest, _Mapping]] = ..., dispatch: _Optional[_Union[DispatchRequest, _Mapping]] = ..., combine: _Optional[_Union[CombineRequest, _Mapping]] = ..., dispatch_op: _Optional[int] = ..., ring_trigger: _Optional[bool] = ..., op_records: _Optional[bool] = ...) -> None: ...

class ArmStreamOpResponse(_message.Message):
    __slots__ = ("op_id", "counter_slot", "low_latency_dispatch", "combined_x", "low_latency_dispatch_buffer1", "chained", "chain_slot", "chain_entry", "ordered", "dispatch", "counter_record")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTER_SLOT_FIELD_NUMBER: _ClassVar[int]
    LOW_LATENCY_DISPATCH_FIELD_NUMBER: _ClassVar[int]
    COMBINED_X_FIELD_NUMBER: _ClassVar[int]
    LOW_LATENCY_DISPATCH_BUFFER1_FIELD_NUMBER: _ClassVar[int]
    CHAINED_FIELD_NUMBER: _ClassVar[int]
    CHAIN_SLOT_FIELD_NUMBER: _ClassVar[int]
    CHAIN_ENTRY_FIELD_NUMBER: _ClassVar[int]
    ORDERED_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_FIELD_NUMBER: _ClassVar[int]
    COUNTER_RECORD_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    counter_slot: int
    low_latency_dispatch: LowLatencyDispatchResponse
    combined_x: TensorDesc
    low_latency_dispatch_buffer1: LowLatencyDispatchResponse
    chained: bool
    chain_slot: int
    chain_entry: int
    ordered: bool
    dispatch: DispatchResponse
    counter_record: int
    def __init__(self, op_id: _Optional[int] = ..., counter_slot: _Optional[int] = ..., low_latency_dispatch: _Optional[_Union[LowLatencyDispatchResponse, _Mapping]] = ..., combined_x: _Optional[_Union[TensorDesc, _Mapping]] = ..., low_latency_dispatch_buffer1: _Optional[_Union[LowLatencyDispatchResponse, _Mapping]] = ..., chained: _Optional[bool] = ..., chain_slot: _Optional[int] = ..., chain_entry: _Optional[int] = ..., ordered: _Optional[bool] = ..., dispatch: _Optional[_Union[DispatchResponse, _Mapping]] = ..., counter_record: _Optional[int] = ...) -> None: ...

class DisarmStreamOpRequest(_message.Message):
    __slots__ = ("session_id", "op_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    op_id: int
    def __init__(self, session_id: _Optional[str] = ..., op_id: _Optional[int] = ...) -> None: ...

class DisarmStreamOpResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenFastPathRequest(_message.Message):
    __slots__ = ("session_id", "slots", "slot_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    slots: int
    slot_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., slots: _Optional[int] = ..., slot_bytes: _Optional[int] = ...) -> None: ...

class OpenFastPathResponse(_message.Message):
    __slots__ = ("slots", "slot_bytes", "spin_seconds", "reply_spin_max_seconds")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLY_SPIN_MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    slots: int
    slot_bytes: int
    spin_seconds: float
    reply_spin_max_seconds: float
    def __init__(self, slots: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., spin_seconds: _Optional[float] = ..., reply_spin_max_seconds: _Optional[float] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseHandlesRequest(_message.Message):
    __slots__ = ("session_id", "group_id", "handles")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    group_id: str
    handles: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., group_id: _Optional[str] = ..., handles: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseHandlesResponse(_message.Message):
    __slots__ = ("handles",)
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handles: int
    def __init__(self, handles: _Optional[int] = ...) -> None: ...

class RankMaskRequest(_message.Message):
    __slots__ = ("session_id", "group_id", "mask", "unmask", "clean")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    UNMASK_FIELD_NUMBER: _ClassVar[int]
    CLEAN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    group_id: str
    mask: int
    unmask: int
    clean: bool
    def __init__(self, session_id: _Optional[str] = ..., group_id: _Optional[str] = ..., mask: _Optional[int] = ..., unmask: _Optional[int] = ..., clean: _Optional[bool] = ...) -> None: ...

class RankMaskResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, state: _Optional[_Iterable[int]] = ...) -> None: ...

class RejoinRequest(_message.Message):
    __slots__ = ("session_id", "group_id", "rank", "timeout_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    group_id: str
    rank: int
    timeout_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., group_id: _Optional[str] = ..., rank: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class RejoinResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, state: _Optional[_Iterable[int]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class GroupStats(_message.Message):
    __slots__ = ("group_id", "name", "rank", "num_ranks", "dispatches", "combines", "bytes_sent", "bytes_received", "aborted", "abort_reason", "handles", "service_class", "stream_priority", "num_sms", "ll_num_sms", "queued_calls", "queue_wait_seconds", "held_bytes", "hierarchical", "two_stage", "armed_calls")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    DISPATCHES_FIELD_NUMBER: _ClassVar[int]
    COMBINES_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    ABORT_REASON_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    STREAM_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NUM_SMS_FIELD_NUMBER: _ClassVar[int]
    LL_NUM_SMS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_CALLS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIERARCHICAL_FIELD_NUMBER: _ClassVar[int]
    TWO_STAGE_FIELD_NUMBER: _ClassVar[int]
    ARMED_CALLS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    name: str
    rank: int
    num_ranks: int
    dispatches: int
    combines: int
    bytes_sent: int
    bytes_received: int
    aborted: bool
    abort_reason: str
    handles: int
    service_class: ServiceClass
    stream_priority: int
    num_sms: int
    ll_num_sms: int
    queued_calls: int
    queue_wait_seconds: float
    held_bytes: int
    hierarchical: bool
    two_stage: bool
    armed_calls: int
    def __init__(self, group_id: _Optional[str] = ..., name: _Optional[str] = ..., rank: _Optional[int] = ..., num_ranks: _Optional[int] = ..., dispatches: _Optional[int] = ..., combines: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., aborted: _Optional[bool] = ..., abort_reason: _Optional[str] = ..., handles: _Optional[int] = ..., service_class: _Optional[_Union[ServiceClass, str]] = ..., stream_priority: _Optional[int] = ..., num_sms: _Optional[int] = ..., ll_num_sms: _Optional[int] = ..., queued_calls: _Optional[int] = ..., queue_wait_seconds: _Optional[float] = ..., held_bytes: _Optional[int] = ..., hierarchical: _Optional[bool] = ..., two_stage: _Optional[bool] = ..., armed_calls: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("engine_index", "sessions", "groups", "regions", "region_bytes")
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    sessions: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupStats]
    regions: int
    region_bytes: int
    def __init__(self, engine_index: _Optional[int] = ..., sessions: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupStats, _Mapping]]] = ..., regions: _Optional[int] = ..., region_bytes: _Optional[int] = ...) -> None: ...

class FetchFd(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RegisterMemfd(_message.Message):
    __slots__ = ("size_bytes",)
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    def __init__(self, size_bytes: _Optional[int] = ...) -> None: ...

class FdHello(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FdRequest(_message.Message):
    __slots__ = ("session_id", "session_token", "fetch", "register_memfd", "hello")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    REGISTER_MEMFD_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_token: bytes
    fetch: FetchFd
    register_memfd: RegisterMemfd
    hello: FdHello
    def __init__(self, session_id: _Optional[str] = ..., session_token: _Optional[bytes] = ..., fetch: _Optional[_Union[FetchFd, _Mapping]] = ..., register_memfd: _Optional[_Union[RegisterMemfd, _Mapping]] = ..., hello: _Optional[_Union[FdHello, _Mapping]] = ...) -> None: ...

class FdResponse(_message.Message):
    __slots__ = ("code", "message", "region_id", "size_bytes", "ticket")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    region_id: str
    size_bytes: int
    ticket: bytes
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., region_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class ClusterHeartbeat(_message.Message):
    __slots__ = ("node_rank", "incarnation", "node_name", "engines", "world_generation", "agreed_settings", "world_left")
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    WORLD_GENERATION_FIELD_NUMBER: _ClassVar[int]
    AGREED_SETTINGS_FIELD_NUMBER: _ClassVar[int]
    WORLD_LEFT_FIELD_NUMBER: _ClassVar[int]
    node_rank: int
    incarnation: str
    node_name: str
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    world_generation: int
    agreed_settings: str
    world_left: int
    def __init__(self, node_rank: _Optional[int] = ..., incarnation: _Optional[str] = ..., node_name: _Optional[str] = ..., engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ..., world_generation: _Optional[int] = ..., agreed_settings: _Optional[str] = ..., world_left: _Optional[int] = ...) -> None: ...

class ClusterWorld(_message.Message):
    __slots__ = ("nvshmem_uid", "generation", "node_first_pe", "num_pes")
    NVSHMEM_UID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_FIRST_PE_FIELD_NUMBER: _ClassVar[int]
    NUM_PES_FIELD_NUMBER: _ClassVar[int]
    nvshmem_uid: bytes
    generation: int
    node_first_pe: _containers.RepeatedScalarFieldContainer[int]
    num_pes: int
    def __init__(self, nvshmem_uid: _Optional[bytes] = ..., generation: _Optional[int] = ..., node_first_pe: _Optional[_Iterable[int]] = ..., num_pes: _Optional[int] = ...) -> None: ...

class ClusterNodeInfo(_message.Message):
    __slots__ = ("node_rank", "node_name", "healthy", "engines", "last_seen_seconds", "incarnation")
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_rank: int
    node_name: str
    healthy: bool
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    last_seen_seconds: float
    incarnation: str
    def __init__(self, node_rank: _Optional[int] = ..., node_name: _Optional[str] = ..., healthy: _Optional[bool] = ..., engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ..., last_seen_seconds: _Optional[float] = ..., incarnation: _Optional[str] = ...) -> None: ...

class ClusterInfo(_message.Message):
    __slots__ = ("node_rank", "num_nodes", "cluster_address", "nodes", "coordinator_reachable", "world_generation", "world_num_pes", "tls")
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_REACHABLE_FIELD_NUMBER: _ClassVar[int]
    WORLD_GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_NUM_PES_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    node_rank: int
    num_nodes: int
    cluster_address: str
    nodes: _containers.RepeatedCompositeFieldContainer[ClusterNodeInfo]
    coordinator_reachable: bool
    world_generation: int
    world_num_pes: int
    tls: bool
    def __init__(self, node_rank: _Optional[int] = ..., num_nodes: _Optional[int] = ..., cluster_address: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[ClusterNodeInfo, _Mapping]]] = ..., coordinator_reachable: _Optional[bool] = ..., world_generation: _Optional[int] = ..., world_num_pes: _Optional[int] = ..., tls: _Optional[bool] = ...) -> None: ...

class ClusterLeaseEvent(_message.Message):
    __slots__ = ("heartbeat_seconds", "cluster", "world")
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    heartbeat_seconds: float
    cluster: ClusterInfo
    world: ClusterWorld
    def __init__(self, heartbeat_seconds: _Optional[float] = ..., cluster: _Optional[_Union[ClusterInfo, _Mapping]] = ..., world: _Optional[_Union[ClusterWorld, _Mapping]] = ...) -> None: ...

class ClusterRendezvousRequest(_message.Message):
    __slots__ = ("node_rank", "incarnation", "request")
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    node_rank: int
    incarnation: str
    request: RendezvousRequest
    def __init__(self, node_rank: _Optional[int] = ..., incarnation: _Optional[str] = ..., request: _Optional[_Union[RendezvousRequest, _Mapping]] = ...) -> None: ...

class ClusterReleaseRequest(_message.Message):
    __slots__ = ("node_rank", "incarnation", "request")
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    node_rank: int
    incarnation: str
    request: ReleaseRankRequest
    def __init__(self, node_rank: _Optional[int] = ..., incarnation: _Optional[str] = ..., request: _Optional[_Union[ReleaseRankRequest, _Mapping]] = ...) -> None: ...
