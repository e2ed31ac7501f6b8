from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShmSegment(_message.Message):
    __slots__ = ("pid", "fd", "inode", "size")
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    pid: int
    fd: int
    inode: int
    size: int
    def __init__(self, pid: _Optional[int] = ..., fd: _Optional[int] = ..., inode: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class ShmProbe(_message.Message):
    __slots__ = ("segment", "nonce")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    segment: ShmSegment
    nonce: bytes
    def __init__(self, segment: _Optional[_Union[ShmSegment, _Mapping]] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class ShmProbeResult(_message.Message):
    __slots__ = ("visible", "reason")
    VISIBLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    visible: bool
    reason: str
    def __init__(self, visible: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class KvRequestHeader(_message.Message):
    __slots__ = ("prompt_token_ids", "output_token_ids", "sampling", "seed", "cache_salt", "num_chunks", "cached_tokens", "timings", "lora", "model", "shm_segment")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHM_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    seed: int
    cache_salt: str
    num_chunks: int
    cached_tokens: int
    timings: _common_pb2.RequestTimings
    lora: str
    model: str
    shm_segment: ShmSegment
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., cache_salt: _Optional[str] = ..., num_chunks: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.RequestTimings, _Mapping]] = ..., lora: _Optional[str] = ..., model: _Optional[str] = ..., shm_segment: _Optional[_Union[ShmSegment, _Mapping]] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("request_id", "header", "layer", "first_block", "num_blocks", "dtype", "shape", "data", "shm_offset", "num_layers")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    header: KvRequestHeader
    layer: int
    first_block: int
    num_blocks: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shm_offset: int
    num_layers: int
    def __init__(self, request_id: _Optional[str] = ..., header: _Optional[_Union[KvRequestHeader, _Mapping]] = ..., layer: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shm_offset: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("request_id", "chunks", "bytes", "blocks", "duration_ms", "admitted")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunks: int
    bytes: int
    blocks: int
    duration_ms: float
    admitted: bool
    def __init__(self, request_id: _Optional[str] = ..., chunks: _Optional[int] = ..., bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., duration_ms: _Optional[float] = ..., admitted: _Optional[bool] = ...) -> None: ...
