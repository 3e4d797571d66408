"""The gossip messages and their msgpack encoding (the ``payload`` of a signed envelope, see ``auth.py``).

Wire layout (msgpack arrays, no maps; every integer unsigned but a generation's ``gen``, an offset):

    Syn      = [2, 0, base, digest(, [shard_index, shard_count])]   the shard only when the digest is one (digest.py)
    SynAck   = [2, 1, base, digest, delta]
    Ack      = [2, 2, base, delta]
    Hello    = [2, 3]                  a join probe: "which node are you?" (the only unbound envelope, auth.py)
    HelloAck = [2, 4, probe_nonce]     the answer, bound to the prober: the envelope's sender names the node
    digest  = [node_id, gen, heartbeat, max_version, last_gc_version, node_id, gen, ...]   5 items per node, flat
    delta   = [[node_id, gen, heartbeat, from_version, to_version, last_gc_version, reset,
                [key, version_step, value, key, version_step, value, ...](, origin)], ...]

**Generations as offsets** (version 2). A generation is a life's start in Unix milliseconds: 9 bytes as it is, and
it is in every digest entry and every node delta -- half of a digest's bytes, where the other numbers of a young
mesh take a byte each. So a message names one ``base`` (its sender's own generation) and every ``gen`` in it is
the generation minus ``base``, a signed integer: 3 bytes when the two lives started within ~33 s of each other, 5
within ~25 days, 9 beyond; ``gen`` is nil for generation 0 (a digest's "unknown to me: send me everything").
``base`` is below 2**63, so every offset fits a msgpack integer (``delta.message_base``).

**Version 1** (the releases before) carried absolute generations, no ``base``, and each digest entry as an array
of its own: ``[1, 0, digest(, shard)]``, ``[1, 1, digest, delta]``, ``[1, 2, delta]``, ``[1, 3]``, ``[1, 4, nonce]``
with ``digest = [[node_id, generation, heartbeat, max_version, last_gc_version], ...]``. Such a node refuses
version 2, while this one reads both and answers a message in its own version; what it starts is in
``GossipConfig.wire_version``'s (1 or 2). So a mesh of version 1 is upgraded in two rolls: first every node to this
release with ``wire_version`` 1 (it speaks to nodes not yet upgraded as they speak), then ``wire_version`` 2.
A message's ``version`` field says which it is (``base`` is 0 in version 1).

``origin`` (a node id; only on a reset, and only when known) says who first vouched for that life in the mesh
(delta.py): a node delta of 9 elements.

``version_step`` is the entry's version minus the previous one's (the first: minus ``from_version``), so it is
usually one byte; ``value`` is msgpack bin, or nil for a tombstone. The sizes ``delta.py`` budgets with are exactly
these.

Decoding never trusts the peer: anything that is not this layout -- wrong types, negative or > 64-bit integers
(a generation: once its offset is added), versions out of ``(from_version, to_version]`` or not increasing,
oversized strings -- raises
``MalformedMessage``, and so does any msgpack error. Nothing else escapes ``decode``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from p2pnode.gossip.delta import NodeDelta
from p2pnode.gossip.digest import FULL, NodeDigest, Shard
from p2pnode.gossip.keys import MAX_KEY_CHARS

__all__ = ["Ack", "Hello", "HelloAck", "MalformedMessage", "Message", "Syn", "SynAck", "decode", "encode"]

PROTOCOL_VERSION = 2
#: Versions this node reads (and answers in): the current one and the one before (module docstring).
PROTOCOL_VERSIONS = (1, 2)
KIND_SYN, KIND_SYN_ACK, KIND_ACK, KIND_HELLO, KIND_HELLO_ACK = 0, 1, 2, 3, 4
#: Longest probe nonce echoed in a HelloAck (the envelope's nonce: 16 bytes, at most 64 accepted).
MAX_NONCE_BYTES = 64
#: Longest node id accepted (characters); keys: as long as a consumer may publish (``keys.MAX_KEY_CHARS``).
MAX_NODE_ID_CHARS = 256
#: Most shards a Syn may say its digest is one of (a mesh is cut into members / digest_max_members of them).
MAX_SHARDS = 1 << 16
_U64 = 1 << 64
#: A message's base is below this, so that every generation's offset from it is a msgpack integer.
_BASE_LIMIT = 1 << 63


class MalformedMessage(ValueError):
    """The bytes are not a valid gossip message."""


@dataclass(frozen=True, slots=True)
class Syn:
    """Start of an exchange: what the initiator knows of the members of ``shard`` (all of them, in a mesh of up
    to ``digest_max_members``), as a digest."""

    digest: tuple[NodeDigest, ...]
    shard: Shard = FULL
    #: What the generations are sent as offsets from (module docstring): the sender's own generation.
    base: int = 0
    #: The wire version it travels in (module docstring; version 1 has no base: 0).
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class SynAck:
    """The responder's reply: what the initiator is missing, and the digest entries the initiator needs."""

    digest: tuple[NodeDigest, ...]
    delta: tuple[NodeDelta, ...]
    base: int = 0
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class Ack:
    """End of an exchange (or a one-way push): what the responder is missing."""

    delta: tuple[NodeDelta, ...]
    base: int = 0
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class Hello:
    """A join probe to an address whose node id is not known (a seed): it asks only for the node's identity."""

    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class HelloAck:
    """The answer to a Hello: ``probe_nonce`` is the Hello envelope's nonce (so the prober knows it is its own)."""

    probe_nonce: bytes
    version: int = PROTOCOL_VERSION


