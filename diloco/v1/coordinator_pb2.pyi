from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_DATA: _ClassVar[Role]
    ROLE_COMPUTE: _ClassVar[Role]
    ROLE_OBSERVER: _ClassVar[Role]
    ROLE_EVALUATOR: _ClassVar[Role]

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_FINISHING: _ClassVar[RunState]
    RUN_STATE_FINISHED: _ClassVar[RunState]
ROLE_UNSPECIFIED: Role
ROLE_DATA: Role
ROLE_COMPUTE: Role
ROLE_OBSERVER: Role
ROLE_EVALUATOR: Role
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_FINISHING: RunState
RUN_STATE_FINISHED: RunState

class JoinRequest(_message.Message):
    __slots__ = ("role", "host", "worker_id", "ranks")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    role: Role
    host: str
    worker_id: str
    ranks: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., host: _Optional[str] = ..., worker_id: _Optional[str] = ..., ranks: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("worker_id", "config_json", "coordinator_epoch", "needs_init", "num_fragments", "run_state", "heartbeat_s", "tokenizer_hash", "run_id", "fragment_versions")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEEDS_INIT_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    RUN_STATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    config_json: str
    coordinator_epoch: int
    needs_init: bool
    num_fragments: int
    run_state: RunState
    heartbeat_s: float
    tokenizer_hash: str
    run_id: str
    fragment_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., config_json: _Optional[str] = ..., coordinator_epoch: _Optional[int] = ..., needs_init: _Optional[bool] = ..., num_fragments: _Optional[int] = ..., run_state: _Optional[_Union[RunState, str]] = ..., heartbeat_s: _Optional[float] = ..., tokenizer_hash: _Optional[str] = ..., run_id: _Optional[str] = ..., fragment_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "chunk_leases", "shard_leases", "inner_steps", "tokens_trained", "last_loss", "busy_seconds", "wall_seconds", "data_stall_seconds", "sync_wait_seconds", "kept_busy_seconds", "train_metrics", "device", "ranks", "mfu", "tokens_unmerged", "pull_seconds", "pulled_fragments", "cpu_seconds", "budget_wait_seconds", "resumed_kept_busy_seconds")
    class TrainMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_LEASES_FIELD_NUMBER: _ClassVar[int]
    SHARD_LEASES_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DATA_STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SYNC_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KEPT_BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_METRICS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    MFU_FIELD_NUMBER: _ClassVar[int]
    TOKENS_UNMERGED_FIELD_NUMBER: _ClassVar[int]
    PULL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PULLED_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_KEPT_BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    chunk_leases: _containers.RepeatedScalarFieldContainer[int]
    shard_leases: _containers.RepeatedScalarFieldContainer[int]
    inner_steps: int
    tokens_trained: int
    last_loss: float
    busy_seconds: float
    wall_seconds: float
    data_stall_seconds: float
    sync_wait_seconds: float
    kept_busy_seconds: float
    train_metrics: _containers.ScalarMap[str, float]
    device: str
    ranks: int
    mfu: float
    tokens_unmerged: int
    pull_seconds: float
    pulled_fragments: int
    cpu_seconds: float
    budget_wait_seconds: float
    resumed_kept_busy_seconds: float
    def __init__(self, worker_id: _Optional[str] = ..., chunk_leases: _Optional[_Iterable[int]] = ..., shard_leases: _Optional[_Iterable[int]] = ..., inner_steps: _Optional[int] = ..., tokens_trained: _Optional[int] = ..., last_loss: _Optional[float] = ..., busy_seconds: _Optional[float] = ..., wall_seconds: _Optional[float] = ..., data_stall_seconds: _Optional[float] = ..., sync_wait_seconds: _Optional[float] = ..., kept_busy_seconds: _Optional[float] = ..., train_metrics: _Optional[_Mapping[str, float]] = ..., device: _Optional[str] = ..., ranks: _Optional[int] = ..., mfu: _Optional[float] = ..., tokens_unmerged: _Optional[int] = ..., pull_seconds: _Optional[float] = ..., pulled_fragments: _Optional[int] = ..., cpu_seconds: _Optional[float] = ..., budget_wait_seconds: _Optional[float] = ..., resumed_kept_busy_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("run_state", "coordinator_epoch", "lost_chunk_leases", "lost_shard_leases", "tokens_allowed")
    RUN_STATE_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOST_CHUNK_LEASES_FIELD_NUMBER: _ClassVar[int]
    LOST_SHARD_LEASES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_ALLOWED_FIELD_NUMBER: _ClassVar[int]
    run_state: RunState
    coordinator_epoch: int
    lost_chunk_leases: _containers.RepeatedScalarFieldContainer[int]
    lost_shard_leases: _containers.RepeatedScalarFieldContainer[int]
    tokens_allowed: int
    def __init__(self, run_state: _Optional[_Union[RunState, str]] = ..., coordinator_epoch: _Optional[int] = ..., lost_chunk_leases: _Optional[_Iterable[int]] = ..., lost_shard_leases: _Optional[_Iterable[int]] = ..., tokens_allowed: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaseChunkRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("uri", "start", "end", "file_end", "unit", "nbytes")
    URI_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    FILE_END_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    uri: str
    start: int
    end: int
    file_end: bool
    unit: str
    nbytes: int
    def __init__(self, uri: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., file_end: _Optional[bool] = ..., unit: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class LeaseChunkReply(_message.Message):
    __slots__ = ("chunk_id", "segments", "split", "shard_uri", "lease_ttl_s", "retry_after_s", "done", "run_state")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    SHARD_URI_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    RUN_STATE_FIELD_NUMBER: _ClassVar[int]
    chunk_id: int
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    split: str
    shard_uri: str
    lease_ttl_s: float
    retry_after_s: float
    done: bool
    run_state: RunState
    def __init__(self, chunk_id: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., split: _Optional[str] = ..., shard_uri: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ..., retry_after_s: _Optional[float] = ..., done: _Optional[bool] = ..., run_state: _Optional[_Union[RunState, str]] = ...) -> None: ...

class CompleteChunkRequest(_message.Message):
    __slots__ = ("worker_id", "chunk_id", "completion_id", "shard_uri", "rows", "tokens", "checksum", "bytes_in", "shard_bytes", "dropped_tokens", "record_stats", "seconds", "schema")
    class RecordStatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_URI_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    SHARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECORD_STATS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    chunk_id: int
    completion_id: str
    shard_uri: str
    rows: int
    tokens: int
    checksum: str
    bytes_in: int
    shard_bytes: int
    dropped_tokens: int
    record_stats: _containers.ScalarMap[str, int]
    seconds: float
    schema: str
    def __init__(self, worker_id: _Optional[str] = ..., chunk_id: _Optional[int] = ..., completion_id: _Optional[str] = ..., shard_uri: _Optional[str] = ..., rows: _Optional[int] = ..., tokens: _Optional[int] = ..., checksum: _Optional[str] = ..., bytes_in: _Optional[int] = ..., shard_bytes: _Optional[int] = ..., dropped_tokens: _Optional[int] = ..., record_stats: _Optional[_Mapping[str, int]] = ..., seconds: _Optional[float] = ..., schema: _Optional[str] = ...) -> None: ...

class CompleteChunkReply(_message.Message):
    __slots__ = ("accepted", "reason", "shard_id", "wrong_schema")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    WRONG_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    shard_id: int
    wrong_schema: bool
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., shard_id: _Optional[int] = ..., wrong_schema: _Optional[bool] = ...) -> None: ...

class FailChunkRequest(_message.Message):
    __slots__ = ("worker_id", "chunk_id", "error")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    chunk_id: int
    error: str
    def __init__(self, worker_id: _Optional[str] = ..., chunk_id: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class FailChunkReply(_message.Message):
    __slots__ = ("quarantined",)
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    quarantined: bool
    def __init__(self, quarantined: _Optional[bool] = ...) -> None: ...

class LeaseShardRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class LeaseShardReply(_message.Message):
    __slots__ = ("shard_id", "uri", "checksum", "rows", "todo", "lease_ttl_s", "retry_after_s", "done", "run_state", "deal_slot", "dealt_shard_coming")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TODO_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    RUN_STATE_FIELD_NUMBER: _ClassVar[int]
    DEAL_SLOT_FIELD_NUMBER: _ClassVar[int]
    DEALT_SHARD_COMING_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    uri: str
    checksum: str
    rows: int
    todo: _containers.RepeatedCompositeFieldContainer[ShardSpan]
    lease_ttl_s: float
    retry_after_s: float
    done: bool
    run_state: RunState
    deal_slot: int
    dealt_shard_coming: bool
    def __init__(self, shard_id: _Optional[int] = ..., uri: _Optional[str] = ..., checksum: _Optional[str] = ..., rows: _Optional[int] = ..., todo: _Optional[_Iterable[_Union[ShardSpan, _Mapping]]] = ..., lease_ttl_s: _Optional[float] = ..., retry_after_s: _Optional[float] = ..., done: _Optional[bool] = ..., run_state: _Optional[_Union[RunState, str]] = ..., deal_slot: _Optional[int] = ..., dealt_shard_coming: _Optional[bool] = ...) -> None: ...

class ReportShardRequest(_message.Message):
    __slots__ = ("worker_id", "shard_id", "error")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    shard_id: int
    error: str
    def __init__(self, worker_id: _Optional[str] = ..., shard_id: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class ReportShardReply(_message.Message):
    __slots__ = ("reprocessing",)
    REPROCESSING_FIELD_NUMBER: _ClassVar[int]
    reprocessing: bool
    def __init__(self, reprocessing: _Optional[bool] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "averaged")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    AVERAGED_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    averaged: bool
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., averaged: _Optional[bool] = ...) -> None: ...

class TensorPiece(_message.Message):
    __slots__ = ("tensor", "offset", "data")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor: int
    offset: int
    data: bytes
    def __init__(self, tensor: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ShardSpan(_message.Message):
    __slots__ = ("shard_id", "row_start", "row_end")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    row_start: int
    row_end: int
    def __init__(self, shard_id: _Optional[int] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("worker_id", "fragment", "version", "tensors", "push_id", "inner_steps", "tokens", "spans", "mean_loss", "first_loss", "step_time_s", "codec", "released_shards", "delta", "release_only")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOSS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    RELEASE_ONLY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    fragment: int
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    push_id: str
    inner_steps: int
    tokens: int
    spans: _containers.RepeatedCompositeFieldContainer[ShardSpan]
    mean_loss: float
    first_loss: float
    step_time_s: float
    codec: str
    released_shards: _containers.RepeatedScalarFieldContainer[int]
    delta: bool
    release_only: bool
    def __init__(self, worker_id: _Optional[str] = ..., fragment: _Optional[int] = ..., version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., push_id: _Optional[str] = ..., inner_steps: _Optional[int] = ..., tokens: _Optional[int] = ..., spans: _Optional[_Iterable[_Union[ShardSpan, _Mapping]]] = ..., mean_loss: _Optional[float] = ..., first_loss: _Optional[float] = ..., step_time_s: _Optional[float] = ..., codec: _Optional[str] = ..., released_shards: _Optional[_Iterable[int]] = ..., delta: _Optional[bool] = ..., release_only: _Optional[bool] = ...) -> None: ...

class TensorStreamMessage(_message.Message):
    __slots__ = ("header", "piece")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    piece: TensorPiece
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., piece: _Optional[_Union[TensorPiece, _Mapping]] = ...) -> None: ...

class InitParametersReply(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker_id", "fragments", "have_versions", "wait_s", "wait_above")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_ABOVE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    fragments: _containers.RepeatedScalarFieldContainer[int]
    have_versions: _containers.RepeatedScalarFieldContainer[int]
    wait_s: float
    wait_above: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., fragments: _Optional[_Iterable[int]] = ..., have_versions: _Optional[_Iterable[int]] = ..., wait_s: _Optional[float] = ..., wait_above: _Optional[_Iterable[int]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("accepted", "reason", "version", "missed_round_by_s", "run_state")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MISSED_ROUND_BY_S_FIELD_NUMBER: _ClassVar[int]
    RUN_STATE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    version: int
    missed_round_by_s: float
    run_state: RunState
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., version: _Optional[int] = ..., missed_round_by_s: _Optional[float] = ..., run_state: _Optional[_Union[RunState, str]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "host", "last_seen_s", "inner_steps", "tokens_trained", "last_loss", "alive", "busy_seconds", "wall_seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    host: str
    last_seen_s: float
    inner_steps: int
    tokens_trained: int
    last_loss: float
    alive: bool
    busy_seconds: float
    wall_seconds: float
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., host: _Optional[str] = ..., last_seen_s: _Optional[float] = ..., inner_steps: _Optional[int] = ..., tokens_trained: _Optional[int] = ..., last_loss: _Optional[float] = ..., alive: _Optional[bool] = ..., busy_seconds: _Optional[float] = ..., wall_seconds: _Optional[float] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("run_state", "coordinator_epoch", "chunks_total", "chunks_done", "chunks_quarantined", "shards_total", "shards_consumed", "tokens_prepared", "tokens_merged", "rounds", "fragment_versions", "last_loss", "first_loss", "workers", "wire_bytes_in", "wire_bytes_out", "pushes_accepted", "pushes_refused", "tokens_trained", "detail_json")
    RUN_STATE_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DONE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    SHARDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SHARDS_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PREPARED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_MERGED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOSS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    PUSHES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_JSON_FIELD_NUMBER: _ClassVar[int]
    run_state: RunState
    coordinator_epoch: int
    chunks_total: int
    chunks_done: int
    chunks_quarantined: int
    shards_total: int
    shards_consumed: int
    tokens_prepared: int
    tokens_merged: int
    rounds: int
    fragment_versions: _containers.RepeatedScalarFieldContainer[int]
    last_loss: float
    first_loss: float
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    wire_bytes_in: int
    wire_bytes_out: int
    pushes_accepted: int
    pushes_refused: int
    tokens_trained: int
    detail_json: str
    def __init__(self, run_state: _Optional[_Union[RunState, str]] = ..., coordinator_epoch: _Optional[int] = ..., chunks_total: _Optional[int] = ..., chunks_done: _Optional[int] = ..., chunks_quarantined: _Optional[int] = ..., shards_total: _Optional[int] = ..., shards_consumed: _Optional[int] = ..., tokens_prepared: _Optional[int] = ..., tokens_merged: _Optional[int] = ..., rounds: _Optional[int] = ..., fragment_versions: _Optional[_Iterable[int]] = ..., last_loss: _Optional[float] = ..., first_loss: _Optional[float] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., wire_bytes_in: _Optional[int] = ..., wire_bytes_out: _Optional[int] = ..., pushes_accepted: _Optional[int] = ..., pushes_refused: _Optional[int] = ..., tokens_trained: _Optional[int] = ..., detail_json: _Optional[str] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class FinishReply(_message.Message):
    __slots__ = ("run_state",)
    RUN_STATE_FIELD_NUMBER: _ClassVar[int]
    run_state: RunState
    def __init__(self, run_state: _Optional[_Union[RunState, str]] = ...) -> None: ...

class ReportEvalRequest(_message.Message):
    __slots__ = ("worker_id", "fragment_versions", "tokens_merged", "loss", "metrics", "rows", "seconds")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_MERGED_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    fragment_versions: _containers.RepeatedScalarFieldContainer[int]
    tokens_merged: int
    loss: float
    metrics: _containers.ScalarMap[str, float]
    rows: int
    seconds: float
    def __init__(self, worker_id: _Optional[str] = ..., fragment_versions: _Optional[_Iterable[int]] = ..., tokens_merged: _Optional[int] = ..., loss: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., rows: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ReportEvalReply(_message.Message):
    __slots__ = ("accepted", "reason", "run_state")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RUN_STATE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    run_state: RunState
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., run_state: _Optional[_Union[RunState, str]] = ...) -> None: ...
