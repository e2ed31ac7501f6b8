from tandem.v1 import common_pb2 as _common_pb2
from tandem.v1 import scheduler_pb2 as _scheduler_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadModelRequest(_message.Message):
    __slots__ = ("model", "pin")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    model: str
    pin: bool
    def __init__(self, model: _Optional[str] = ..., pin: _Optional[bool] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("model", "evicted")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    model: _scheduler_pb2.ModelResidency
    evicted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[_Union[_scheduler_pb2.ModelResidency, _Mapping]] = ..., evicted: _Optional[_Iterable[str]] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("request_id", "min_tokens_per_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    min_tokens_per_message: int
    def __init__(self, request_id: _Optional[str] = ..., min_tokens_per_message: _Optional[int] = ...) -> None: ...

class FollowControl(_message.Message):
    __slots__ = ("attach", "leave")
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    attach: StreamRequest
    leave: str
    def __init__(self, attach: _Optional[_Union[StreamRequest, _Mapping]] = ..., leave: _Optional[str] = ...) -> None: ...

class FollowBatch(_message.Message):
    __slots__ = ("events", "ends")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_scheduler_pb2.TokenEvent]
    ends: _containers.RepeatedCompositeFieldContainer[StreamEnd]
    def __init__(self, events: _Optional[_Iterable[_Union[_scheduler_pb2.TokenEvent, _Mapping]]] = ..., ends: _Optional[_Iterable[_Union[StreamEnd, _Mapping]]] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "seed", "cache_salt", "decode_address", "decode_worker_id", "decode_block_ids", "max_chunk_bytes", "lora", "model", "decode_reused_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DECODE_REUSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    seed: int
    cache_salt: str
    decode_address: str
    decode_worker_id: str
    decode_block_ids: _containers.RepeatedScalarFieldContainer[int]
    max_chunk_bytes: int
    lora: str
    model: str
    decode_reused_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., cache_salt: _Optional[str] = ..., decode_address: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., decode_block_ids: _Optional[_Iterable[int]] = ..., max_chunk_bytes: _Optional[int] = ..., lora: _Optional[str] = ..., model: _Optional[str] = ..., decode_reused_blocks: _Optional[int] = ...) -> None: ...

class KvTransferStats(_message.Message):
    __slots__ = ("bytes", "blocks", "chunks", "duration_ms")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    blocks: int
    chunks: int
    duration_ms: float
    def __init__(self, bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., chunks: _Optional[int] = ..., duration_ms: _Optional[float] = ...) -> None: ...

class PrefillTimings(_message.Message):
    __slots__ = ("queue_ms", "compute_ms", "time_to_first_token_ms", "transfer_ms", "total_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    compute_ms: float
    time_to_first_token_ms: float
    transfer_ms: float
    total_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., time_to_first_token_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprob", "prompt_tokens", "cached_tokens", "finish_reason", "transfer", "timings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    prompt_tokens: int
    cached_tokens: int
    finish_reason: _common_pb2.FinishReason
    transfer: KvTransferStats
    timings: PrefillTimings
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., transfer: _Optional[_Union[KvTransferStats, _Mapping]] = ..., timings: _Optional[_Union[PrefillTimings, _Mapping]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_tokens", "ttl_ms", "model", "token_ids", "cache_salt", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    ttl_ms: int
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    lora: str
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., lora: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("block_ids", "free_blocks", "block_size", "reused_blocks")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    REUSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    free_blocks: int
    block_size: int
    reused_blocks: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., reused_blocks: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released_blocks",)
    RELEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    released_blocks: int
    def __init__(self, released_blocks: _Optional[int] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "seed", "cache_salt", "lora", "model", "call_id", "timeout_ms", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    seed: int
    cache_salt: str
    lora: str
    model: str
    call_id: int
    timeout_ms: int
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., cache_salt: _Optional[str] = ..., lora: _Optional[str] = ..., model: _Optional[str] = ..., call_id: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RunResult(_message.Message):
    __slots__ = ("call_id", "request_id", "queue_position", "status", "retry_after_s")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    request_id: str
    queue_position: int
    status: _common_pb2.RequestError
    retry_after_s: float
    def __init__(self, call_id: _Optional[int] = ..., request_id: _Optional[str] = ..., queue_position: _Optional[int] = ..., status: _Optional[_Union[_common_pb2.RequestError, _Mapping]] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class WorkerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "num_blocks", "free_blocks", "cached_blocks", "referenced_blocks", "reserved_blocks", "running", "waiting", "iterations", "last_batch_size", "max_batch_size", "batch_size_histogram", "preemptions", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "kv_bytes_sent", "kv_bytes_received", "generated_tokens", "uptime_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REFERENCED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.WorkerRole
    num_blocks: int
    free_blocks: int
    cached_blocks: int
    referenced_blocks: int
    reserved_blocks: int
    running: int
    waiting: int
    iterations: int
    last_batch_size: int
    max_batch_size: int
    batch_size_histogram: _containers.RepeatedScalarFieldContainer[int]
    preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    kv_bytes_sent: int
    kv_bytes_received: int
    generated_tokens: int
    uptime_s: float
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., referenced_blocks: _Optional[int] = ..., reserved_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., iterations: _Optional[int] = ..., last_batch_size: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., batch_size_histogram: _Optional[_Iterable[int]] = ..., preemptions: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., uptime_s: _Optional[float] = ...) -> None: ...
