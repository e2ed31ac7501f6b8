from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    MODEL_STATE_LOADING: _ClassVar[ModelState]
    MODEL_STATE_RESIDENT: _ClassVar[ModelState]
MODEL_STATE_UNSPECIFIED: ModelState
MODEL_STATE_LOADING: ModelState
MODEL_STATE_RESIDENT: ModelState

class ProvisionModelRequest(_message.Message):
    __slots__ = ("model", "replicas")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    model: str
    replicas: int
    def __init__(self, model: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class ProvisionModelResponse(_message.Message):
    __slots__ = ("worker_ids",)
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "model", "token_ids", "sampling", "cache_salt", "deadline_unix_ms", "trace_id", "delivered_token_ids", "migration", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    deadline_unix_ms: int
    trace_id: str
    delivered_token_ids: _containers.RepeatedScalarFieldContainer[int]
    migration: int
    lora: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., deadline_unix_ms: _Optional[int] = ..., trace_id: _Optional[str] = ..., delivered_token_ids: _Optional[_Iterable[int]] = ..., migration: _Optional[int] = ..., lora: _Optional[str] = ...) -> None: ...

class SubmitEvent(_message.Message):
    __slots__ = ("placement", "lost")
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    lost: AttemptLost
    def __init__(self, placement: _Optional[_Union[Placement, _Mapping]] = ..., lost: _Optional[_Union[AttemptLost, _Mapping]] = ...) -> None: ...

class SubmitCommands(_message.Message):
    __slots__ = ("commands",)
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    commands: _containers.RepeatedCompositeFieldContainer[SubmitCommand]
    def __init__(self, commands: _Optional[_Iterable[_Union[SubmitCommand, _Mapping]]] = ...) -> None: ...

