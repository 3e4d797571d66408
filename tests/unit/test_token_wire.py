"""A prompt's token ids written and read in protobuf's wire form by the C pass (``token_wire.py``) are what
protobuf itself writes and reads: the peer that parses a forwarded request with protobuf gets the same prompt, and
the prompt read from a message's bytes is the one protobuf's container holds -- for every encoding protobuf accepts.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from p2pnode import token_wire
from p2pnode.cache.block_hash import block_hashes, block_hashes_packed, token_buffer
from p2pnode.token_wire import read_tokens, read_tokens_packed, serialize_with_tokens
from p2pnode.v1 import forward_pb2, node_pb2

pytestmark = pytest.mark.skipif(not token_wire.NATIVE, reason="the C extension is not built")

FIELD = forward_pb2.ForwardRequest.PROMPT_TOKEN_IDS_FIELD_NUMBER
#: Token ids at every varint length's edges, and the ends of uint32.
EDGES = [0, 1, 127, 128, 16383, 16384, (1 << 21) - 1, 1 << 21, (1 << 28) - 1, 1 << 28, (1 << 30) - 1, 1 << 30,
         (1 << 32) - 1]  # fmt: skip


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[], [5], EDGES, [rng.randrange(0, 1 << 32) for _ in range(300)],
            [rng.randrange(3, 152_000) for _ in range(4096)]]  # fmt: skip


def full_request(tokens: list[int]) -> forward_pb2.ForwardRequest:
    """A forwarded request with fields on both sides of the prompt's, sub-messages and repeated ones included."""
    return forward_pb2.ForwardRequest(
        request_id="r-1", prompt_token_ids=tokens, sampling=node_pb2.SamplingParams(max_tokens=9, stop=["x", "yz"]),
        origin="ingress-a", hop=1, routing_key="k", pull=forward_pb2.KvPullHint(holder="h", blocks=3),
        segment_spans=[node_pb2.TokenRange(start=1, end=4), node_pb2.TokenRange(start=6, end=8)],
        segment_recompute_tokens=2, adapter="lora", cache_salt="salt", tenant="acme",
    )  # fmt: skip


@pytest.mark.parametrize("tokens", prompts(), ids=["empty", "one", "edges", "uint32", "4k"])
def test_a_prompt_written_in_wire_form_parses_as_protobuf_writes_it(tokens: list[int]) -> None:
    expected = full_request(tokens)
    without = full_request([])
    data = serialize_with_tokens(without, "prompt_token_ids", tokens)
    assert forward_pb2.ForwardRequest.FromString(data) == expected
    assert len(data) == len(expected.SerializeToString())  # the same bytes, but for the field's place
    assert without.prompt_token_ids[:] == []  # the message handed in is left as it was


@pytest.mark.parametrize("tokens", prompts(), ids=["empty", "one", "edges", "uint32", "4k"])
def test_a_prompt_read_from_a_messages_bytes_is_the_one_protobuf_parses(tokens: list[int]) -> None:
    data = full_request(tokens).SerializeToString()
    message = forward_pb2.ForwardRequest.FromString(data)
    assert read_tokens(message, "prompt_token_ids", data) == (tokens, max(tokens, default=-1))
    client = node_pb2.GenerateRequest(token_ids=node_pb2.TokenIds(ids=tokens), routing_key="k")
    assert read_tokens(client.token_ids, "ids") == (tokens, max(tokens, default=-1))  # serialized here


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes([*out, value])


@pytest.mark.parametrize("tokens", prompts(), ids=["empty", "one", "edges", "uint32", "4k"])
def test_a_prompt_read_with_its_bytes_hashes_as_its_list_does(tokens: list[int]) -> None:
    """The bytes the C pass writes beside the list are the block hash's input: the router's hash of a prompt read
    from the wire is the hash of its tokens, with the extension and without."""
    data = full_request(tokens).SerializeToString()
    message = forward_pb2.ForwardRequest.FromString(data)
    read, top, packed = read_tokens_packed(message, "prompt_token_ids", data)
    assert (read, top) == (tokens, max(tokens, default=-1))
    assert len(packed) == 4 * len(tokens)
    for block_size in (1, 3, 16):
        assert block_hashes_packed(packed, block_size) == block_hashes(tokens, block_size)
    client = node_pb2.GenerateRequest(token_ids=node_pb2.TokenIds(ids=tokens))
    assert read_tokens_packed(client.token_ids, "ids") == (tokens, top, packed)


def test_a_prompt_read_with_its_bytes_without_the_extension_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = prompts()[3]
    data = full_request(tokens).SerializeToString()
    native = read_tokens_packed(forward_pb2.ForwardRequest.FromString(data), "prompt_token_ids", data)
    monkeypatch.setattr(token_wire, "unpack_field", None)
    assert read_tokens_packed(forward_pb2.ForwardRequest.FromString(data), "prompt_token_ids", data) == native


