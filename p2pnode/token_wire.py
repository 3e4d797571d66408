"""A prompt's token ids to and from protobuf's wire form, in one C pass each way (``native/token_wire.c``).

Why: upb's Python containers convert a ``repeated uint32`` field one Python call per item. For a 4,096-token prompt
that is ~80 us to fill a ForwardRequest's ``prompt_token_ids`` from a list, ~110 us to read a GenerateRequest's
``token_ids`` back into one, and ~45 us for the vocabulary check's ``max`` -- on every request, at its ingress and
again at the peer that serves it: more than the rest of a forwarding hop. ``pack_field`` writes the field's wire
form (appended to a message serialized without the field, it gives the message with it: protobuf takes a field
wherever it comes; merged into a message, protobuf's parser fills the field in C); ``unpack_field`` reads the
field's values and their maximum from a message's bytes, and on request the values in the block hash's byte form
(``read_tokens_packed``: written in the same pass, at no cost measured; the router then hashes the prompt without
reading a Python int).

The C pass shares one Python int per token id below 2**18 across every prompt it reads (ints are immutable): a
prompt's list costs a reference per token, not an allocation. Bound: at most 262,144 ints (~9 MB with the table's
pointers), filled as ids are seen, kept for the process's life.

Without the C extension (a build without a compiler) both go through protobuf's own containers: same results,
slower.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from google.protobuf.message import Message

__all__ = ["NATIVE", "fill_tokens", "read_tokens", "read_tokens_packed", "serialize_with_tokens"]

try:
    from p2pnode._token_wire import pack as pack_field
    from p2pnode._token_wire import unpack as unpack_field

    NATIVE = True
except ImportError:  # pragma: no cover - the extension is optional
    pack_field = unpack_field = None  # type: ignore[assignment]
    NATIVE = False


def _number(message: Message, field: str) -> int:
    return message.DESCRIPTOR.fields_by_name[field].number


def serialize_with_tokens(message: Message, field: str, tokens: Sequence[int]) -> bytes:
    """``message``, whose ``repeated uint32`` ``field`` is empty, serialized with ``tokens`` in that field (the
    bytes protobuf would write, but for the field's place). A token outside [0, 2**32) raises ValueError, a
    non-integer TypeError."""
    if pack_field is None:
        copy = type(message)()
        copy.CopyFrom(message)
        getattr(copy, field).extend(tokens)
        return copy.SerializeToString()
    return message.SerializeToString() + pack_field(_number(message, field), tokens)


def fill_tokens(message: Message, field: str, tokens: Sequence[int]) -> None:
    """Append ``tokens`` to ``message``'s ``repeated uint32`` ``field`` (and set the message, as a sub-message of a
    oneof, as the one present): their wire form, written in one C pass, parsed by protobuf in C. Errors as
    ``serialize_with_tokens``'s."""
    if pack_field is None:
        getattr(message, field).extend(tokens)
    else:
        message.MergeFromString(pack_field(_number(message, field), tokens))


def read_tokens(message: Message, field: str, data: bytes | None = None) -> tuple[list[int], int]:
    """``message``'s ``repeated uint32`` ``field`` as a list, and its maximum (-1: empty), as protobuf parses it:
    read in one C pass from ``data``, the bytes ``message`` was parsed from, when the caller holds them (else
    serialized here). Bytes protobuf took but the C pass does not (an unknown group field, the field's number with
    another wire type: protobuf keeps both as unknown fields) are read through protobuf's container."""
    if unpack_field is not None:
        try:
            return unpack_field(message.SerializeToString() if data is None else data, _number(message, field))
        except ValueError:
            pass
    values = getattr(message, field)[:]
    return values, max(values, default=-1)


def read_tokens_packed(message: Message, field: str, data: bytes | None = None) -> tuple[list[int], int, bytes]:
    """``read_tokens``, and the values as ``block_hash.token_buffer`` gives them (4 little-endian bytes each): the
    form ``block_hash.block_hashes_packed`` reads."""
    if unpack_field is not None:
        try:
            return unpack_field(message.SerializeToString() if data is None else data, _number(message, field), True)
        except ValueError:
            pass
    values, top = read_tokens(message, field, data)
    return values, top, struct.pack(f"<{len(values)}I", *values)