class SubmitCommand(_message.Message):
    __slots__ = ("call_id", "submit", "cancel")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    submit: Submission
    cancel: bool
    def __init__(self, call_id: _Optional[int] = ..., submit: _Optional[_Union[Submission, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class Submission(_message.Message):
    __slots__ = ("request", "timeout_ms", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request: SubmitRequest
    timeout_ms: int
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request: _Optional[_Union[SubmitRequest, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SubmitUpdates(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[SubmitUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[SubmitUpdate, _Mapping]]] = ...) -> None: ...

class SubmitUpdate(_message.Message):
    __slots__ = ("call_id", "event", "end")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    event: SubmitEvent
    end: SubmitEnd
    def __init__(self, call_id: _Optional[int] = ..., event: _Optional[_Union[SubmitEvent, _Mapping]] = ..., end: _Optional[_Union[SubmitEnd, _Mapping]] = ...) -> None: ...

class SubmitEnd(_message.Message):
    __slots__ = ("status", "retry_after_s")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    status: _common_pb2.RequestError
    retry_after_s: float
    def __init__(self, status: _Optional[_Union[_common_pb2.RequestError, _Mapping]] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("attempt_id", "generator_worker_id", "generator_address", "prefill_worker_id", "prefill_address", "route", "queue_ms", "seed")
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    attempt_id: str
    generator_worker_id: str
    generator_address: str
    prefill_worker_id: str
    prefill_address: str
    route: RouteInfo
    queue_ms: float
    seed: int
    def __init__(self, attempt_id: _Optional[str] = ..., generator_worker_id: _Optional[str] = ..., generator_address: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., prefill_address: _Optional[str] = ..., route: _Optional[_Union[RouteInfo, _Mapping]] = ..., queue_ms: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class AttemptLost(_message.Message):
    __slots__ = ("worker_id", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("request_id", "output_offset", "token_ids", "logprobs", "finish_reason", "usage", "error", "timings", "worker_id", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    output_offset: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    error: _common_pb2.RequestError
    timings: _common_pb2.RequestTimings
    worker_id: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., output_offset: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.RequestError, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.RequestTimings, _Mapping]] = ..., worker_id: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class WorkerScore(_message.Message):
    __slots__ = ("worker_id", "cost", "cached_blocks", "queued_prefill_tokens", "free_blocks", "running")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    cost: float
    cached_blocks: int
    queued_prefill_tokens: int
    free_blocks: int
    running: int
    def __init__(self, worker_id: _Optional[str] = ..., cost: _Optional[float] = ..., cached_blocks: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., free_blocks: _Optional[int] = ..., running: _Optional[int] = ...) -> None: ...

class RouteInfo(_message.Message):
    __slots__ = ("request_id", "prefill_worker_id", "decode_worker_id", "matched_prefix_blocks", "reserved_blocks", "prefill_scores", "decode_scores", "degraded")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SCORES_FIELD_NUMBER: _ClassVar[int]
    DECODE_SCORES_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_worker_id: str
    decode_worker_id: str
    matched_prefix_blocks: int
    reserved_blocks: int
    prefill_scores: _containers.RepeatedCompositeFieldContainer[WorkerScore]
    decode_scores: _containers.RepeatedCompositeFieldContainer[WorkerScore]
    degraded: bool
    def __init__(self, request_id: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., matched_prefix_blocks: _Optional[int] = ..., reserved_blocks: _Optional[int] = ..., prefill_scores: _Optional[_Iterable[_Union[WorkerScore, _Mapping]]] = ..., decode_scores: _Optional[_Iterable[_Union[WorkerScore, _Mapping]]] = ..., degraded: _Optional[bool] = ...) -> None: ...

class SchedulerStatsRequest(_message.Message):
    __slots__ = ("recent_routes",)
    RECENT_ROUTES_FIELD_NUMBER: _ClassVar[int]
    recent_routes: int
    def __init__(self, recent_routes: _Optional[int] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("waiting", "running", "max_queue", "degraded", "store", "workers", "submitted", "completed", "aborted", "failed", "rejected", "recent_routes", "migrated")
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    RECENT_ROUTES_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    running: int
    max_queue: int
    degraded: bool
    store: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    submitted: int
    completed: int
    aborted: int
    failed: int
    rejected: int
    recent_routes: _containers.RepeatedCompositeFieldContainer[RouteInfo]
    migrated: int
    def __init__(self, waiting: _Optional[int] = ..., running: _Optional[int] = ..., max_queue: _Optional[int] = ..., degraded: _Optional[bool] = ..., store: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., submitted: _Optional[int] = ..., completed: _Optional[int] = ..., aborted: _Optional[int] = ..., failed: _Optional[int] = ..., rejected: _Optional[int] = ..., recent_routes: _Optional[_Iterable[_Union[RouteInfo, _Mapping]]] = ..., migrated: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("info", "load", "heartbeat_age_ms")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    load: WorkerLoad
    heartbeat_age_ms: float
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., heartbeat_age_ms: _Optional[float] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "model", "num_blocks", "block_size", "max_model_len", "kv_block_bytes", "device", "load", "catalogue", "model_memory_bytes", "local_prefill")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    CATALOGUE_FIELD_NUMBER: _ClassVar[int]
    MODEL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.WorkerRole
    address: str
    model: str
    num_blocks: int
    block_size: int
    max_model_len: int
    kv_block_bytes: int
    device: str
    load: WorkerLoad
    catalogue: _containers.RepeatedScalarFieldContainer[str]
    model_memory_bytes: int
    local_prefill: bool
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., kv_block_bytes: _Optional[int] = ..., device: _Optional[str] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., catalogue: _Optional[_Iterable[str]] = ..., model_memory_bytes: _Optional[int] = ..., local_prefill: _Optional[bool] = ...) -> None: ...

class ModelResidency(_message.Message):
    __slots__ = ("name", "state", "pinned", "weight_bytes", "active_requests", "idle_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: ModelState
    pinned: bool
    weight_bytes: int
    active_requests: int
    idle_ms: int
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[ModelState, str]] = ..., pinned: _Optional[bool] = ..., weight_bytes: _Optional[int] = ..., active_requests: _Optional[int] = ..., idle_ms: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("free_blocks", "cached_blocks", "running", "waiting", "queued_prefill_tokens", "reserved_blocks", "step_cost", "models", "free_model_memory_bytes")
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STEP_COST_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    FREE_MODEL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    free_blocks: int
    cached_blocks: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    reserved_blocks: int
    step_cost: StepCostModel
    models: _containers.RepeatedCompositeFieldContainer[ModelResidency]
    free_model_memory_bytes: int
    def __init__(self, free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., reserved_blocks: _Optional[int] = ..., step_cost: _Optional[_Union[StepCostModel, _Mapping]] = ..., models: _Optional[_Iterable[_Union[ModelResidency, _Mapping]]] = ..., free_model_memory_bytes: _Optional[int] = ...) -> None: ...

class StepCostModel(_message.Message):
    __slots__ = ("fixed_ms", "per_token_ms", "per_context_token_ms", "per_decode_context_ms")
    FIXED_MS_FIELD_NUMBER: _ClassVar[int]
    PER_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    PER_CONTEXT_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    PER_DECODE_CONTEXT_MS_FIELD_NUMBER: _ClassVar[int]
    fixed_ms: float
    per_token_ms: float
    per_context_token_ms: float
    per_decode_context_ms: float
    def __init__(self, fixed_ms: _Optional[float] = ..., per_token_ms: _Optional[float] = ..., per_context_token_ms: _Optional[float] = ..., per_decode_context_ms: _Optional[float] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class BatchPolicy(_message.Message):
    __slots__ = ("max_num_batched_tokens", "max_num_seqs", "chunk_size", "batch_window_ms", "step_target_ms", "min_prefill_tokens")
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_WINDOW_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_TARGET_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_num_batched_tokens: int
    max_num_seqs: int
    chunk_size: int
    batch_window_ms: int
    step_target_ms: int
    min_prefill_tokens: int
    def __init__(self, max_num_batched_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., chunk_size: _Optional[int] = ..., batch_window_ms: _Optional[int] = ..., step_target_ms: _Optional[int] = ..., min_prefill_tokens: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("heartbeat_ttl_ms", "heartbeat_interval_ms", "policy", "scheduler_id")
    HEARTBEAT_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    heartbeat_ttl_ms: int
    heartbeat_interval_ms: int
    policy: BatchPolicy
    scheduler_id: str
    def __init__(self, heartbeat_ttl_ms: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., policy: _Optional[_Union[BatchPolicy, _Mapping]] = ..., scheduler_id: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "load", "renewed_elsewhere")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    RENEWED_ELSEWHERE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: WorkerLoad
    renewed_elsewhere: bool
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., renewed_elsewhere: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "policy")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    known: bool
    policy: BatchPolicy
    def __init__(self, known: _Optional[bool] = ..., policy: _Optional[_Union[BatchPolicy, _Mapping]] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportBlocksRequest(_message.Message):
    __slots__ = ("worker_id", "stored", "evicted", "reset")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    stored: _containers.RepeatedScalarFieldContainer[str]
    evicted: _containers.RepeatedScalarFieldContainer[str]
    reset: bool
    def __init__(self, worker_id: _Optional[str] = ..., stored: _Optional[_Iterable[str]] = ..., evicted: _Optional[_Iterable[str]] = ..., reset: _Optional[bool] = ...) -> None: ...

class ReportBlocksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("worker_id", "iteration", "events", "batch_size", "stored_blocks", "evicted_blocks", "sequence")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    iteration: int
    events: _containers.RepeatedCompositeFieldContainer[TokenEvent]
    batch_size: int
    stored_blocks: _containers.RepeatedScalarFieldContainer[str]
    evicted_blocks: _containers.RepeatedScalarFieldContainer[str]
    sequence: int
    def __init__(self, worker_id: _Optional[str] = ..., iteration: _Optional[int] = ..., events: _Optional[_Iterable[_Union[TokenEvent, _Mapping]]] = ..., batch_size: _Optional[int] = ..., stored_blocks: _Optional[_Iterable[str]] = ..., evicted_blocks: _Optional[_Iterable[str]] = ..., sequence: _Optional[int] = ...) -> None: ...

class ReportAck(_message.Message):
    __slots__ = ("batches", "applied_through")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    APPLIED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    batches: int
    applied_through: int
    def __init__(self, batches: _Optional[int] = ..., applied_through: _Optional[int] = ...) -> None: ...
