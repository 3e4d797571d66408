"""GossipAgent: one node's gossip -- the round loop, the three-way exchange, and what the node publishes.

Every ``interval_s`` a round:

1. bump this node's heartbeat; run the round's publishers (``before_round``: the node publishes its load and its
   cache-summary changes there, pulled from its index -- never on the engine's event path);
2. re-evaluate every member's phi (alive / suspect / dead), forget members dead or left for longer than the grace,
   collect old tombstones;
3. send a Syn (the full digest) to ``fanout`` random usable peers, plus -- chitchat's rules -- one random dead peer
   with probability dead / (live + 1) (so healed partitions reconnect), plus one random seed when none of the
   targets is a seed and either no peer is known or with probability seeds / (live + dead) (so a mesh split into
   islands re-merges through the seeds, and a new node joins through any one live seed).

An exchange (``handle``): a Syn gets a SynAck (the responder's useful digest entries + the delta the initiator is
missing); a SynAck gets an Ack (the delta the responder is missing) unless that is empty; an Ack gets nothing.
Every inbound message is opened by ``auth.Authenticator`` first: a refused one raises ``Rejected`` (counted in
``stats.rejected``, logged at WARNING a few lines a minute at most) and changes nothing -- in particular its
sender never enters the membership.

Every message is addressed to its receiver's node id and generation (auth.py). An address whose node id is not
known yet (a seed) first gets a Hello; its HelloAck names the node, and the agent answers it with the Syn, bound to
that id and generation, on the same connection -- a join costs one round trip more, not a round.

Admission (admission.py): a sender whose node id is held by another live life at another address is refused
(``identity_conflict``, ALREADY_EXISTS), and so is a relayed new life of a known node that does not look like a
restart; a sender may bring at most ``max_vouched_members`` members never known here per ``vouch_window_s``; at
most ``max_members`` members are kept (a new one takes the place of the member dead longest; one that returns or
introduces itself may take the place of a member that never answered us; else it is refused). Gossip targets are
drawn from *reachable* members (they answered a message of ours at their address, membership.py) first, then
*proven* ones (heartbeat seen advancing), then the rest, and one member that is not reachable is asked every round
anyway, so members that exist only in someone's gossip -- heartbeating or not -- cannot crowd out real peers.
Every refusal is counted and logged at WARNING a few lines a minute at most (membership changes: at most
``DEFAULT_MEMBERSHIP_LOG_BURST`` lines a minute); a node with seeds and no live peer warns every minute that it runs
alone.

``stop(leave=True)`` writes this node's "status" = left, pushes its newest entries as a one-way Ack to up to
``leave_fanout`` peers (those up to date apply it at once; the rest learn it by gossip or by phi), and closes the
transport after ``leave_timeout_s`` at most.

What the keys mean is not the agent's business (chitchat's rule): consumers publish their keys (``publish``, usually
from a ``before_round`` hook), subscribe to every change of the replicated state (``subscribe``: the router's
``ClusterView``) or of keys under a prefix (``watch``), and to members' liveness (``watch_liveness``). The core reads
only its own keys (``keys.py``: address and status).

Driving: the agent never blocks and never sleeps; it runs on its ``clock`` (``AsyncioClock`` in a node,
``SimClock`` in tests and benchmarks), and its transport calls ``handle`` for every inbound message. Nothing here
raises into the loop: internal errors are logged and counted.
"""

from __future__ import annotations