Message = Syn | SynAck | Ack | Hello | HelloAck


# --- encoding --------------------------------------------------------------------------------------------------


def _digest_obj(digest: tuple[NodeDigest, ...], base: int, version: int) -> list[Any]:
    if version == 1:
        return [[d.node_id, d.generation, d.heartbeat, d.max_version, d.last_gc_version] for d in digest]
    flat: list[Any] = []
    for d in digest:
        gen = d.generation - base if d.generation else None
        flat += (d.node_id, gen, d.heartbeat, d.max_version, d.last_gc_version)
    return flat


def _delta_obj(delta: tuple[NodeDelta, ...], base: int, version: int) -> list[list[Any]]:
    out = []
    for nd in delta:
        flat: list[Any] = []
        prev = nd.from_version
        for key, version, value in nd.entries:
            flat.append(key)
            flat.append(version - prev)
            flat.append(value)
            prev = version
        out.append(
            [
                nd.node_id,
                nd.generation - base if nd.generation or version == 1 else None,
                nd.heartbeat,
                nd.from_version,
                nd.to_version,
                nd.last_gc_version,
                nd.reset,
                flat,
                *((nd.origin,) if nd.origin else ()),
            ]
        )
    return out


def encode(message: Message) -> bytes:
    """The bytes of ``message`` in its wire ``version``."""
    if not isinstance(message, Syn | SynAck | Ack | Hello | HelloAck):
        raise TypeError(f"not a gossip message: {message!r}")
    if message.version not in PROTOCOL_VERSIONS:
        raise ValueError(f"gossip protocol version {message.version} cannot be sent (only {PROTOCOL_VERSIONS})")
    if isinstance(message, Syn | SynAck | Ack):
        version, base = message.version, message.base
        if not 0 <= base < _BASE_LIMIT or (version == 1 and base):
            raise ValueError(f"a message of version {version} with base {base} (delta.message_base) cannot be sent")
        head: list[Any] = [version, KIND_SYN if isinstance(message, Syn) else KIND_SYN_ACK]
        if version > 1:
            head.append(base)
        if isinstance(message, Syn):
            obj: list[Any] = [*head, _digest_obj(message.digest, base, version)]
            if message.shard != FULL:
                obj.append(list(message.shard))
        elif isinstance(message, SynAck):
            obj = [*head, _digest_obj(message.digest, base, version), _delta_obj(message.delta, base, version)]
        else:
            head[1] = KIND_ACK
            obj = [*head, _delta_obj(message.delta, base, version)]
    elif isinstance(message, Hello):
        obj = [message.version, KIND_HELLO]
    else:
        obj = [message.version, KIND_HELLO_ACK, message.probe_nonce]
    return msgpack.packb(obj, use_bin_type=True)


