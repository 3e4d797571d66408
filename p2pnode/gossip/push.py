"""Pushes of this node's own newest entries, outside the exchanges: ahead of the round when a consumer has news
(``push_fresh``), and on a graceful stop (``push_newest``, the "left" status).

**Ahead of the round** (``GossipAgent.push_own``, ``push_fanout`` peers). Routing elsewhere should not wait a round
or two for some news (the cache summary's new prefixes). This node sends the entries a live peer lacks at once, as
one one-way Ack, starting from the version the peer's copy is known to have -- as its last digest to us said, or the
Syn we last sent it when its reply did not name us, or our last push to it -- so a push never leaves a gap on a peer
that applied everything it was sent (one that was lost leaves a gap the receiver drops: harmless). A peer reached
another way first skips the entries. Only news that fits ``push_max_bytes`` whole is pushed: a peer further behind,
or a publish of thousands of hashes, is the exchanges' job, which a push would only repeat. The pushed peers spread
the news with their own exchanges.

**Leaving** (``GossipAgent.stop(leave=True)``). The newest entries, the "left" status among them, go as a one-way
Ack to up to ``leave_fanout`` usable peers: those up to date apply it at once, the rest learn it by gossip or by phi.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from p2pnode.gossip.codec import Ack, encode
from p2pnode.gossip.config import GossipConfig
from p2pnode.gossip.delta import compute_delta, message_base, suffix_delta
from p2pnode.gossip.digest import NodeDigest
from p2pnode.gossip.exchange import MESSAGE_OVERHEAD
from p2pnode.gossip.membership import MemberState
from p2pnode.gossip.outbox import Outbox
from p2pnode.gossip.roster import Roster
from p2pnode.gossip.state import ClusterState

__all__ = ["OwnPush"]


class OwnPush:
    """How far each peer's copy of this node is known to go, and the pushes built on it (module docstring)."""

    def __init__(
        self,
        generation: int,
        state: ClusterState,
        config: GossipConfig,
        rng: random.Random,
        roster: Roster,
        outbox: Outbox,
    ) -> None:
        self.self_id = state.self_id
        self.generation = generation
        self.state = state
        self.config = config
        self.rng = rng
        self.roster = roster
        self.outbox = outbox
        #: Per peer, the newest version of this node's state its copy is known to have (bounded: max_members peers),
        #: and this node's version when it last sent the peer a Syn.
        self._known_of_us: OrderedDict[str, int] = OrderedDict()
        self._syn_versions: OrderedDict[str, int] = OrderedDict()

    def new_life(self, generation: int) -> None:
        """This node runs on as a new life (agent.py, reclaiming its id): peers hold none of it yet."""
        self.generation = generation
        self._known_of_us.clear()
        self._syn_versions.clear()

    def note_syn(self, node_id: str) -> None:
        """A Syn goes to ``node_id`` now: a reply that does not name this node means its copy is this new."""
        _remember(self._syn_versions, node_id, self.state.self_node.max_version, self.config.max_members)

    def note_digest(self, sender: str, digest: tuple[NodeDigest, ...], reply: bool) -> None:
        """Remember how far ``sender``'s copy of this node goes (what ``push_fresh`` sends from): as its digest says;
        a reply digest (SynAck) that does not name this node means the copy was as new as the Syn we sent it."""
        version = None
        for entry in digest:
            if entry.node_id == self.self_id:
                version = entry.max_version if entry.generation == self.generation else None
                break
        else:
            if reply:
                version = self._syn_versions.get(sender)
        if version is not None:
            known = max(self._known_of_us.get(sender, 0), version)
            _remember(self._known_of_us, sender, known, self.config.max_members)

    def push_fresh(self) -> None:
        """Send this node's newest entries to up to ``push_fanout`` live peers that lack them, when all of it fits
        ``push_max_bytes`` (see the module docstring)."""
        own = self.state.self_node
        known = self._known_of_us
        candidates = [
            (node_id, address)
            for node_id, address, state in self.roster.peers()
            if state is MemberState.ALIVE and own.last_gc_version <= known.get(node_id, -1) < own.max_version
        ]
        if not candidates:
            return
        room = min(self.config.push_max_bytes, self.config.max_message_bytes) - MESSAGE_OVERHEAD
        version = self.config.wire_version
        base = message_base(own.generation, version)
        for node_id, address in self.rng.sample(candidates, min(self.config.push_fanout, len(candidates))):
            theirs = NodeDigest(self.self_id, self.generation, 0, known[node_id], 0)
            delta = compute_delta(self.state, {self.self_id: theirs}, room, complete=False, base=base)
            # only news that fits a small message goes ahead of the round; a peer further behind (or a burst of
            # thousands of hashes) is the exchanges' job, and a push would only repeat their bytes
            if delta and delta[0].to_version == own.max_version:
                self.outbox.send_to(address, node_id, encode(Ack(tuple(delta), base, version)), "push")
                known[node_id] = delta[0].to_version  # the next push starts there (lost: a gap, dropped, harmless)

    def push_newest(self, fanout: int) -> None:
        """Send this node's newest entries that fit one message to ``fanout`` random usable peers (a leave)."""
        version = self.config.wire_version
        base = message_base(self.state.self_node.generation, version)
        delta = suffix_delta(self.state.self_node, self.config.max_message_bytes - MESSAGE_OVERHEAD, base)
        if delta is None:
            return
        targets = [(address, node_id) for node_id, address, state in self.roster.peers() if state.usable]
        self.rng.shuffle(targets)
        payload = encode(Ack((delta,), base, version))
        for address, node_id in targets[:fanout]:
            self.outbox.send_to(address, node_id, payload, "push")


def _remember(table: OrderedDict[str, int], key: str, value: int, limit: int) -> None:
    """Set ``table[key]`` as its newest entry, dropping the oldest beyond ``limit`` entries."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)
