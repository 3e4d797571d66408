from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GossipEnvelope(_message.Message):
    __slots__ = ("version", "cluster_id", "sender_id", "sender_address", "sender_generation", "timestamp_ms", "nonce", "payload", "mac", "receiver_id", "receiver_generation")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SENDER_GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_GENERATION_FIELD_NUMBER: _ClassVar[int]
    version: int
    cluster_id: str
    sender_id: str
    sender_address: str
    sender_generation: int
    timestamp_ms: int
    nonce: bytes
    payload: bytes
    mac: bytes
    receiver_id: str
    receiver_generation: int
    def __init__(self, version: _Optional[int] = ..., cluster_id: _Optional[str] = ..., sender_id: _Optional[str] = ..., sender_address: _Optional[str] = ..., sender_generation: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., nonce: _Optional[bytes] = ..., payload: _Optional[bytes] = ..., mac: _Optional[bytes] = ..., receiver_id: _Optional[str] = ..., receiver_generation: _Optional[int] = ...) -> None: ...