import logging
import os
import random
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from p2pnode.gossip.admission import VouchBudget, judge_claim
from p2pnode.gossip.auth import NONCE_BYTES, Authenticator, Envelope, Rejected, RejectReason
from p2pnode.gossip.clock import AsyncioClock, Clock, TimerHandle
from p2pnode.gossip.codec import Ack, Hello, HelloAck, MalformedMessage, Message, Syn, SynAck, decode, encode
from p2pnode.gossip.config import DEFAULT_MEMBERSHIP_LOG_BURST, GossipConfig
from p2pnode.gossip.delta import NodeDelta, compute_delta, suffix_delta
from p2pnode.gossip.digest import NodeDigest
from p2pnode.gossip.exchange import MESSAGE_OVERHEAD, make_syn, step
from p2pnode.gossip.keys import ADDRESS_KEY, CORE_KEYS, LEFT_STATUS, MAX_KEY_CHARS, STATUS_KEY
from p2pnode.gossip.membership import Member, Membership, MemberState, Transition
from p2pnode.gossip.state import ClusterState, NodeState, StateListener
from p2pnode.gossip.transport import Transport
from p2pnode.log_limit import LogLimiter

__all__ = ["GossipAgent", "GossipStats"]

log = logging.getLogger("p2pnode.gossip")

KeyWatcher = Callable[[str, str, "bytes | None"], None]
LivenessWatcher = Callable[[Transition], None]

#: Hellos awaiting their HelloAck, at most (oldest forgotten first): a few seeds per round.
MAX_PENDING_PROBES = 256


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
    #: New members refused at the member cap.
    members_refused: int = 0
    #: New members refused because their sender had vouched for its budget's worth already (admission.py).
    vouches_refused: int = 0
    #: Messages and relayed lives refused because the node id is held by another live life (admission.py).
    identity_conflicts: int = 0
    #: Hellos sent to addresses of unknown node id (seeds), and the HelloAcks that answered one.
    probes_sent: int = 0
    probes_answered: int = 0

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
            "members_refused": self.members_refused,
            "vouches_refused": self.vouches_refused,
            "identity_conflicts": self.identity_conflicts,
            "probes_sent": self.probes_sent,
            "probes_answered": self.probes_answered,
        }


