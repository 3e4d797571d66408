"""A protobuf message as plain JSON values, the way ``p2pnode generate --json`` writes its results: field names as in
the .proto (snake_case), every field present (defaults included), 64-bit integers as numbers (protobuf's own JSON
mapping writes them as strings, and camelCases the names), enums by name, maps as objects.

A JSON number holds integers exactly up to 2^53; the counters these messages carry stay far below it.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

__all__ = ["to_plain"]


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return to_plain(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        enum_value = field.enum_type.values_by_number.get(value)
        return enum_value.name if enum_value is not None else value
    if field.type == FieldDescriptor.TYPE_BYTES:
        return value.hex()
    return value


def to_plain(message: Message) -> dict[str, Any]:
    """Every field of ``message`` (optional fields only when set) as plain JSON values."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {str(k): _value(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_value(field, v) for v in value]
        elif field.has_presence and not message.HasField(field.name):
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                out[field.name] = to_plain(value)  # a sub-message's defaults, as protobuf's JSON prints them
            continue
        else:
            out[field.name] = _value(field, value)
    return out
