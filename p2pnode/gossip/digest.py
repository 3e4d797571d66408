"""Digests: what a node says it knows, one small entry per node, so that a peer can compute what it is missing.

A Syn carries the initiator's full digest. The SynAck carries only the part of the responder's digest the
initiator can use (``reply_digest``): the nodes the initiator is ahead on (so it knows where to start its delta),
the nodes the responder has never heard of (as an all-zero entry), and the nodes whose heartbeat the responder has
newer. Nodes both sides agree on cost nothing in the reply.

Observing a digest (``observe_digest``) moves heartbeats forward (same generation only) and refreshes the age
of a copy that turns out to be up to date: heartbeats spread transitively, so a node's liveness is known by every
node even when its data does not change.

**Shards** (opt-in: ``digest_max_members``, config.py, 0 by default). A mesh larger than it is cut into
``digest_shards`` shards by a hash of the node id, and each Syn carries one shard -- the sender's next in turn --
plus, whatever their shard, the sender, the receiver, the ``digest_stalest_members`` members whose heartbeat the
sender heard longest ago (the reply brings any newer one), the declarers of the death verdicts it holds and the
members new to it lately (``liveness.py``: their news then spreads at the pace of whole digests). It says which
shard it is, so the responder treats the members of that shard the Syn leaves out as unknown to the initiator (a
reset, as for a whole digest) and leaves the other shards alone. A Syn then names ~``digest_max_members`` members
(~25 B each) whatever the mesh size, and a node's Syns name every member once every ``shards / fanout`` rounds:
heartbeats still spread transitively, a little later.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection, Iterable
from functools import lru_cache
from typing import NamedTuple

from p2pnode.gossip.state import ClusterState

__all__ = [
    "FULL",
    "NodeDigest",
    "Shard",
    "digest_shards",
    "in_shard",
    "make_digest",
    "observe_digest",
    "reply_digest",
    "shard_of",
]

#: ``(index, count)``: a digest of the members whose node id hashes to ``index`` modulo ``count``.
Shard = tuple[int, int]
#: The whole membership: one shard.
FULL: Shard = (0, 1)


class NodeDigest(NamedTuple):
    """One node as the sender knows it. ``generation`` 0 means "unknown to me: send me everything".

    A NamedTuple rather than a frozen dataclass: a digest has one per node of the mesh and is built and parsed on
    every exchange, and tuples construct ~3x faster.
    """

    node_id: str
    generation: int
    heartbeat: int
    max_version: int
    last_gc_version: int


def digest_shards(members: int, max_members: int) -> int:
    """Shards a digest of ``members`` is cut into so that none names more than ``max_members`` (0: never cut)."""
    if max_members <= 0 or members <= max_members:
        return 1
    return -(-members // max_members)


@lru_cache(maxsize=4096)  # 4x the default member cap: every Syn of a shard asks once per member it holds
def _slot(node_id: str) -> int:
    return zlib.crc32(node_id.encode())  # the same in every process (unlike hash()), so both sides agree


def shard_of(node_id: str, count: int) -> int:
    """The index of the shard of ``count`` that covers ``node_id``."""
    return _slot(node_id) % count


def in_shard(node_id: str, shard: Shard) -> bool:
    """Whether ``shard`` covers ``node_id``."""
    index, count = shard
    return count == 1 or shard_of(node_id, count) == index


def make_digest(state: ClusterState, shard: Shard = FULL, named: Collection[str] = ()) -> list[NodeDigest]:
    """The digest of ``state`` (every node it holds, itself included, but those it withholds) in ``shard``; a
    shard's digest names this node and the ``named`` nodes too, whichever shard they fall in."""
    withheld = state.withheld
    if shard[1] == 1:
        return [
            NodeDigest(node_id, n.generation, n.heartbeat, n.max_version, n.last_gc_version)
            for node_id, n in state.nodes.items()
            if node_id not in withheld
        ]
    self_id = state.self_id
    return [
        NodeDigest(node_id, n.generation, n.heartbeat, n.max_version, n.last_gc_version)
        for node_id, n in state.nodes.items()
        if node_id not in withheld and (in_shard(node_id, shard) or node_id == self_id or node_id in named)
    ]


def reply_digest(
    state: ClusterState, peer_digest: Iterable[NodeDigest], wants: Callable[[str], bool] | None = None
) -> list[NodeDigest]:
    """The responder's digest entries that matter to the initiator whose full digest is ``peer_digest``.

    ``wants(node_id)``: whether to ask for a node never known here (the agent's gate, ``admission.py``); without
    it, whether the state has room for one more node.
    """
    out: list[NodeDigest] = []
    nodes = state.nodes
    room = None  # whether a new node could be taken (asked once per digest: it may make room)
    withheld = state.withheld
    for theirs in peer_digest:
        mine = nodes.get(theirs.node_id)
        if theirs.node_id in withheld:
            continue  # not spoken for here: its heartbeat in their digest is taken (observe_digest), nothing asked
        if mine is None:
            if theirs.generation and not state.is_forgotten(theirs.node_id, theirs.generation, theirs.heartbeat):
                if wants is not None:
                    asked = wants(theirs.node_id)
                else:
                    if room is None:
                        room = state.has_room()
                    asked = room
                if asked:  # at the member cap (or past a sender's budget), asking for refused nodes only costs bytes
                    out.append(NodeDigest(theirs.node_id, 0, 0, 0, 0))
            continue
        if theirs.generation > mine.generation:
            out.append(NodeDigest(theirs.node_id, 0, 0, 0, 0))  # my copy is of an older life: all of it is stale
        elif theirs.generation == mine.generation and (
            theirs.max_version > mine.max_version or mine.heartbeat > theirs.heartbeat
        ):
            out.append(
                NodeDigest(theirs.node_id, mine.generation, mine.heartbeat, mine.max_version, mine.last_gc_version)
            )
    return out


def observe_digest(state: ClusterState, digest: Iterable[NodeDigest], now: float) -> list[str]:
    """Take heartbeats (and freshness) from a peer's digest; returns the nodes whose heartbeat advanced."""
    advanced: list[str] = []
    nodes = state.nodes
    self_id = state.self_id
    for theirs in digest:
        mine = nodes.get(theirs.node_id)
        if mine is None or theirs.node_id == self_id or theirs.generation != mine.generation:
            continue
        if theirs.heartbeat > mine.heartbeat:
            mine.heartbeat = theirs.heartbeat
            advanced.append(theirs.node_id)
            if theirs.max_version <= mine.max_version:
                mine.fresh_at = now
    return advanced