def encoded_digest_size(
    digest: tuple[NodeDigest, ...] | list[NodeDigest], base: int, version: int = PROTOCOL_VERSION
) -> int:
    """Encoded size of a digest sent with ``base`` (for budgeting the delta that shares a SynAck with it)."""
    return len(msgpack.packb(_digest_obj(tuple(digest), base, version), use_bin_type=True))


# --- decoding --------------------------------------------------------------------------------------------------


def _uint(x: Any, what: str) -> int:
    if type(x) is not int or not 0 <= x < _U64:
        raise MalformedMessage(f"{what} must be an unsigned 64-bit integer")
    return x


def _base(x: Any) -> int:
    if type(x) is not int or not 0 <= x < _BASE_LIMIT:
        raise MalformedMessage("base must be an integer in [0, 2**63)")
    return x


def _node_id(x: Any) -> str:
    if type(x) is not str or not 0 < len(x) <= MAX_NODE_ID_CHARS:
        raise MalformedMessage("node id must be a non-empty string of at most 256 characters")
    return x


def _list(x: Any, what: str, length: int | None = None) -> list[Any]:
    if type(x) is not list or (length is not None and len(x) != length):
        raise MalformedMessage(f"{what} must be an array" + (f" of {length}" if length is not None else ""))
    return x


def _generation(offset: Any, base: int) -> int:
    """The generation sent as ``offset`` from ``base`` (nil: 0), checked to be an unsigned 64-bit integer."""
    if offset is None:
        return 0
    if type(offset) is not int or not 0 <= base + offset < _U64:
        raise MalformedMessage("generation must be an integer offset from base to an unsigned 64-bit value, or nil")
    return base + offset


def _decode_digest_v1(obj: Any) -> tuple[NodeDigest, ...]:
    """Version 1's digest: an array per node, absolute generations."""
    out = []
    for item in _list(obj, "digest"):
        if type(item) is not list or len(item) != 5:
            raise MalformedMessage("digest entry must be an array of 5")
        node_id, gen, hb, max_v, gc = item
        if type(node_id) is not str or not 0 < len(node_id) <= MAX_NODE_ID_CHARS:
            raise MalformedMessage("node id must be a non-empty string of at most 256 characters")
        if type(gen) is not int or type(hb) is not int or type(max_v) is not int or type(gc) is not int:
            raise MalformedMessage("digest numbers must be integers")
        if gen < 0 or hb < 0 or max_v < 0 or gc < 0:
            raise MalformedMessage("digest numbers must be unsigned")
        out.append(NodeDigest(node_id, gen, hb, max_v, gc))
    return tuple(out)


def _decode_digest(obj: Any, base: int) -> tuple[NodeDigest, ...]:
    # The hot path of every exchange (one entry per node of the mesh): checks inlined. msgpack integers are already
    # within [-2**63, 2**64), so only the sign needs checking.
    flat = _list(obj, "digest")
    if len(flat) % 5:
        raise MalformedMessage("digest must hold 5 items per node")
    out = []
    for i in range(0, len(flat), 5):
        node_id, offset, hb, max_v, gc = flat[i : i + 5]
        if type(node_id) is not str or not 0 < len(node_id) <= MAX_NODE_ID_CHARS:
            raise MalformedMessage("node id must be a non-empty string of at most 256 characters")
        if type(hb) is not int or type(max_v) is not int or type(gc) is not int:
            raise MalformedMessage("digest numbers must be integers")
        if hb < 0 or max_v < 0 or gc < 0:
            raise MalformedMessage("digest numbers must be unsigned")
        out.append(NodeDigest(node_id, _generation(offset, base), hb, max_v, gc))
    return tuple(out)


def _decode_shard(obj: Any) -> Shard:
    index, count = _list(obj, "shard", 2)
    if type(index) is not int or type(count) is not int or not 0 <= index < count <= MAX_SHARDS:
        raise MalformedMessage(f"shard must be [index, count] with 0 <= index < count <= {MAX_SHARDS}")
    return index, count


