from p2pnode.v1 import node_pb2 as _node_pb2
from p2pnode.v1 import peer_pb2 as _peer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LinkOpen(_message.Message):
    __slots__ = ("id", "envelope", "timeout_s", "credit")
    ID_FIELD_NUMBER: _ClassVar[int]
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    id: int
    envelope: bytes
    timeout_s: float
    credit: int
    def __init__(self, id: _Optional[int] = ..., envelope: _Optional[bytes] = ..., timeout_s: _Optional[float] = ..., credit: _Optional[int] = ...) -> None: ...

class LinkCredit(_message.Message):
    __slots__ = ("id", "messages")
    ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    id: int
    messages: int
    def __init__(self, id: _Optional[int] = ..., messages: _Optional[int] = ...) -> None: ...

class LinkUp(_message.Message):
    __slots__ = ("opens", "cancels", "credits")
    OPENS_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    opens: _containers.RepeatedCompositeFieldContainer[LinkOpen]
    cancels: _containers.RepeatedScalarFieldContainer[int]
    credits: _containers.RepeatedCompositeFieldContainer[LinkCredit]
    def __init__(self, opens: _Optional[_Iterable[_Union[LinkOpen, _Mapping]]] = ..., cancels: _Optional[_Iterable[int]] = ..., credits: _Optional[_Iterable[_Union[LinkCredit, _Mapping]]] = ...) -> None: ...

class LinkEvent(_message.Message):
    __slots__ = ("id", "response", "end", "code", "details", "retry_after_s")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    id: int
    response: bytes
    end: bool
    code: int
    details: str
    retry_after_s: int
    def __init__(self, id: _Optional[int] = ..., response: _Optional[bytes] = ..., end: _Optional[bool] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., retry_after_s: _Optional[int] = ...) -> None: ...

class LinkDown(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[LinkEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[LinkEvent, _Mapping]]] = ...) -> None: ...

class KvPullHint(_message.Message):
    __slots__ = ("holder", "holder_address", "blocks")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    HOLDER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    holder: str
    holder_address: str
    blocks: int
    def __init__(self, holder: _Optional[str] = ..., holder_address: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "origin", "hop", "routing_key", "pull", "segment_reuse", "segment_spans", "segment_recompute_tokens", "adapter", "cache_salt", "tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    HOP_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_REUSE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_SPANS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_RECOMPUTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _node_pb2.SamplingParams
    origin: str
    hop: int
    routing_key: str
    pull: KvPullHint
    segment_reuse: _node_pb2.SegmentReuse
    segment_spans: _containers.RepeatedCompositeFieldContainer[_node_pb2.TokenRange]
    segment_recompute_tokens: int
    adapter: str
    cache_salt: str
    tenant: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_node_pb2.SamplingParams, _Mapping]] = ..., origin: _Optional[str] = ..., hop: _Optional[int] = ..., routing_key: _Optional[str] = ..., pull: _Optional[_Union[KvPullHint, _Mapping]] = ..., segment_reuse: _Optional[_Union[_node_pb2.SegmentReuse, str]] = ..., segment_spans: _Optional[_Iterable[_Union[_node_pb2.TokenRange, _Mapping]]] = ..., segment_recompute_tokens: _Optional[int] = ..., adapter: _Optional[str] = ..., cache_salt: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("origin", "prompt_token_ids", "blocks", "kv_layout", "segments")
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    origin: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    blocks: int
    kv_layout: str
    segments: _containers.RepeatedCompositeFieldContainer[SegmentRef]
    def __init__(self, origin: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., blocks: _Optional[int] = ..., kv_layout: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[SegmentRef, _Mapping]]] = ...) -> None: ...

class SegmentRef(_message.Message):
    __slots__ = ("key", "token_ids")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    key: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LeasedSegment(_message.Message):
    __slots__ = ("key", "start", "tokens")
    KEY_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    key: int
    start: int
    tokens: int
    def __init__(self, key: _Optional[int] = ..., start: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class ExportReply(_message.Message):
    __slots__ = ("lease", "kv_address", "block_ids", "kv_layout", "lease_ttl_s", "segments")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    lease: str
    kv_address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_layout: str
    lease_ttl_s: float
    segments: _containers.RepeatedCompositeFieldContainer[LeasedSegment]
    def __init__(self, lease: _Optional[str] = ..., kv_address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., kv_layout: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ..., segments: _Optional[_Iterable[_Union[LeasedSegment, _Mapping]]] = ...) -> None: ...
