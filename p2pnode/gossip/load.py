"""A node's load as it publishes it: one key ("load"), refreshed at most once per round and only when it changed.

Value: msgpack ``[running, waiting, kv_usage, in_flight, prefill_backlog_tokens]`` (~14 bytes). ``kv_usage`` is
rounded to 1e-3 before publishing, so that noise in the last digits does not cost a delta every round. A value of
four fields (a node from before the backlog was published) decodes with a backlog of 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from p2pnode.gossip.keys import LOAD_KEY

__all__ = ["LOAD_KEY", "Load", "decode_load", "encode_load"]

#: Resolution kv_usage is published with.
KV_USAGE_RESOLUTION = 1e-3


@dataclass(frozen=True, slots=True)
class Load:
    """Engine and node load: requests running and waiting in the engine, KV-cache usage (0..1), Generate calls in
    flight on the node, and the prompt tokens of its requests still to prefill (their uncached part): the queued work
    a new request's prefill waits behind (routing's cost model, ``routing/policies/p2p.py``)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    in_flight: int = 0
    prefill_backlog_tokens: int = 0

    def rounded(self) -> Load:
        return Load(
            max(0, int(self.running)),
            max(0, int(self.waiting)),
            round(min(1.0, max(0.0, float(self.kv_usage))) / KV_USAGE_RESOLUTION) * KV_USAGE_RESOLUTION,
            max(0, int(self.in_flight)),
            max(0, int(self.prefill_backlog_tokens)),
        )


def encode_load(load: Load) -> bytes:
    r = load.rounded()
    return msgpack.packb([r.running, r.waiting, round(r.kv_usage, 3), r.in_flight, r.prefill_backlog_tokens])


def decode_load(value: bytes) -> Load | None:
    """The load in ``value``, or None when it is not a valid load (a peer's bug must not break routing)."""
    if len(value) > 64:
        return None
    try:
        fields = msgpack.unpackb(value)
        if len(fields) == 4:
            fields = [*fields, 0]
        running, waiting, kv_usage, in_flight, backlog = fields
    except Exception:
        return None
    if not all(type(x) is int and x >= 0 for x in (running, waiting, in_flight, backlog)):
        return None
    if type(kv_usage) not in (int, float) or not 0.0 <= kv_usage <= 1.0:
        return None
    return Load(running, waiting, float(kv_usage), in_flight, backlog)