def _decode_delta(obj: Any, base: int) -> tuple[NodeDelta, ...]:
    out = []
    for item in _list(obj, "delta"):
        if type(item) is not list or len(item) not in (8, 9):
            raise MalformedMessage("node delta must be an array of 8 or 9")
        node_id, gen, hb, from_v, to_v, gc, reset, flat = item[:8]
        origin = _node_id(item[8]) if len(item) == 9 else ""
        from_v = _uint(from_v, "from_version")
        to_v = _uint(to_v, "to_version")
        if type(reset) is not bool:
            raise MalformedMessage("reset must be a boolean")
        if to_v < from_v or (reset and from_v != 0):
            raise MalformedMessage("bad version range")
        flat = _list(flat, "entries")
        if len(flat) % 3:
            raise MalformedMessage("entries must be (key, version_step, value) triples")
        entries = []
        version = from_v
        for i in range(0, len(flat), 3):
            key, step, value = flat[i], flat[i + 1], flat[i + 2]
            if type(key) is not str or not 0 < len(key) <= MAX_KEY_CHARS:
                raise MalformedMessage("key must be a string of 1 to 256 characters")
            if type(step) is not int or step <= 0:
                raise MalformedMessage("versions must increase")
            version += step
            if value is not None and type(value) is not bytes:
                raise MalformedMessage("value must be bytes or nil")
            entries.append((key, version, value))
        if version > to_v:
            raise MalformedMessage("entry version beyond to_version")
        out.append(
            NodeDelta(
                _node_id(node_id),
                _generation(gen, base),
                _uint(hb, "heartbeat"),
                from_v,
                to_v,
                _uint(gc, "last_gc_version"),
                reset,
                tuple(entries),
                origin,
            )
        )
    return tuple(out)


def decode(data: bytes, max_bytes: int) -> Message:
    """Parse and validate one message of at most ``max_bytes``; MalformedMessage for anything else."""
    if len(data) > max_bytes:
        raise MalformedMessage(f"message of {len(data)} bytes exceeds {max_bytes}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=max_bytes,
            max_map_len=0,
            max_ext_len=0,
        )
        if type(obj) is not list or len(obj) < 2 or type(obj[0]) is not int:
            raise MalformedMessage(f"not a p2pnode gossip message (version {PROTOCOL_VERSION})")
        version = obj[0]
        if version not in PROTOCOL_VERSIONS:  # a node of another release: the operator must hear which
            raise MalformedMessage(f"gossip protocol version {version}, this node reads {PROTOCOL_VERSIONS}")
        kind = obj[1] if type(obj[1]) is int else None
        if version == 1:
            return _decode_v1(obj, kind)
        if kind == KIND_SYN and len(obj) in (4, 5):
            base = _base(obj[2])
            return Syn(_decode_digest(obj[3], base), _decode_shard(obj[4]) if len(obj) == 5 else FULL, base)
        if kind == KIND_SYN_ACK and len(obj) == 5:
            base = _base(obj[2])
            return SynAck(_decode_digest(obj[3], base), _decode_delta(obj[4], base), base)
        if kind == KIND_ACK and len(obj) == 4:
            base = _base(obj[2])
            return Ack(_decode_delta(obj[3], base), base)
        return _decode_hello(obj, kind, version)
    except MalformedMessage:
        raise
    except Exception as exc:  # msgpack's many error types, unpacking a wrong arity, recursion limits...
        raise MalformedMessage(f"undecodable message: {type(exc).__name__}") from None


def _decode_hello(obj: list[Any], kind: int | None, version: int) -> Message:
    if kind == KIND_HELLO and len(obj) == 2:
        return Hello(version)
    if kind == KIND_HELLO_ACK and len(obj) == 3 and type(obj[2]) is bytes and 0 < len(obj[2]) <= MAX_NONCE_BYTES:
        return HelloAck(obj[2], version)
    raise MalformedMessage(f"unknown message kind {kind!r}")


def _decode_v1(obj: list[Any], kind: int | None) -> Message:
    """A message of version 1 (module docstring): no base, absolute generations, a digest entry an array."""
    if kind == KIND_SYN and len(obj) in (3, 4):
        return Syn(_decode_digest_v1(obj[2]), _decode_shard(obj[3]) if len(obj) == 4 else FULL, 0, 1)
    if kind == KIND_SYN_ACK and len(obj) == 4:
        return SynAck(_decode_digest_v1(obj[2]), _decode_delta(obj[3], 0), 0, 1)
    if kind == KIND_ACK and len(obj) == 3:
        return Ack(_decode_delta(obj[2], 0), 0, 1)
    return _decode_hello(obj, kind, 1)