class _Listener:
    """Fans state changes out to the subscribers, membership and key watchers (in that order)."""

    def __init__(self, agent: GossipAgent) -> None:
        self.agent = agent

    def on_node_added(self, node_id: str, generation: int) -> None:
        agent = self.agent
        for subscriber in agent._subscribers:
            subscriber.on_node_added(node_id, generation)
        agent._transition(agent.membership.on_node(node_id, generation, agent.clock.now()))

    def on_node_removed(self, node_id: str) -> None:
        for subscriber in self.agent._subscribers:
            subscriber.on_node_removed(node_id)

    def on_key_changed(self, node_id: str, key: str, value: bytes | None) -> None:
        agent = self.agent
        for subscriber in agent._subscribers:
            subscriber.on_key_changed(node_id, key, value)
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
        self.state = ClusterState(self_id, self.generation, max_nodes=config.max_members)
        self.state.make_room = self._make_room
        self._subscribers: list[StateListener] = []
        self._before_round: list[Callable[[], None]] = []
        #: Per peer, the newest version of this node's state its copy is known to have (bounded: max_members peers),
        #: and this node's version when it last sent the peer a Syn.
        self._known_of_us: OrderedDict[str, int] = OrderedDict()
        self._syn_versions: OrderedDict[str, int] = OrderedDict()
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
        self._watchers: list[tuple[str, KeyWatcher]] = []
        self._timer: TimerHandle | None = None
        self.running = False
        self._stopped = False
        # --- liveness watchers, probes, rate-limited logs, running alone ---
        self._liveness_watchers: list[LivenessWatcher] = []
        self._probes: OrderedDict[bytes, float] = OrderedDict()  # Hello nonce -> sent at
        self._log = LogLimiter(log, clock=self.clock.now)
        self._membership_log = LogLimiter(log, burst=DEFAULT_MEMBERSHIP_LOG_BURST, clock=self.clock.now)
        self._alone_log = LogLimiter(log, burst=1, clock=self.clock.now)  # once a minute
        self._started_at = 0.0
        self._alone_since: float | None = None
        # --- admission (admission.py) ---
        self._vouches = VouchBudget(config.max_vouched_members, config.vouch_window_s, max_senders=config.max_members)

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
        self._started_at = self.clock.now()
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

    def withdraw(self) -> None:
        """Stop offering this node to peers' routers for the rest of its life (its engine died): peers see it as
        left at the next exchanges, while it keeps gossiping -- as an ingress it still routes to them."""
        if self.running and self.state.self_node.get(STATUS_KEY) != LEFT_STATUS:
            self.state.set(STATUS_KEY, LEFT_STATUS, self.clock.now())
            log.warning("gossip: %s withdrawn from routing: peers will see it as left", self.self_id)

    def _announce_leave(self) -> None:
        self.state.set(STATUS_KEY, LEFT_STATUS, self.clock.now())
        delta = suffix_delta(self.state.self_node, self.config.max_message_bytes - MESSAGE_OVERHEAD)
        if delta is None:
            return
        targets = [(address, node_id) for node_id, address, state in self._peers() if state.usable]
        self.rng.shuffle(targets)
        payload = encode(Ack((delta,)))
        for address, node_id in targets[: self.config.leave_fanout]:
            self._send(address, self.auth.seal(payload, node_id, self.generation_of(node_id)), "push")

    # ------------------------------------------------------------------------------------------ what we publish

    def before_round(self, publisher: Callable[[], None]) -> None:
        """Call ``publisher()`` at the start of every round, after the heartbeat: where a consumer publishes what
        changed since the last round (``publish``), so a burst of changes costs one version per key and round."""
        self._before_round.append(publisher)

    def publish(self, key: str, value: bytes) -> None:
        """Set one of this node's keys (a new version when the value changed; a no-op otherwise). The core's own keys
        (``keys.CORE_KEYS``) are refused."""
        self._check_key(key)
        self.state.set(key, value, self.clock.now())

    def unpublish(self, key: str) -> None:
        self._check_key(key)
        self.state.delete(key, self.clock.now())

    @staticmethod
    def _check_key(key: str) -> None:
        if key in CORE_KEYS or not key or len(key) > MAX_KEY_CHARS:
            raise ValueError(
                f"cannot publish {key!r}: keys are 1..{MAX_KEY_CHARS} characters and not one of the core's "
                f"({', '.join(sorted(CORE_KEYS))})"
            )

    def subscribe(self, listener: StateListener) -> None:
        """Tell ``listener`` every change of the replicated state from now on (nodes added and removed, keys set and
        deleted), synchronously, after first replaying the state as it stands (so it starts complete)."""
        for node_id, node in list(self.state.nodes.items()):
            listener.on_node_added(node_id, node.generation)
            for key, value in node.items():
                listener.on_key_changed(node_id, key, value)
        self._subscribers.append(listener)

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
        now = self.clock.now()
        out = []
        for node_id in sorted(self.state.nodes):
            node = self.state.nodes[node_id]
            is_self = node_id == self.self_id
            out.append(Member(
                node_id=node_id,
                address=(node.get(ADDRESS_KEY) or b"").decode(errors="replace"),
                state=self.membership.state(node_id) or MemberState.DEAD,
                generation=node.generation,
                heartbeat=node.heartbeat,
                info_age_s=0.0 if is_self else max(0.0, now - node.fresh_at),
                phi=self.membership.phi(node_id, now),
                is_self=is_self,
            ))
        return out

    def usable_ids(self) -> list[str]:
        """The ids of the usable members (alive or suspect), this node included, sorted."""
        return sorted(n for n in self.state.nodes if (self.membership.state(n) or MemberState.DEAD).usable)

    def watch_liveness(self, callback: LivenessWatcher) -> None:
        """Call ``callback(transition)`` on every liveness change of a member (alive, suspect, dead, left,
        forgotten), synchronously: keep it cheap. The node cancels calls forwarded to a peer turning suspect."""
        self._liveness_watchers.append(callback)

    def trusted(self, node_id: str) -> bool:
        """Alive (not suspect) and reachable (it answered a message of ours at its address): a peer to send requests
        to first."""
        return self.membership.state(node_id) is MemberState.ALIVE and self.membership.reachable(node_id)

    def generation_of(self, node_id: str) -> int:
        """The generation (life) of ``node_id`` this node knows -- what a message to it is sealed for -- or 0."""
        node = self.state.nodes.get(node_id)
        return 0 if node is None else node.generation

    def check_sender(self, sender_id: str, address: str, generation: int) -> None:
        """Refuse (raise Rejected ``identity_conflict``) a sender claiming a node id whose known life says it is
        another process: a new life at another address while the known one is alive, the same life at another
        address, or an earlier life (admission.py, rule 3). The forwarded-request service asks too."""
        node = self.state.nodes.get(sender_id)
        if node is None or sender_id == self.self_id:
            return
        why = judge_claim(node.generation, _address(node), self.membership.state(sender_id), generation, address)
        if why is not None:
            self.stats.identity_conflicts += 1
            raise Rejected(
                RejectReason.IDENTITY_CONFLICT,
                f"{sender_id[:64]!r} at {address[:64]!r} (generation {generation}) is another process: {why}",
            )

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
        for publisher in self._before_round:
            try:
                publisher()
            except Exception:  # a consumer's bug must not stop the heartbeat
                log.exception("gossip: a round's publisher failed")
                self.stats.internal_errors += 1
        self._update_liveness(now)
        state.gc_tombstones(now, self.config.tombstone_grace_s)
        state.expire_forgotten(now)
        targets = self._select_targets()
        if targets:
            ids = self._ids_by_address()
            syns = []
            for address in targets:
                node_id = ids.get(address)
                # A member not heard from lately may run another life by now (restarted under its id): a Syn sealed
                # for the life we know would be refused (wrong_generation) forever by a restarted node that has no
                # seeds to call us itself. A Hello asks which life runs there; the HelloAck is answered with a Syn
                # sealed for that life.
                if node_id is None or self.membership.state(node_id) in (MemberState.SUSPECT, MemberState.DEAD):
                    self._probe(address, now)
                    continue
                syns.append((address, node_id))
            self._start_exchanges(syns)
        self._check_alone(now)
        self._log.flush(logging.WARNING)
        self._membership_log.flush()
        self.stats.rounds += 1

    def _update_liveness(self, now: float) -> None:
        """Re-evaluate every member's phi (alive / suspect / dead) and forget those gone longer than the grace."""
        transitions, expired = self.membership.update(now)
        for t in transitions:
            self._transition(t)
        for node_id in expired:
            self.state.forget(node_id, now, self.config.dead_node_grace_s)

    def _start_exchanges(self, targets: list[tuple[str, str]]) -> None:
        """Send a Syn to each ``(address, node id)``: with ``stagger_exchanges``, the first now and the others spread
        over the round, each with the digest of its moment -- so what the first exchange brought is not asked for
        (and sent) again by the next ones, and news moves on a third of a round later instead of a round."""
        if not targets:
            return
        if not self.config.stagger_exchanges:
            payload = encode(make_syn(self.state))
            for address, node_id in targets:
                self._note_syn(node_id)
                self._send(address, self.auth.seal(payload, node_id, self.generation_of(node_id)), "syn")
            return
        spacing = self.config.interval_s / len(targets)
        self._syn(*targets[0])
        for i, (address, node_id) in enumerate(targets[1:], 1):
            self.clock.call_later(i * spacing, lambda a=address, n=node_id: self._syn(a, n))

    def _syn(self, address: str, node_id: str) -> None:
        if not self.running or self.generation_of(node_id) == 0:
            return
        try:
            # liveness is judged at every exchange, not only at the round's start: a death is declared within a
            # third of a round of phi crossing the threshold
            self._update_liveness(self.clock.now())
            if self.membership.state(node_id) is not MemberState.ALIVE:
                return
            payload = encode(make_syn(self.state))
            self._note_syn(node_id)
            self._send(address, self.auth.seal(payload, node_id, self.generation_of(node_id)), "syn")
        except Exception:
            log.exception("gossip: a staggered Syn failed")
            self.stats.internal_errors += 1

    def _note_syn(self, node_id: str) -> None:
        _remember(self._syn_versions, node_id, self.state.self_node.max_version, self.config.max_members)

    def _note_known_of_us(self, sender: str, digest: tuple[NodeDigest, ...], reply: bool) -> None:
        """Remember how far ``sender``'s copy of this node goes (what ``push_own`` sends from): as its digest says;
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

    def push_own(self) -> None:
        """Send this node's newest entries now, ahead of the round, to ``push_fanout`` live peers that lack them (one
        one-way Ack each, from the version the peer's copy is known to have, so it never leaves a gap; only when all
        of it fits ``push_max_bytes``): what a consumer calls when news should not wait for the exchanges (the cache
        summary's new prefixes). Those peers spread it with their own exchanges; a peer reached by another path first
        just skips the entries."""
        if not self.running or self.config.push_fanout <= 0:
            return
        own = self.state.self_node
        known = self._known_of_us
        candidates = [
            (node_id, address)
            for node_id, address, state in self._peers()
            if state is MemberState.ALIVE and own.last_gc_version <= known.get(node_id, -1) < own.max_version
        ]
        if not candidates:
            return
        room = min(self.config.push_max_bytes, self.config.max_message_bytes) - MESSAGE_OVERHEAD
        for node_id, address in self.rng.sample(candidates, min(self.config.push_fanout, len(candidates))):
            theirs = NodeDigest(self.self_id, self.generation, 0, known[node_id], 0)
            delta = compute_delta(self.state, {self.self_id: theirs}, room, complete=False)
            # only news that fits a small message goes ahead of the round; a peer further behind (or a burst of
            # thousands of hashes) is the exchanges' job, and a push would only repeat their bytes
            if delta and delta[0].to_version == own.max_version:
                payload = encode(Ack(tuple(delta)))
                self._send(address, self.auth.seal(payload, node_id, self.generation_of(node_id)), "push")
                known[node_id] = delta[0].to_version  # the next push starts there (lost: a gap, dropped, harmless)

    def _peers(self) -> list[tuple[str, str, MemberState]]:
        """(node id, address, state) of every other known node that has published an address."""
        out = []
        states = self.membership.state
        for node_id, node in self.state.nodes.items():
            if node_id == self.self_id:
                continue
            address = node.get(ADDRESS_KEY)
            if address:
                out.append((node_id, address.decode(errors="replace"), states(node_id) or MemberState.DEAD))
        return out

    def _ids_by_address(self) -> dict[str, str]:
        """The node id to address a message to, by address (a usable member wins over a dead one there)."""
        ids: dict[str, str] = {}
        for node_id, address, _ in sorted(self._peers(), key=lambda p: p[2].usable):
            ids[address] = node_id
        return ids

    def _probe(self, address: str, now: float) -> None:
        """Ask ``address`` which node it is (a Hello); its HelloAck is answered with a bound Syn (``handle``)."""
        nonce = os.urandom(NONCE_BYTES)
        self._probes[nonce] = now
        while len(self._probes) > MAX_PENDING_PROBES:
            self._probes.popitem(last=False)
        self.stats.probes_sent += 1
        self._send(address, self.auth.seal(encode(Hello()), "", 0, nonce), "hello")

    def _check_alone(self, now: float) -> None:
        """Warn (once a minute at most) when this node has seeds but has had no live peer for a while."""
        if not self.seeds or any(state.usable for _, _, state in self._peers()):
            self._alone_since = None
            return
        if self._alone_since is None:
            self._alone_since = now
        if now - self._alone_since >= self.config.alone_warning_s:
            self._alone_log.warning(
                "alone",
                "gossip: no peer alive for %.0f s and no seed answers (seeds %s): this node serves alone; check "
                "--seeds, and that every node runs with the same --cluster-id and cluster secret (a refusing peer "
                "is logged by the side that refuses and the side refused)",
                now - self._alone_since, ", ".join(self.seeds),
            )

    def _make_room(self) -> bool:
        """At the member cap: forget the member dead or left the longest, so a new one can be taken."""
        victim = self.membership.longest_down()
        if victim is None:
            return False
        self._evict(victim)
        return True

    def _displace(self) -> bool:
        """At the member cap, for a member that must get in (admission.py, rule 2): forget the member never
        reachable heard of last (never a seed's member, never one that answered us)."""
        seeds = frozenset(n for n, address, _ in self._peers() if address in self.seeds)
        victim = self.membership.newest_unreachable(keep=seeds)
        if victim is None:
            return False
        self._evict(victim)
        return True

    def _evict(self, victim: str) -> None:
        self._transition(Transition(victim, self.membership.state(victim), None))
        self.membership.forget(victim)
        self.state.forget(victim, self.clock.now(), self.config.dead_node_grace_s)

    def _select_targets(self) -> list[str]:
        rng = self.rng
        reachable: list[str] = []
        others: tuple[list[str], list[str], list[str]] = ([], [], [])  # spoke to us, proven, the rest
        dead: list[str] = []
        membership = self.membership
        for node_id, address, state in self._peers():
            if state.usable:
                if membership.reachable(node_id):
                    reachable.append(address)
                else:
                    others[0 if membership.spoke(node_id) else 1 if membership.proven(node_id) else 2].append(address)
            elif state is MemberState.DEAD:
                dead.append(address)
        live = reachable + [a for tier in others for a in tier]
        fanout = self.config.fanout
        targets = rng.sample(reachable, min(fanout, len(reachable)))
        # Members that never answered us fill what the reachable leave of the fanout -- those that spoke to us
        # first, then the proven, then the rest -- and one of them is asked every round anyway: a new member answers
        # within a round or two, while members made up by a secret holder, heartbeating or not, never answer, so
        # they never crowd out the real ones.
        need = max(fanout - len(targets), 1) if len(live) > len(reachable) else 0
        for tier in others:
            taken = rng.sample(tier, min(need, len(tier)))
            targets += taken
            need -= len(taken)
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
        if t.new is None:
            self._membership_log.info("membership", "gossip: forgot %s (was %s)", t.node_id, t.old)
        else:
            self._membership_log.info("membership", "gossip: %s is %s (was %s)", t.node_id, t.new, t.old)
        for watcher in self._liveness_watchers:
            try:
                watcher(t)
            except Exception:  # a watcher's bug must not break gossip
                log.exception("gossip: liveness watcher failed")
                self.stats.internal_errors += 1

    # ------------------------------------------------------------------------------------------------ messages

    def _send(self, address: str, data: bytes, kind: str) -> None:
        self.stats.messages_sent[kind] += 1
        self.stats.bytes_sent += len(data)
        self.transport.send(address, data)

    def handle(
        self, data: bytes, reply_from: str | None = None, peer_names: frozenset[str] | None = None
    ) -> bytes | None:
        """Process one inbound message; returns the reply envelope, or None. Raises Rejected when refused.

        ``reply_from``: the address this node sent the message this one answers to (a reply on our own call: its
        sender, at that address, is reachable); None for a message a peer started. ``peer_names``: the names in the
        caller's certificate (mTLS), which must name the sender (auth.py); None when the transport does not say.
        """
        stats = self.stats
        stats.messages_received += 1
        stats.bytes_received += len(data)
        try:
            envelope = self.auth.open(data, allow_unbound=True, peer_names=peer_names)
            message = decode(envelope.payload, self.config.max_receive_bytes)
            if not envelope.receiver_id and not isinstance(message, Hello):
                raise Rejected(RejectReason.WRONG_RECEIVER, f"unbound {type(message).__name__} (only a Hello may be)")
            self.check_sender(envelope.sender_id, envelope.sender_address, envelope.sender_generation)
        except Rejected as rejected:
            self._rejected(rejected)
            raise
        except MalformedMessage as exc:
            rejected = Rejected(RejectReason.MALFORMED, f"payload: {exc}")
            self._rejected(rejected)
            raise rejected from None
        if not self.running:
            return None
        if isinstance(message, Hello):  # changes nothing: the answer is who we are, bound to the prober
            return self._reply(HelloAck(envelope.nonce), envelope)
        if isinstance(message, HelloAck):
            if self._probes.pop(message.probe_nonce, None) is None:
                return None  # not an answer to a probe of ours (or a late one): nothing to do
            stats.probes_answered += 1
            return self._reply(make_syn(self.state), envelope)
        try:
            reply = self._process(message, envelope.sender_id)
        except Exception:
            log.exception("gossip: failed to process a message from %s", envelope.sender_id)
            stats.internal_errors += 1
            return None
        node = self.state.nodes.get(envelope.sender_id)
        if node is not None and node.generation == envelope.sender_generation:
            self.membership.mark_spoke(envelope.sender_id)
            if reply_from is not None and _address(node) == reply_from:
                self.membership.mark_reachable(envelope.sender_id)
        if reply is None:
            return None
        return self._reply(reply, envelope)

    def _reply(self, message: Message, to: Envelope) -> bytes:
        """``message`` sealed for the sender of ``to`` (the life that sent it)."""
        kind = {SynAck: "syn_ack", Ack: "ack", HelloAck: "hello_ack", Syn: "syn"}[type(message)]
        out = self.auth.seal(encode(message), to.sender_id, to.sender_generation)
        self.stats.messages_sent[kind] += 1
        self.stats.bytes_sent += len(out)
        return out

    def _rejected(self, rejected: Rejected) -> None:
        """Count a refused message and log it (a few lines a minute per reason: a flood is counted, not logged)."""
        reason = rejected.reason
        self.stats.rejected[reason.value] += 1
        if reason is RejectReason.OWN_SENDER:
            self.stats.self_id_conflicts += 1
        hint = _REJECTION_HINTS.get(reason, "")
        self._log.warning(f"rejected:{reason.value}", "gossip: refused a message: %s%s", rejected, hint)

    def _process(self, message: Message, sender: str) -> Message | None:
        now = self.clock.now()
        if isinstance(message, (Syn, SynAck)):
            self._note_known_of_us(sender, message.digest, isinstance(message, SynAck))
        gate = _Gate(self, sender)
        result = step(self.state, message, now, self.config.max_message_bytes, self.rng, gate)
        applied = result.applied
        if applied is not None:
            self.stats.entries_applied += applied.entries
            self.stats.delta_gaps += applied.gaps
            self.stats.stale_deltas += applied.stale
        nodes = self.state.nodes
        for node_id in result.heartbeats:
            node = nodes.get(node_id)
            self._transition(self.membership.on_heartbeat(node_id, now, node.heartbeat if node is not None else None))
        gate.report()
        return result.reply


class _Gate:
    """The agent's admission rules (admission.py) for the deltas of one message from ``sender`` (``delta.Gate``);
    ``report`` counts and logs what it refused."""

    def __init__(self, agent: GossipAgent, sender: str) -> None:
        self.agent = agent
        self.sender = sender
        self.refused_cap: list[str] = []
        self.refused_vouch: list[str] = []
        self.conflicts: list[tuple[NodeDelta, str]] = []

    def _must_get_in(self, node_id: str) -> bool:
        """A member that introduces itself, or that this node knew before (it returns): no budget spent, and it
        may take the place of a member that never answered us (rules 1 and 2)."""
        return node_id == self.sender or self.agent.state.was_known(node_id)

    def wants(self, node_id: str) -> bool:
        agent = self.agent
        if self._must_get_in(node_id):
            return True
        if agent._vouches.available(self.sender, agent.clock.now()) < 1.0:
            return False
        state = agent.state
        return len(state.nodes) < agent.config.max_members or agent.membership.longest_down() is not None

    def new_member(self, delta: NodeDelta) -> bool:
        agent = self.agent
        node_id = delta.node_id
        now = agent.clock.now()
        must = self._must_get_in(node_id)
        if not must and agent._vouches.available(self.sender, now) < 1.0:
            self.refused_vouch.append(node_id)
            return False
        if not agent.state.has_room() and not (must and agent._displace()):
            self.refused_cap.append(node_id)
            return False
        if not must:
            agent._vouches.spend(self.sender, now)
        return True

    def new_life(self, node: NodeState, delta: NodeDelta) -> bool:
        agent = self.agent
        address = next((v for k, _, v in delta.entries if k == ADDRESS_KEY and v), None)
        claimed = address.decode(errors="replace") if address is not None else None
        why = judge_claim(node.generation, _address(node), agent.membership.state(node.node_id), delta.generation,
                          claimed)
        if why is None:
            return True
        self.conflicts.append((delta, f"{claimed or 'an unknown address'}: {why}"))
        return False

    def report(self) -> None:
        agent = self.agent
        stats = agent.stats
        config = agent.config
        if self.refused_cap:
            stats.members_refused += len(self.refused_cap)
            agent._log.warning(
                "member_cap",
                "gossip: refused %d new member(s) (e.g. %s, from %s): this node already keeps max_members = %d and "
                "none is dead to make room (a flood of made-up members, or a mesh larger than the cap)",
                len(self.refused_cap), self.refused_cap[0][:64], self.sender[:64], config.max_members,
            )
        if self.refused_vouch:
            stats.vouches_refused += len(self.refused_vouch)
            agent._log.warning(
                f"vouch:{self.sender[:64]}",
                "gossip: refused %d new member(s) (e.g. %s) from %s: it vouched for %d new members in %.0f s "
                "already (max_vouched_members), a flood of made-up members or a bug on %s",
                len(self.refused_vouch), self.refused_vouch[0][:64], self.sender[:64], config.max_vouched_members,
                config.vouch_window_s, self.sender[:64],
            )
        for delta, why in self.conflicts:
            stats.identity_conflicts += 1
            agent._log.warning(
                f"identity:{delta.node_id[:64]}",
                "gossip: refused a new life of %s (generation %d at %s; relayed by %s): a second process runs "
                "under that node id, or it moved before its earlier life was seen dead (it is admitted once it is)",
                delta.node_id[:64], delta.generation, why, self.sender[:64],
            )


def _remember(table: OrderedDict[str, int], key: str, value: int, limit: int) -> None:
    """Set ``table[key]`` as its newest entry, dropping the oldest beyond ``limit`` entries."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)


def _address(node: NodeState) -> str | None:
    """The advertised address of ``node`` (its "addr" key), if known."""
    value = node.get(ADDRESS_KEY)
    return value.decode(errors="replace") if value else None


#: What a refusal usually means, for the operator reading the log line.
_REJECTION_HINTS = {
    RejectReason.WRONG_CLUSTER: " -- a node of another --cluster-id",
    RejectReason.BAD_MAC: " -- a node with another cluster secret (or a forged message)",
    RejectReason.OWN_SENDER: " -- another process runs with this node's --node-id, or a replayed message",
    RejectReason.WRONG_RECEIVER: " -- a message for another node (a replay, or a stale address of a restarted peer)",
    RejectReason.WRONG_GENERATION: " -- sealed for an earlier life of this node: a replay, or a message in flight "
    "across this node's restart (its sender learns the new generation from gossip)",
    RejectReason.CERT_MISMATCH: " -- a certificate holder speaking as another node id (each node's certificate must "
    "name its --node-id)",
    RejectReason.IDENTITY_CONFLICT: " -- a second process runs under that node id; the mesh keeps the life it knows "
    "until that one is seen dead or leaves",
    RejectReason.STALE: " -- clocks of the two nodes differ by more than the replay window, or a replay",
    RejectReason.REPLAYED: " -- a message seen before (a replay)",
    RejectReason.MALFORMED: "",
    RejectReason.OVERSIZED: "",
}