def test_every_encoding_protobuf_accepts_reads_alike() -> None:
    """Packed runs split in two, single varints (the unpacked form), both mixed, a varint past 32 bits (cut to its low
    32 as protobuf does), unknown fields of every wire type between them."""
    packed = varint(FIELD << 3 | 2)
    run_a, run_b = varint(300) + varint(5), varint(1 << 31)
    data = (
        varint(1 << 3 | 2) + varint(3) + b"r-1"  # request_id
        + packed + varint(len(run_a)) + run_a
        + varint(99 << 3 | 0) + varint(12345)  # unknown varint
        + varint(FIELD << 3 | 0) + varint(7)  # one unpacked value
        + varint(98 << 3 | 1) + bytes(8) + varint(97 << 3 | 5) + bytes(4)  # unknown fixed64, fixed32
        + packed + varint(len(run_b)) + run_b
        + varint(FIELD << 3 | 0) + varint((1 << 40) + 11)  # past 32 bits
    )  # fmt: skip
    message = forward_pb2.ForwardRequest.FromString(data)
    assert message.prompt_token_ids[:] == [300, 5, 7, 1 << 31, 11]
    assert read_tokens(message, "prompt_token_ids", data) == (message.prompt_token_ids[:], 1 << 31)
    assert token_wire.unpack_field(data, FIELD) == (message.prompt_token_ids[:], 1 << 31)
    assert token_wire.unpack_field(data, FIELD, True)[2] == bytes(token_buffer(message.prompt_token_ids[:]))


def test_bytes_protobuf_takes_but_the_c_pass_does_not_are_read_through_protobuf() -> None:
    """An unknown group field and the prompt's number with a fixed-size wire type: protobuf keeps both as unknown
    fields; the C pass refuses them, and the prompt is read from the container instead."""
    data = bytes([15 << 3 | 3, 15 << 3 | 4]) + bytes([FIELD << 3 | 5, 1, 0, 0, 0]) + bytes([FIELD << 3 | 0, 7])
    message = forward_pb2.ForwardRequest.FromString(data)
    with pytest.raises(ValueError, match="malformed"):
        token_wire.unpack_field(data, FIELD)
    assert read_tokens(message, "prompt_token_ids", data) == ([7], 7)


@pytest.mark.parametrize(
    "data",
    [varint(FIELD << 3 | 2) + varint(10) + b"\x01", varint(FIELD << 3 | 0), b"\x80",
     varint(FIELD << 3 | 2) + b"\x01\x80", varint(5 << 3 | 1) + bytes(3),
     varint(FIELD << 3 | 2) + varint(11) + b"\xff" * 11],
    ids=["length past end", "no value", "cut tag", "packed varint cut", "fixed64 cut", "varint over 10 bytes"],
)  # fmt: skip
def test_malformed_bytes_raise_value_error(data: bytes) -> None:
    with pytest.raises(ValueError, match="malformed protobuf message"):
        token_wire.unpack_field(data, FIELD)


def test_numpys_integers_are_taken_as_protobuf_takes_them() -> None:
    tokens = np.array([5, 300, (1 << 32) - 1], dtype=np.uint64)
    expected = full_request(tokens.tolist())
    assert forward_pb2.ForwardRequest.FromString(
        serialize_with_tokens(full_request([]), "prompt_token_ids", tokens)
    ) == expected
    assert forward_pb2.ForwardRequest.FromString(
        serialize_with_tokens(full_request([]), "prompt_token_ids", [np.int32(5), 300, np.uint32((1 << 32) - 1)])
    ) == expected
    with pytest.raises(TypeError, match="integers"):
        token_wire.pack_field(FIELD, [np.float32(5.0)])


class ShrinksItsList:
    """An integer whose ``__index__`` empties the list being read: refused before it runs (a Python class)."""

    def __init__(self, tokens: list[object]) -> None:
        self.tokens = tokens

    def __index__(self) -> int:
        self.tokens.clear()
        return 5


def test_a_python_class_with_an_index_is_refused_without_running_it() -> None:
    tokens: list[object] = [1, 2, 3]
    tokens.insert(1, ShrinksItsList(tokens))
    with pytest.raises(TypeError, match="integers, got ShrinksItsList"):
        token_wire.pack_field(FIELD, tokens)
    with pytest.raises(TypeError, match="integers, got ShrinksItsList"):
        block_hashes(tokens, 2)
    assert len(tokens) == 4  # never called


def test_bad_tokens_and_field_numbers_raise_the_errors_of_the_python_paths() -> None:
    with pytest.raises(ValueError, match="uint32"):
        token_wire.pack_field(FIELD, [1, 1 << 32])
    with pytest.raises(ValueError, match="uint32"):
        token_wire.pack_field(FIELD, [-1])
    with pytest.raises(TypeError, match="integers"):
        token_wire.pack_field(FIELD, [1, "2"])
    with pytest.raises(ValueError, match="field_number"):
        token_wire.pack_field(0, [1])
    with pytest.raises(ValueError, match="field_number"):
        token_wire.unpack_field(b"", 1 << 29)


def test_without_the_extension_the_same_prompt_goes_through_protobuf(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = prompts()[3]
    native = serialize_with_tokens(full_request([]), "prompt_token_ids", tokens)
    monkeypatch.setattr(token_wire, "pack_field", None)
    monkeypatch.setattr(token_wire, "unpack_field", None)
    plain = serialize_with_tokens(full_request([]), "prompt_token_ids", tokens)
    assert forward_pb2.ForwardRequest.FromString(plain) == forward_pb2.ForwardRequest.FromString(native)
    message = forward_pb2.ForwardRequest.FromString(native)
    assert read_tokens(message, "prompt_token_ids", native) == (tokens, max(tokens))
