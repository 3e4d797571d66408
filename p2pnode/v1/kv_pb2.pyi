from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class BlockPullRequest(_message.Message):
    __slots__ = ("lease", "kv_layout", "first_block", "count")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    lease: str
    kv_layout: str
    first_block: int
    count: int
    def __init__(self, lease: _Optional[str] = ..., kv_layout: _Optional[str] = ..., first_block: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class BlockData(_message.Message):
    __slots__ = ("block", "layer", "data")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    block: int
    layer: int
    data: bytes
    def __init__(self, block: _Optional[int] = ..., layer: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class SegmentPullRequest(_message.Message):
    __slots__ = ("lease", "kv_layout")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    lease: str
    kv_layout: str
    def __init__(self, lease: _Optional[str] = ..., kv_layout: _Optional[str] = ...) -> None: ...

class SegmentChunk(_message.Message):
    __slots__ = ("segment", "layer", "first_token", "tokens", "keys", "values")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    segment: int
    layer: int
    first_token: int
    tokens: int
    keys: bytes
    values: bytes
    def __init__(self, segment: _Optional[int] = ..., layer: _Optional[int] = ..., first_token: _Optional[int] = ..., tokens: _Optional[int] = ..., keys: _Optional[bytes] = ..., values: _Optional[bytes] = ...) -> None: ...
