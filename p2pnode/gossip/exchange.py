"""One step of the Scuttlebutt exchange, without I/O: a message in, the state updated, the reply out.

    initiator                       responder
    Syn(digest)             ----->  observe heartbeats; reply digest + delta the initiator is missing
                            <-----  SynAck(reply digest, delta)
    observe; apply delta;
    delta the responder misses ---> Ack(delta)              apply delta
                                    (no Ack when the responder misses nothing)

The agent wraps this with authentication, membership and counters; tests and the simulator drive it directly (any
order, any loss, any duplication: ``delta.apply_delta`` re-checks everything against the current state).
"""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import dataclass, field

from p2pnode.gossip.codec import PROTOCOL_VERSION, Ack, Message, Syn, SynAck, encoded_digest_size
from p2pnode.gossip.delta import ApplyResult, Gate, apply_delta, compute_delta, message_base
from p2pnode.gossip.digest import FULL, Shard, make_digest, observe_digest, reply_digest
from p2pnode.gossip.state import ClusterState

__all__ = ["MESSAGE_OVERHEAD", "StepResult", "make_syn", "step"]

#: Bytes of a message around its digest and delta (the msgpack array, version, kind, base and a shard), budgeted
#: generously.
MESSAGE_OVERHEAD = 24


@dataclass(slots=True)
class StepResult:
    reply: Message | None
    #: Nodes whose heartbeat advanced (from the digest or the delta; nodes the delta created included).
    heartbeats: list[str] = field(default_factory=list)
    applied: ApplyResult | None = None


def make_syn(
    state: ClusterState, shard: Shard = FULL, named: Collection[str] = (), version: int = PROTOCOL_VERSION
) -> Syn:
    """The message that starts an exchange (a shard's digest names the ``named`` nodes too: the receiver, ...), in
    wire ``version`` (codec.py)."""
    base = message_base(state.self_node.generation, version)
    return Syn(tuple(make_digest(state, shard, named)), shard, base, version)


def step(
    state: ClusterState,
    message: Message,
    now: float,
    budget: int,
    rng: random.Random | None = None,
    gate: Gate | None = None,
) -> StepResult:
    """Process one message; the reply (if any) fits ``budget`` bytes of payload when the digest does, in the
    message's wire version (its sender reads it). ``gate`` decides who enters the membership (``delta.Gate``;
    None: anyone, while there is room)."""
    room = budget - MESSAGE_OVERHEAD
    version = message.version
    base = message_base(state.self_node.generation, version)
    if isinstance(message, Syn):
        heartbeats = observe_digest(state, message.digest, now)
        entries = reply_digest(state, message.digest, gate.wants if gate is not None else None)
        digest = {d.node_id: d for d in message.digest}
        room -= encoded_digest_size(entries, base, version)
        delta = compute_delta(state, digest, room, complete=True, rng=rng, shard=message.shard, base=base)
        return StepResult(SynAck(tuple(entries), tuple(delta), base, version), heartbeats)
    if isinstance(message, SynAck):
        heartbeats = observe_digest(state, message.digest, now)
        applied = apply_delta(state, message.delta, now, gate)
        heartbeats.extend(applied.heartbeats)
        digest = {d.node_id: d for d in message.digest}
        delta = compute_delta(state, digest, room, complete=False, rng=rng, base=base)
        return StepResult(Ack(tuple(delta), base, version) if delta else None, heartbeats, applied)
    applied = apply_delta(state, message.delta, now, gate)
    return StepResult(None, list(applied.heartbeats), applied)
