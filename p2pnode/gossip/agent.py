"""GossipAgent: one node's gossip -- the round loop, and the one object consumers publish through and read from.

Every ``interval_s`` a round:

1. bump this node's heartbeat; run the round's publishers (``before_round``: the node publishes its load and its
   cache-summary changes there, pulled from its index -- never on the engine's event path);
2. re-evaluate every member's phi (alive / suspect / dead), forget members dead or left for longer than the grace,
   collect old tombstones (liveness.py);
3. start exchanges with the round's targets (targets.py: ``fanout`` live peers, reachable ones first, plus
   chitchat's dead peer and seed), staggered over the round (``stagger_exchanges``). A target whose node id is not
   known yet (a seed), or a member suspect or dead (it may run a new life by now), is probed with a Hello instead
   (outbox.py), and its HelloAck answered with a Syn bound to the life it names;
4. warn (once a minute) when this node has seeds and no live peer: it runs alone.

A node that learns of a later life of its own node id -- a peer's digest or delta names it, or a peer refuses this
node's messages because that life holds the id -- runs under an id another process took (this node was frozen past
dead, say, and a process with the secret started under its id elsewhere). It logs that at ERROR (once a minute: the
peers route to the other process, and this one serves only its own clients), and with per-node certificates, where
the other life cannot have been announced by this node's certificate, it *reclaims* the id: it starts a new life
(a generation above the other one) that its certificate vouches for first-hand, which the peers take over a life
they only heard of through relays (admission.py, rule 4) -- unless that life starts further ahead of this node's
clock than two replay windows (no real process's clock is that far off): made up, it is reported and not outbid.

The pieces, one concept per module: ``inbound`` (each message opened, admitted, applied and answered: the
exchange), ``outbox`` (sealing, counting, sending, probes), ``push`` (this node's news ahead of the round, and its
leave), ``liveness`` (the failure detector fed and its transitions told), ``roster`` (the members as state and
liveness see them together, and room at the member cap), ``admission`` (who may enter the membership), and
``listeners`` (each state change fanned out to subscribers, liveness and key watchers).

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
import math
import random
import re
from collections.abc import Callable

from p2pnode.gossip.admission import Admission
from p2pnode.gossip.auth import Authenticator
from p2pnode.gossip.clock import AsyncioClock, Clock, TimerHandle
from p2pnode.gossip.codec import MAX_SHARDS, Syn, encode
from p2pnode.gossip.config import GossipConfig
from p2pnode.gossip.digest import digest_shards, shard_of
from p2pnode.gossip.exchange import make_syn
from p2pnode.gossip.inbound import Inbound
from p2pnode.gossip.keys import ADDRESS_KEY, CORE_KEYS, LEFT_STATUS, MAX_KEY_CHARS, STATUS_KEY
from p2pnode.gossip.listeners import KeyWatcher, StateFanout
from p2pnode.gossip.liveness import Liveness, LivenessWatcher
from p2pnode.gossip.membership import Member, Membership, MemberState
from p2pnode.gossip.outbox import Outbox
from p2pnode.gossip.push import OwnPush
from p2pnode.gossip.roster import Roster
from p2pnode.gossip.state import ClusterState, StateListener
from p2pnode.gossip.stats import GossipStats
from p2pnode.gossip.targets import select_targets
from p2pnode.gossip.transport import Transport
from p2pnode.log_limit import LogLimiter

__all__ = ["GossipAgent", "GossipStats"]

log = logging.getLogger("p2pnode.gossip")


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
        self.state = ClusterState(
            self_id, self.generation, max_nodes=config.max_members, max_node_keys=config.max_node_keys,
            max_node_bytes=config.max_node_bytes,
        )
        self.auth = _authenticator(config, self_id, advertise_address, self.generation, self.clock)
        self._before_round: list[Callable[[], None]] = []
        self._timer: TimerHandle | None = None
        self._round_due: float | None = None  # when the next round's timer should fire (its lateness is a stall)
        self._stalled_until = 0.0  # the end of the last stall counted (a stall seen by two timers counts once)
        self._syns_made = 0  # Syns of a sharded digest made so far: the next one carries the next shard
        self.running = False
        self._stopped = False
        self._log = LogLimiter(log, clock=self.clock.now)  # refusals, by reason (inbound, admission)
        self._alone_log = LogLimiter(log, burst=1, clock=self.clock.now)  # once a minute
        self._alone_since: float | None = None
        self._superseded_log = LogLimiter(log, burst=1, clock=self.clock.now)  # once a minute
        self._reclaimed_at: float | None = None
        #: How far a later life's generation (its start, ms of wall time) may lie ahead of this node's clock for a
        #: reclaim to start above it: a real process's clock is within the replay window of its peers' (or none
        #: accepts its envelopes), and so is this node's. Beyond, the life was made up (near 2**64 it would leave no
        #: generation to take), and a life above it would keep every restart of this node below it until then.
        self._max_reclaim_ahead_ms = int(2 * config.replay_window_s * 1000)
        self._assemble()

    def _assemble(self) -> None:
        """Build the pieces (module docstring) around the state, and hook them to it."""
        config, state, stats, clock = self.config, self.state, self.stats, self.clock
        self._liveness = Liveness(self.membership, state, config, stats, clock)
        self._fanout = StateFanout(self._liveness)
        self._roster = Roster(self.self_id, self.seeds, state, self._liveness, clock, config)
        self._outbox = Outbox(self.transport, self.auth, stats, self._roster.generation_of, config.wire_version)
        self._push = OwnPush(self.generation, state, config, self.rng, self._roster, self._outbox)
        self._admission = Admission(state, self.membership, config, stats, clock, self._log, self._roster.displace)
        self._inbound = Inbound(
            config=config, auth=self.auth, state=state, rng=self.rng, clock=clock, stats=stats, log=self._log,
            outbox=self._outbox, push=self._push, admission=self._admission, liveness=self._liveness,
        )
        self._liveness.watch(self._admission.forgotten)
        state.make_room = self._roster.make_room
        state.listener = self._fanout
        self._inbound.on_superseded = self._superseded
        self._inbound.make_syn = self._make_syn
        self._liveness.on_declared = self.push_own  # a death this node declares: to push_fanout peers at once
        if hasattr(self.transport, "on_identity_conflict"):  # the gRPC transport: peers refusing us say why
            self.transport.on_identity_conflict = self._refused_as_conflict

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
                self.state.set(STATUS_KEY, LEFT_STATUS, self.clock.now())
                self._push.push_newest(self.config.leave_fanout)
            except Exception:  # never let a failed goodbye keep the node from stopping
                log.exception("gossip: leave announcement failed")
                self.stats.internal_errors += 1
        await self.transport.close(self.config.leave_timeout_s if leave else 0.0)

    def withdraw(self) -> None:
        """Stop offering this node to peers' routers for the rest of its life (its engine died, or it drains): peers
        see it as left at the next exchanges, while it keeps gossiping -- as an ingress it still routes to them."""
        if self.running and self.state.self_node.get(STATUS_KEY) != LEFT_STATUS:
            self.state.set(STATUS_KEY, LEFT_STATUS, self.clock.now())
            log.warning("gossip: %s withdrawn from routing: peers will see it as left", self.self_id)

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

    def push_own(self) -> None:
        """Send this node's newest entries now, ahead of the round, to ``push_fanout`` live peers that lack them (one
        one-way Ack each, from the version the peer's copy is known to have, so it never leaves a gap; only when all
        of it fits ``push_max_bytes``): what a consumer calls when news should not wait for the exchanges (the cache
        summary's new prefixes). Those peers spread it with their own exchanges (push.py)."""
        if not self.running or self.config.push_fanout <= 0:
            return
        self._push.push_fresh()

    def subscribe(self, listener: StateListener) -> None:
        """Tell ``listener`` every change of the replicated state from now on (nodes added and removed, keys set and
        deleted), synchronously, after first replaying the state as it stands (so it starts complete)."""
        self._fanout.subscribe(listener, self.state)

    def watch(self, prefix: str, callback: KeyWatcher) -> None:
        """Call ``callback(node_id, key, value_or_None)`` on every change of a key starting with ``prefix``, on any
        node, as it is applied here (synchronously: keep it cheap)."""
        self._fanout.watch(prefix, callback)

    def read(self, prefix: str) -> dict[str, dict[str, bytes]]:
        """``{node id: {key: value}}`` of the live keys under ``prefix`` of every usable node (this one included)."""
        items = self.state.live_items(prefix)
        return {node_id: kv for node_id, kv in items.items() if self._roster.usable(node_id)}

    # ------------------------------------------------------------------------------------------------- queries

    def members(self) -> list[Member]:
        """Every known member (this node included), sorted by node id."""
        return self._roster.members()

    def usable_ids(self) -> list[str]:
        """The ids of the usable members (alive or suspect), sorted: this node included unless it withdrew (its peers
        see it as left: a plan placing keys on it, say, would send them where nobody routes)."""
        ids = self._roster.usable_ids()
        if self.withdrawn:
            ids = [node_id for node_id in ids if node_id != self.self_id]
        return ids

    @property
    def withdrawn(self) -> bool:
        """Whether this node withdrew from routing (``withdraw``)."""
        return self.state.self_node.get(STATUS_KEY) == LEFT_STATUS

    def watch_liveness(self, callback: LivenessWatcher) -> None:
        """Call ``callback(transition)`` on every liveness change of a member (alive, suspect, dead, left,
        forgotten), synchronously: keep it cheap. The node cancels calls forwarded to a peer turning suspect."""
        self._liveness.watch(callback)

    def trusted(self, node_id: str) -> bool:
        """Alive (not suspect) and reachable (it answered a message of ours at its address): a peer to send requests
        to first."""
        return self._roster.trusted(node_id)

    def generation_of(self, node_id: str) -> int:
        """The generation (life) of ``node_id`` this node knows -- what a message to it is sealed for -- or 0."""
        return self._roster.generation_of(node_id)

    def check_sender(self, sender_id: str, address: str, generation: int) -> None:
        """Refuse (raise Rejected ``identity_conflict``) a sender claiming a node id whose known life says it is
        another process: a new life at another address while the known one is alive, the same life at another
        address, or an earlier life (admission.py, rule 3). The forwarded-request service asks too."""
        self._admission.check_sender(sender_id, address, generation)

    # ------------------------------------------------------------------------------------------------ messages

    def handle(
        self, data: bytes, reply_from: str | None = None, peer_names: frozenset[str] | None = None
    ) -> bytes | None:
        """Process one inbound message; returns the reply envelope, or None. Raises Rejected when refused (inbound.py).

        ``reply_from``: the address this node sent the message this one answers to (a reply on our own call: its
        sender, at that address, is reachable); None for a message a peer started. ``peer_names``: the names in the
        caller's certificate (mTLS), which must name the sender (auth.py); None when the transport does not say.
        """
        self.stats.messages_received += 1
        self.stats.bytes_received += len(data)
        envelope, message = self._inbound.open(data, peer_names)
        if not self.running:
            return None
        return self._inbound.answer(envelope, message, reply_from)

    # -------------------------------------------------------------------------------------------------- rounds

    def _round(self) -> None:
        if not self.running:
            return
        if self._round_due is not None:
            self._fired(self._round_due)
        try:
            self._do_round()
        except Exception:
            log.exception("gossip round failed")
            self.stats.internal_errors += 1
        if self.running:
            self._round_due = self.clock.now() + self.config.interval_s
            self._timer = self.clock.call_later(self.config.interval_s, self._round)

    def _fired(self, due: float) -> None:
        """A timer of ours due at ``due`` fires now: late, this node's loop was held up (a flood of messages to open,
        a pause) and its peers' heartbeats waited unread meanwhile, which is not their silence (failure_detector.py).
        The stall is counted once (the part not covered by a stall counted before: the round's timer and a Syn's
        both fire late after one pause), before any judgement, and discounted from the silences judged next."""
        now = self.clock.now()
        stall = now - max(due, self._stalled_until)
        if stall <= 0.0:
            return
        self._stalled_until = now
        self.membership.fd.stalled(stall)
        self.stats.note_loop_lag(now - due)

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
        self._liveness.update(now)
        state.gc_tombstones(now, self.config.tombstone_grace_s)
        state.expire_forgotten(now)
        self._admission.judge_deferred(now)
        for node_id, address in self._admission.join_probes(self.config.max_join_probes):
            self._outbox.probe(address, confirm=node_id)
        targets = select_targets(self._roster.peers(), self.membership, self.seeds, self.config.fanout, self.rng)
        if targets:
            self._gossip_with(targets, now)
        self._probe_stale(now, frozenset(targets))
        self._check_alone(now)
        self._log.flush(logging.WARNING)
        self._liveness.flush()
        self.stats.rounds += 1

    def _gossip_with(self, targets: list[str], now: float) -> None:
        """Start an exchange with each target address, or probe it first when the life there is in doubt."""
        ids = self._roster.ids_by_address()
        syns = []
        for address in targets:
            node_id = ids.get(address)
            # A member not heard from lately may run another life by now (restarted under its id): a Syn sealed
            # for the life we know would be refused (wrong_generation) forever by a restarted node that has no
            # seeds to call us itself. A Hello asks which life runs there; the HelloAck is answered with a Syn
            # sealed for that life.
            if node_id is None or self.membership.state(node_id) in (MemberState.SUSPECT, MemberState.DEAD):
                self._outbox.probe(address)
                continue
            syns.append((address, node_id))
        self._start_exchanges(syns)

    def _start_exchanges(self, targets: list[tuple[str, str]]) -> None:
        """Send a Syn to each ``(address, node id)``: with ``stagger_exchanges``, the first now and the others spread
        over the round, each with the digest of its moment -- so what the first exchange brought is not asked for
        (and sent) again by the next ones, and news moves on a third of a round later instead of a round."""
        if not targets:
            return
        if not self.config.stagger_exchanges:
            for address, node_id in targets:
                self._push.note_syn(node_id)
                self._outbox.send_to(address, node_id, encode(self._make_syn(node_id)), "syn")
            return
        spacing = self.config.interval_s / len(targets)
        self._syn(*targets[0])
        now = self.clock.now()
        for i, (address, node_id) in enumerate(targets[1:], 1):
            self.clock.call_later(i * spacing, lambda a=address, n=node_id, d=now + i * spacing: self._syn(a, n, d))

    def _syn(self, address: str, node_id: str, due: float | None = None) -> None:
        if not self.running or self.generation_of(node_id) == 0:
            return
        if due is not None:
            self._fired(due)
        try:
            # liveness is judged at every exchange, not only at the round's start: a death is declared within a
            # third of a round of phi crossing the threshold
            self._liveness.update(self.clock.now())
            if self.membership.state(node_id) is not MemberState.ALIVE:
                return
            payload = encode(self._make_syn(node_id))
            self._push.note_syn(node_id)
            self._outbox.send_to(address, node_id, payload, "syn")
        except Exception:
            log.exception("gossip: a staggered Syn failed")
            self.stats.internal_errors += 1

    def _probe_stale(self, now: float, targets: frozenset[str]) -> None:
        """Ask the members unheard here for ``stale_probe_phi`` directly (config.py), but those among this round's
        ``targets`` (addresses): a Syn of the digest shard of about one member that holds the receiver, so that its
        reply brings the receiver's newest heartbeat and state and little else."""
        config = self.config
        stale = self.membership.stale_members(now, config.stale_probe_phi, config.max_stale_probes)
        if not stale:
            return
        count = min(MAX_SHARDS, max(2, len(self.state.nodes)))
        for node_id in stale:
            address = self._roster.address_of(node_id)
            if not address or address in targets:
                continue
            syn = make_syn(self.state, (shard_of(node_id, count), count), (node_id,), config.wire_version)
            self._push.note_syn(node_id)
            self._outbox.send_to(address, node_id, encode(syn), "syn")
            self.stats.stale_probes += 1

    def _make_syn(self, receiver: str) -> Syn:
        """A Syn for ``receiver``: the whole digest, or in a mesh of more than ``digest_max_members`` the next shard
        in turn (digest.py), so that this node's Syns name every member once every shards / fanout rounds; and,
        whatever their shard, the receiver, the declarers of the verdicts held here, the members new here lately
        and those heard longest ago (``digest_stalest_members``)."""
        shards = digest_shards(len(self.state.nodes), self.config.digest_max_members)
        if shards == 1:
            return make_syn(self.state, version=self.config.wire_version)
        self._syns_made += 1
        stalest = self.membership.stalest(self.config.digest_stalest_members)
        named = {receiver, *self._liveness.recent(), *stalest}
        return make_syn(self.state, (self._syns_made % shards, shards), named, self.config.wire_version)

    def rounds_per_update(self, updates_per_s: float) -> int:
        """Rounds between two updates of a value every member publishes (its load) so that a node hears at most
        ``updates_per_s`` of them a second from the whole mesh (0: every round)."""
        if updates_per_s <= 0:
            return 1
        return max(1, math.ceil(len(self.state.nodes) / (updates_per_s * self.config.interval_s)))

    # ---------------------------------------------------------------------------------------- this node's own id

    def _refused_as_conflict(self, address: str, details: str) -> None:
        """A peer refused our message as an identity conflict; when it says a later life holds our id, we are
        superseded (the other cause -- an earlier life of ours still alive elsewhere -- is the transport's warning)."""
        found = _LATER_LIFE.search(details)
        if found is not None:
            self._superseded(int(found.group(1)), found.group(2), address)

    def _superseded(self, generation: int, address: str | None, heard_from: str) -> None:
        """A later life of this node's id runs elsewhere (module docstring): say so, and reclaim the id when each
        node's certificate names its own."""
        if not self.running or generation <= self.generation:
            return
        self.stats.superseded += 1
        forged = generation > self.clock.wall_ms() + self._max_reclaim_ahead_ms
        if address == self.address and not forged:
            # The later life ran at this very address: an earlier process of this node whose clock was ahead of this
            # one's (the wall clock stepped back, or a restart on a host whose clock is behind). Peers would refuse
            # this process until they forgot that life (~10 min); a life above it ends that at once.
            self._superseded_log.warning(
                "superseded",
                "gossip: %s restarted below its earlier life at %s (generation %d, this one %d: the wall clock is "
                "behind the earlier process's); starting a new life above it",
                self.self_id, self.address, generation, self.generation,
            )
            self._reclaim(generation)
            return
        certified = self.config.certified_ids and not forged
        self._superseded_log.log(
            logging.ERROR, "superseded",
            "gossip: another process runs as %s: generation %d%s (heard from %s) is a later life than this one's "
            "(%d at %s), and this process did not start it. Peers follow it and refuse this one: %s",
            self.self_id, generation, f" at {address[:64]}" if address else "", heard_from[:64], self.generation,
            self.address,
            "reclaiming the id with a new life its certificate vouches for" if certified else
            "not reclaimed: a life started that far in the future was made up, and a generation above it would keep "
            "every later restart of this node below it (stop the process spreading it)" if forged else
            "stop one of the two; with a shared cluster secret any holder can take a node id once it is seen dead "
            "(per-node certificates prevent it)",
        )
        if certified:
            self._reclaim(generation)

    def _reclaim(self, generation: int) -> None:
        """A new life above ``generation``, at most once per ``RECLAIM_INTERVAL_S`` (two processes that both hold the
        id would otherwise outbid each other every round)."""
        now = self.clock.now()
        if self._reclaimed_at is None or now - self._reclaimed_at >= RECLAIM_INTERVAL_S:
            self._reclaimed_at = now
            self._new_life(max(self.clock.wall_ms(), generation + 1))

    def _new_life(self, generation: int) -> None:
        """Run on as a new life of this node (``generation``), its state kept: peers reset their copy of it."""
        log.warning("gossip: %s starts a new life, generation %d (was %d), to reclaim its id", self.self_id,
                    generation, self.generation)
        self.stats.reclaims += 1
        self.generation = generation
        self.state.self_node.generation = generation
        self.auth.sender_generation = generation
        self._push.new_life(generation)

    def _check_alone(self, now: float) -> None:
        """Warn (once a minute at most) when this node has seeds but has had no live peer for a while."""
        if not self.seeds or any(state.usable for _, _, state in self._roster.peers()):
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


#: How a peer's identity-conflict refusal names the later life holding our id (``admission.judge_claim``'s words).
_LATER_LIFE = re.compile(r"runs a later life \((\d{1,20})\) at (\S+)")  # a 64-bit generation: at most 20 digits
#: Seconds between two reclaims of this node's id (two processes holding its certificate would otherwise take turns
#: starting new lives as fast as gossip goes).
RECLAIM_INTERVAL_S = 60.0


def _authenticator(config: GossipConfig, self_id: str, address: str, generation: int, clock: Clock) -> Authenticator:
    """What seals this node's messages and opens its peers' (auth.py)."""
    return Authenticator(
        cluster_id=config.cluster_id,
        secret=config.cluster_secret,
        sender_id=self_id,
        sender_address=address,
        sender_generation=generation,
        wall_ms=clock.wall_ms,
        replay_window_s=config.replay_window_s,
        max_seen_nonces=config.max_seen_nonces,
        max_receive_bytes=config.max_receive_bytes,
    )
