"""GossipAgent: one node's gossip -- the round loop, the three-way exchange, and what the node publishes.

Every ``interval_s`` a round:

1. bump this node's heartbeat; publish its load (if it changed) and its cache-summary changes (pulled from the
   attached PrefixIndex -- never on the engine's event path);
2. re-evaluate every member's phi (alive / suspect / dead), forget members dead or left for longer than the grace,
   collect old tombstones;
3. send a Syn (the full digest) to ``fanout`` random usable peers, plus -- chitchat's rules -- one random dead peer
   with probability dead / (live + 1) (so healed partitions reconnect), plus one random seed when none of the
   targets is a seed and either no peer is known or with probability seeds / (live + dead) (so a mesh split into
   islands re-merges through the seeds, and a new node joins through any one live seed).

An exchange (``handle``): a Syn gets a SynAck (the responder's useful digest entries + the delta the initiator is
missing); a SynAck gets an Ack (the delta the responder is missing) unless that is empty; an Ack gets nothing.
Every inbound message is opened by ``auth.Authenticator`` first: a refused one raises ``Rejected`` (counted in
``stats.rejected``) and changes nothing -- in particular its sender never enters the membership.

``stop(leave=True)`` writes this node's "status" = left, pushes its newest entries as a one-way Ack to up to
``leave_fanout`` peers (those up to date apply it at once; the rest learn it by gossip or by phi), and closes the
transport after ``leave_timeout_s`` at most.

Driving: the agent never blocks and never sleeps; it runs on its ``clock`` (``AsyncioClock`` in a node,
``SimClock`` in tests and benchmarks), and its transport calls ``handle`` for every inbound message. Nothing here
raises into the loop: internal errors are logged and counted.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.gossip.auth import Authenticator, Rejected, RejectReason
from p2pnode.gossip.clock import AsyncioClock, Clock, TimerHandle
from p2pnode.gossip.cluster_view import ClusterView
from p2pnode.gossip.codec import Ack, MalformedMessage, Message, SynAck, decode, encode
from p2pnode.gossip.config import GossipConfig
from p2pnode.gossip.delta import suffix_delta
from p2pnode.gossip.exchange import MESSAGE_OVERHEAD, make_syn, step
from p2pnode.gossip.keys import ADDRESS_KEY, LEFT_STATUS, RATES_PREFIX, STATUS_KEY
from p2pnode.gossip.load import LOAD_KEY, Load, encode_load
from p2pnode.gossip.membership import Member, Membership, MemberState, Transition
from p2pnode.gossip.state import ClusterState
from p2pnode.gossip.summary import SUMMARY_META_KEY, SummaryPublisher, encode_meta, hash_key
from p2pnode.gossip.transport import Transport

__all__ = ["GossipAgent", "GossipStats"]

log = logging.getLogger("p2pnode.gossip")

KeyWatcher = Callable[[str, str, "bytes | None"], None]


@dataclass
class GossipStats:
    """Counters of one agent (they only grow)."""

    rounds: int = 0
    messages_sent: Counter[str] = field(default_factory=Counter)  # by kind: syn, syn_ack, ack, push
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    #: Inbound messages refused, by reason (``auth.RejectReason``: oversized, malformed, wrong_cluster, bad_mac,
    #: stale, replayed).
    rejected: Counter[str] = field(default_factory=Counter)
    entries_applied: int = 0
    #: Node deltas dropped because applying them would have left a gap (reordered or duplicated messages).
    delta_gaps: int = 0
    #: Node deltas of an older generation, of a forgotten node, or about this node itself.
    stale_deltas: int = 0
    #: Messages signed by another process using this node's id (a misconfiguration worth a look).
    self_id_conflicts: int = 0
    internal_errors: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "messages_sent": dict(self.messages_sent),
            "messages_received": self.messages_received,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "rejected": dict(self.rejected),
            "entries_applied": self.entries_applied,
            "delta_gaps": self.delta_gaps,
            "stale_deltas": self.stale_deltas,
            "self_id_conflicts": self.self_id_conflicts,
            "internal_errors": self.internal_errors,
        }


class _Listener:
    """Fans state changes out to membership, the ClusterView and key watchers (in that order)."""

    def __init__(self, agent: GossipAgent) -> None:
        self.agent = agent

    def on_node_added(self, node_id: str, generation: int) -> None:
        agent = self.agent
        agent.cluster_view.on_node_added(node_id, generation)
        agent._transition(agent.membership.on_node(node_id, generation, agent.clock.now()))

    def on_node_removed(self, node_id: str) -> None:
        self.agent.cluster_view.on_node_removed(node_id)

    def on_key_changed(self, node_id: str, key: str, value: bytes | None) -> None:
        agent = self.agent
        agent.cluster_view.on_key_changed(node_id, key, value)
        if key == STATUS_KEY and value == LEFT_STATUS:
            agent._transition(agent.membership.on_left(node_id, agent.clock.now()))
        for prefix, watcher in agent._watchers:
            if key.startswith(prefix):
                watcher(node_id, key, value)


class GossipAgent:
    """One node's gossip agent (see the module docstring).

    ``seeds``: addresses to join through (this node's own address is ignored there). ``generation``: defaults to
    the clock's wall time in ms at construction, so it grows across restarts. ``rng``: source of every random
    choice (peers, tie-breaks), seeded in tests for reproducibility.
    """

    def __init__(
        self,
        config: GossipConfig,
        self_id: str,
        advertise_address: str,
        transport: Transport,
        clock: Clock | None = None,
        seeds: list[str] | tuple[str, ...] = (),
        *,
        generation: int | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if config.cluster_secret is None and not getattr(transport, "secure", False):
            raise ValueError("a cluster secret is required unless the transport uses mTLS")
        if not self_id or not advertise_address:
            raise ValueError("self_id and advertise_address must not be empty")
        self.config = config
        self.self_id = self_id
        self.address = advertise_address
        self.transport = transport
        self.clock: Clock = clock or AsyncioClock()
        self.seeds = [s for s in dict.fromkeys(seeds) if s != advertise_address]
        self.generation = generation if generation is not None else self.clock.wall_ms()
        self.rng = rng or random.Random()
        self.stats = GossipStats()
        self.membership = Membership(self_id, config)
        self.state = ClusterState(self_id, self.generation)
        self.cluster_view = ClusterView(self.state, self.membership, self.clock)
        self.cluster_view.on_node_added(self_id, self.generation)
        self.state.listener = _Listener(self)
        self.auth = Authenticator(
            cluster_id=config.cluster_id,
            secret=config.cluster_secret,
            sender_id=self_id,
            sender_address=advertise_address,
            sender_generation=self.generation,
            wall_ms=self.clock.wall_ms,
            replay_window_s=config.replay_window_s,
            max_seen_nonces=config.max_seen_nonces,
            max_receive_bytes=config.max_receive_bytes,
        )
        self._publisher: SummaryPublisher | None = None
        self._load: Load | None = None
        self._watchers: list[tuple[str, KeyWatcher]] = []
        self._timer: TimerHandle | None = None
        self.running = False
        self._stopped = False

    # ------------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Publish this node's address and start gossiping (the first round, a join through the seeds, runs now).

        An agent lives once: after ``stop()`` a node restarts with a new agent (and a new generation).
        """
        if self.running:
            return
        if self._stopped:
            raise RuntimeError("a stopped GossipAgent cannot be restarted; create a new one (a new generation)")
        self.state.self_node.fresh_at = self.clock.now()
        self.state.set(ADDRESS_KEY, self.address.encode(), self.clock.now())
        self.transport.bind(self.handle)
        self.running = True
        log.info("gossip %s (generation %d) on %s, seeds %s", self.self_id, self.generation, self.address, self.seeds)
        self._round()

    async def stop(self, leave: bool = True) -> None:
        """Stop gossiping; with ``leave``, first tell peers this node is leaving for good (see module docstring)."""
        if not self.running:
            return
        self.running = False
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if leave:
            try:
                self._announce_leave()
            except Exception:  # never let a failed goodbye keep the node from stopping
                log.exception("gossip: leave announcement failed")
                self.stats.internal_errors += 1
        await self.transport.close(self.config.leave_timeout_s if leave else 0.0)

    def _announce_leave(self) -> None:
        self.state.set(STATUS_KEY, LEFT_STATUS, self.clock.now())
        delta = suffix_delta(self.state.self_node, self.config.max_message_bytes - MESSAGE_OVERHEAD)
        if delta is None:
            return
        targets = self._addresses(lambda p: p.usable)
        self.rng.shuffle(targets)
        payload = encode(Ack((delta,)))
        for address in targets[: self.config.leave_fanout]:
            self._send(address, self.auth.seal(payload), "push")

    # ------------------------------------------------------------------------------------------ what we publish

    def set_load(
        self, running: int, waiting: int, kv_usage: float, in_flight: int, prefill_backlog_tokens: int = 0
    ) -> None:
        """Record this node's load; published with the next round if it changed (at most once per round)."""
        self._load = Load(running, waiting, kv_usage, in_flight, prefill_backlog_tokens).rounded()

    def attach_index(self, index: PrefixIndex) -> None:
        """Publish a summary of ``index`` from the next round on (the agent polls it once per round)."""
        publisher = SummaryPublisher(index, self.config.summary_stride, self.config.summary_max_hashes)
        if self._publisher is not None:  # another index: withdraw what the previous one published at the next poll
            publisher.published = self._publisher.published
        self._publisher = publisher
        self.cluster_view.block_size = index.block_size

    def publish(self, key: str, value: bytes) -> None:
        """Set one of this node's keys in the reserved ``rates/`` slot (the rate-plan layer's)."""
        self._check_reserved(key)
        self.state.set(key, value, self.clock.now())

    def unpublish(self, key: str) -> None:
        self._check_reserved(key)
        self.state.delete(key, self.clock.now())

    @staticmethod
    def _check_reserved(key: str) -> None:
        if not key.startswith(RATES_PREFIX) or len(key) > 256:
            raise ValueError(f"only keys under {RATES_PREFIX!r} (at most 256 characters) can be published")

    def watch(self, prefix: str, callback: KeyWatcher) -> None:
        """Call ``callback(node_id, key, value_or_None)`` on every change of a key starting with ``prefix``, on any
        node, as it is applied here (synchronously: keep it cheap)."""
        self._watchers.append((prefix, callback))

    def read(self, prefix: str) -> dict[str, dict[str, bytes]]:
        """``{node id: {key: value}}`` of the live keys under ``prefix`` of every usable node (this one included)."""
        items = self.state.live_items(prefix)
        return {
            node_id: kv for node_id, kv in items.items() if (self.membership.state(node_id) or MemberState.DEAD).usable
        }

    # ------------------------------------------------------------------------------------------------- queries

    def members(self) -> list[Member]:
        """Every known member (this node included), sorted by node id."""
        return sorted(self.cluster_view.members(), key=lambda m: m.node_id)

    # -------------------------------------------------------------------------------------------------- rounds

    def _round(self) -> None:
        if not self.running:
            return
        try:
            self._do_round()
        except Exception:
            log.exception("gossip round failed")
            self.stats.internal_errors += 1
        if self.running:
            self._timer = self.clock.call_later(self.config.interval_s, self._round)

    def _do_round(self) -> None:
        now = self.clock.now()
        state = self.state
        state.bump_heartbeat(now)
        self._publish(now)
        transitions, expired = self.membership.update(now)
        for t in transitions:
            self._transition(t)
        for node_id in expired:
            state.forget(node_id, now, self.config.dead_node_grace_s)
        state.gc_tombstones(now, self.config.tombstone_grace_s)
        state.expire_forgotten(now)
        targets = self._select_targets()
        if targets:
            payload = encode(make_syn(state))
            for address in targets:
                self._send(address, self.auth.seal(payload), "syn")
        self.stats.rounds += 1

    def _publish(self, now: float) -> None:
        state = self.state
        if self._load is not None:
            state.set(LOAD_KEY, encode_load(self._load), now)  # a no-op when unchanged
        if self._publisher is not None:
            change = self._publisher.poll()
            if change is not None:
                state.set(SUMMARY_META_KEY, encode_meta(change.meta), now)
                for h in change.removed:
                    state.delete(hash_key(h), now)
                for h in change.added:
                    state.set(hash_key(h), b"", now)

    def _addresses(self, predicate: Callable[[Any], bool]) -> list[str]:
        return [p.address for p in self.cluster_view.peers() if not p.is_self and p.address and predicate(p)]

    def _select_targets(self) -> list[str]:
        rng = self.rng
        live = self._addresses(lambda p: p.usable)
        dead = self._addresses(lambda p: p.state is MemberState.DEAD)
        targets = rng.sample(live, min(self.config.fanout, len(live)))
        if dead and rng.random() < len(dead) / (len(live) + 1):
            targets.append(rng.choice(dead))
        seeds = self.seeds
        seeded = any(t in seeds for t in targets)
        if seeds and not seeded and (not live or rng.random() <= len(seeds) / (len(live) + len(dead))):
            targets.append(rng.choice(seeds))
        return list(dict.fromkeys(targets))

    def _transition(self, t: Transition | None) -> None:
        if t is None:
            return
        self.cluster_view.on_liveness(t.node_id, t.new)
        if t.new is None:
            log.info("gossip: forgot %s (was %s)", t.node_id, t.old)
        else:
            log.info("gossip: %s is %s (was %s)", t.node_id, t.new, t.old)

    # ------------------------------------------------------------------------------------------------ messages

    def _send(self, address: str, data: bytes, kind: str) -> None:
        self.stats.messages_sent[kind] += 1
        self.stats.bytes_sent += len(data)
        self.transport.send(address, data)

    def handle(self, data: bytes) -> bytes | None:
        """Process one inbound message; returns the reply envelope, or None. Raises Rejected when refused."""
        stats = self.stats
        stats.messages_received += 1
        stats.bytes_received += len(data)
        try:
            envelope = self.auth.open(data)
            message = decode(envelope.payload, self.config.max_receive_bytes)
        except Rejected as rejected:
            stats.rejected[rejected.reason.value] += 1
            log.debug("gossip: rejected a message: %s", rejected)
            raise
        except MalformedMessage as exc:
            stats.rejected[RejectReason.MALFORMED.value] += 1
            log.debug("gossip: malformed payload: %s", exc)
            raise Rejected(RejectReason.MALFORMED, str(exc)) from None
        if envelope.sender_id == self.self_id:
            if envelope.sender_generation != self.generation:
                stats.self_id_conflicts += 1
                log.warning("gossip: another process uses node id %s (at %s)", self.self_id, envelope.sender_address)
            return None
        if not self.running:
            return None
        try:
            reply = self._process(message)
        except Exception:
            log.exception("gossip: failed to process a message from %s", envelope.sender_id)
            stats.internal_errors += 1
            return None
        if reply is None:
            return None
        kind = "syn_ack" if isinstance(reply, SynAck) else "ack"
        out = self.auth.seal(encode(reply))
        stats.messages_sent[kind] += 1
        stats.bytes_sent += len(out)
        return out

    def _process(self, message: Message) -> Message | None:
        now = self.clock.now()
        result = step(self.state, message, now, self.config.max_message_bytes, self.rng)
        applied = result.applied
        if applied is not None:
            self.stats.entries_applied += applied.entries
            self.stats.delta_gaps += applied.gaps
            self.stats.stale_deltas += applied.stale
        for node_id in result.heartbeats:
            self._transition(self.membership.on_heartbeat(node_id, now))
        return result.reply
