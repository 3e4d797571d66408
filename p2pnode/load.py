"""A node's load: the one shape every layer passes around.

The engine reports it (``Engine.status().load``), the serving core adds what only it knows (its calls in flight, the
uncached prompt tokens still to prefill), gossip carries it (the codec below, under ``LOAD_KEY``), the router's peer
snapshots hold it as reported (``routing/policies/types.PeerSnapshot.load``) and the simulator's nodes produce it. A
new load field is added to ``NodeLoad``, to ``WIRE_FIELDS``, and to the policy that reads it; nothing in between
names the fields.

Wire value: a msgpack list of the ``WIRE_FIELDS`` in order (~14 bytes, ~45 with the served work). A new field is
appended at the end, so a value from a node that predates it decodes with that field's default (a value of the first
four fields, from before the backlog was published, decodes with a backlog of 0). ``kv_usage`` is rounded to 1e-3
before publishing, so that noise in the last digits does not cost a delta every round.

Invariants: counts are non-negative integers, ``kv_usage``, ``prefix_cache_hit_rate`` and ``kv_cached`` are in
[0, 1]; ``prefill_backlog_tokens`` None means "not reported" (a policy then assumes the queued requests miss what this
one would, ``types.backlog_tokens``).

The ``served_*`` fields are the work the node's engine has served since the node started (cumulative: requests,
uncached prompt tokens, completion tokens) as of ``served_at`` (the node's wall clock, which moves only when the
counts do, so an idle node's value does not change): what the rate plan scores its expected loads against
(``p2pnode/plan/served.py``). Routing does not read them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

import msgpack

from p2pnode.frozen import fast_init, replace

__all__ = [
    "LOAD_KEY",
    "NODE_LOAD_FIELDS",
    "NO_LOAD",
    "WIRE_FIELDS",
    "NodeLoad",
    "decode_load",
    "encode_load",
    "rounded",
]

#: The gossip key a node publishes its load under (set at most once per round, and only when the value changed).
LOAD_KEY = "load"


@fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLoad:
    """Engine and node load as of one report.

    ``running``/``waiting``: requests in the engine's batch and queue; ``kv_usage``: the engine's KV-cache use (0..1);
    ``prefill_backlog_tokens``: uncached prompt tokens of the node's requests that have not produced a first token --
    the queued work a new request's prefill waits behind (routing's cost, ``routing/policies/p2p.py``);
    ``in_flight``: client-API calls the node is serving (its own admission count, not the engine's).
    """

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefill_backlog_tokens: int | None = None
    in_flight: int = 0
    #: The engine's own prefix-cache hit rate over its recent requests (vLLM's: cached / queried prompt tokens).
    prefix_cache_hit_rate: float = 0.0
    #: Fraction of the KV cache holding cached prefixes (the prefix index's blocks over the engine's capacity): what
    #: the node can reuse, which ``kv_usage`` (blocks held by running requests) does not show when it is idle.
    kv_cached: float = 0.0
    served_requests: int = 0
    served_uncached_tokens: int = 0
    served_completion_tokens: int = 0
    served_at: float = 0.0  # wall clock (s) of the served counts; 0: none reported
    #: What a request of better than the default priority (``priority`` < 0, vLLM's order) waits behind here: the
    #: node's requests of such a priority that have not produced a first token, and their uncached prompt tokens.
    #: vLLM's priority scheduling and the node's queue run them ahead of every default one, so the rest of the
    #: backlog is not in their way (``Router``: an urgent request is routed by this view of each node's queue).
    #: None: not reported (a node from before it): such a request sees the whole backlog.
    urgent_waiting: int = 0
    urgent_backlog_tokens: int | None = None

    @property
    def requests(self) -> int:
        """Requests in the engine: ``running + waiting``."""
        return self.running + self.waiting

    def urgent(self) -> NodeLoad:
        """This load as a request of better than the default priority meets it: only the urgent part of the queue
        ahead of it (itself unchanged when the node does not report that part)."""
        if self.urgent_backlog_tokens is None:
            return self
        return replace(self, waiting=self.urgent_waiting, prefill_backlog_tokens=self.urgent_backlog_tokens)


#: Field names in declaration order.
NODE_LOAD_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(NodeLoad))
#: Nothing running or queued, nothing reported: a default for what has not reported yet.
NO_LOAD = NodeLoad()


#: Resolution kv_usage is published with.
KV_USAGE_RESOLUTION = 1e-3
#: Resolution served_at is published with (seconds).
SERVED_AT_RESOLUTION_S = 1e-3
#: The fields on the wire, in order; append new ones (older values then decode with their defaults).
WIRE_FIELDS = (
    "running", "waiting", "kv_usage", "in_flight", "prefill_backlog_tokens", "prefix_cache_hit_rate", "kv_cached",
    "served_requests", "served_uncached_tokens", "served_completion_tokens", "served_at", "urgent_waiting",
    "urgent_backlog_tokens",
)
#: Fractions in [0, 1], published at KV_USAGE_RESOLUTION.
FRACTION_FIELDS = frozenset({"kv_usage", "prefix_cache_hit_rate", "kv_cached"})
#: The shortest value accepted: what nodes published before the backlog was added.
MIN_WIRE_FIELDS = 4
#: Longest encoded value accepted (a peer's bug must not make every node parse a large value): every field at its
#: widest (msgpack: 9 bytes per 64-bit integer or float) is 118 bytes; ~45 is typical.
MAX_LOAD_BYTES = 128


def _clean(name: str, value: object) -> object:
    if name in FRACTION_FIELDS:
        usage = min(1.0, max(0.0, float(value or 0.0)))  # type: ignore[arg-type]
        return round(round(usage / KV_USAGE_RESOLUTION) * KV_USAGE_RESOLUTION, 3)
    if name == "served_at":
        at = float(value or 0.0)  # type: ignore[arg-type]
        if not (math.isfinite(at) and at > 0):
            return 0.0
        return round(round(at / SERVED_AT_RESOLUTION_S) * SERVED_AT_RESOLUTION_S, 3)
    return max(0, int(value or 0))  # type: ignore[call-overload]


def rounded(load: NodeLoad) -> NodeLoad:
    """``load`` as peers will decode it: counts clamped to >= 0, kv_usage to [0, 1] at ``KV_USAGE_RESOLUTION``, an
    unreported backlog as 0."""
    return NodeLoad(**{name: _clean(name, getattr(load, name)) for name in WIRE_FIELDS})


_SINGLE = msgpack.Packer(use_single_float=True)
_DOUBLE = msgpack.Packer()


def encode_load(load: NodeLoad) -> bytes:
    """A msgpack array of the wire fields: zeros as one-byte integers, fractions as 32-bit floats (they carry 3
    decimals; ``decode_load`` rounds them back), ``served_at`` as a 64-bit float -- ~16-30 B instead of ~45: the
    load changes every round on a serving node, so every peer receives it every round."""
    r = rounded(load)
    parts = [_DOUBLE.pack_array_header(len(WIRE_FIELDS))]
    for name in WIRE_FIELDS:
        value = getattr(r, name)
        if not value:
            parts.append(b"\x00")
        elif name in FRACTION_FIELDS:
            parts.append(_SINGLE.pack(value))
        else:
            parts.append(_DOUBLE.pack(value))
    return b"".join(parts)


def decode_load(value: bytes) -> NodeLoad | None:
    """The load in ``value``, or None when it is not a valid load (a peer's bug must not break routing)."""
    if len(value) > MAX_LOAD_BYTES:
        return None
    try:
        items = msgpack.unpackb(value)
    except Exception:
        return None
    if not isinstance(items, list) or not MIN_WIRE_FIELDS <= len(items) <= len(WIRE_FIELDS):
        return None
    out: dict[str, object] = {}
    for name, x in zip(WIRE_FIELDS, items, strict=False):
        if name in FRACTION_FIELDS:
            if type(x) not in (int, float) or not 0.0 <= x <= 1.0:
                return None
            out[name] = round(float(x), 3)  # sent as a 32-bit float
        elif name == "served_at":
            if type(x) not in (int, float) or not (math.isfinite(x) and x >= 0):
                return None
            out[name] = float(x)
        elif type(x) is not int or x < 0:
            return None
        else:
            out[name] = x
    out.setdefault("prefill_backlog_tokens", 0)
    return NodeLoad(**out)  # type: ignore[arg-type]


class _Publisher(Protocol):
    def before_round(self, publisher: Callable[[], None]) -> None: ...

    def publish(self, key: str, value: bytes) -> None: ...

    def unpublish(self, key: str) -> None: ...

    def rounds_per_update(self, updates_per_s: float) -> int: ...


class LoadPublisher:
    """A node's latest load, published under ``LOAD_KEY`` at the start of a gossip round (a no-op when the encoded
    value did not change): a node samples its load once a second, gossip carries at most one version per round --
    and in a large mesh one every few rounds (``GossipConfig.load_updates_per_s``): every member's load reaches
    every node, so without it a node's load bytes grow with the mesh."""

    def __init__(self, agent: _Publisher, updates_per_s: float) -> None:
        self._load: NodeLoad | None = None
        self._agent = agent
        self._updates_per_s = updates_per_s  # GossipConfig.load_updates_per_s (0: every round)
        self._rounds_left = 0  # rounds until the next publish may go
        agent.before_round(self._publish)

    def set(self, load: NodeLoad) -> None:
        """Record the load to publish with the next round (after ``withhold``: at once)."""
        if self._load is None:
            self._rounds_left = 0
        self._load = load

    def withhold(self) -> None:
        """Take the load out of gossip until the next ``set``: a peer routes only to members whose load it knows
        (``routing/peer_table.py``), so peers stop routing here -- reversibly, unlike a withdrawal (the stalled
        engine's case, ``Node.check_engine``)."""
        self._load = None
        self._agent.unpublish(LOAD_KEY)

    def _publish(self) -> None:
        self._rounds_left -= 1
        if self._load is None or self._rounds_left > 0:
            return
        self._agent.publish(LOAD_KEY, encode_load(self._load))
        self._rounds_left = self._agent.rounds_per_update(self._updates_per_s)
