"""The ingress router: turns one request into a ranked list of nodes, by calling a pure policy.

The router owns the only routing state a node keeps between gossip updates:
- requests this ingress has sent to each peer and not yet seen finish (so a burst doesn't herd onto one node
  before the peer's gossiped load reflects it); only those sent after the peer's current load value arrived count;
- the speculative index (``speculative.py``): a prefix just routed to a peer is assumed cached there for a TTL.

Everything else comes from the ClusterView (gossip) and, for this node itself, from the exact local index and the
engine's live load. The decision itself is the policy's: the node and the simulator call the same functions.

Cost per request (the decision budget is ~100 us at 64 peers and 4k tokens): hashing the prompt's blocks, one
inverted-index walk for every peer's estimate (``ClusterView.estimate_matches``), one for the speculative index,
and a snapshot only for the peers the request *touches* (a match, sends in flight from here); every other peer's
snapshot is shared between requests and rebuilt at most every ``SNAPSHOT_REFRESH_S``. The policies in
``SPARSE_POLICIES`` (the default among them) are handed only the touched peers, this node, the peers drawn at
random for the request (``RouteRequest.sampled``), the key's plan destinations and the ``LEAST_LOADED_CANDIDATES``
least-loaded others -- enough for their choice (see
``policies/__init__.py``) -- and the router completes the retry order with the remaining alive peers by load.
"""

from __future__ import annotations

import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.engine.base import EngineLoad
from p2pnode.routing.policies import DEFAULT_POLICY, SPARSE_POLICIES, get_policy, p2p
from p2pnode.routing.policies.types import Decision, PeerSnapshot, RouteRequest, sample_peers
from p2pnode.routing.speculative import SpeculativeIndex

#: Longest the router reuses its per-peer snapshots (seconds) when the ClusterView reports no change
#: (``ClusterView.version``: liveness, load, address): the info ages and gossiped cache sizes in them drift
#: meanwhile, and no policy decides on those. A change rebuilds them at the next request.
SNAPSHOT_REFRESH_S = 1.0
#: Untouched peers handed to a sparse policy besides the touched ones: the least loaded, ties spread by the request's
#: tiebreak. The target needs one; the rest give the retry order (``max_attempts`` 3) real alternatives.
LEAST_LOADED_CANDIDATES = 4
#: Peers with an estimate beyond which a sparse policy is handed only the undominated ones (``Router._undominated``):
#: below it, pruning costs about what it saves.
PRUNE_ABOVE = 16
#: Most distinct (peer, estimate, in-flight) snapshots kept between two table rebuilds (a bound, rarely reached).
MAX_SNAPSHOT_VARIANTS = 4096
#: Leading blocks of the prompt that name a request's routing key when the client gives none: a shared system
#: prompt or document prefix is what should stick together.
DEFAULT_ROUTING_KEY_BLOCKS = 4


class PeerLoad(Protocol):
    running: int
    waiting: int
    kv_usage: float


class PeerInfo(Protocol):
    """What the router reads about one peer (ClusterView's PeerView)."""

    node_id: str
    address: str
    hashes: set[int]

    @property
    def usable(self) -> bool: ...

    @property
    def load(self) -> PeerLoad | None: ...

    @property
    def info_age_s(self) -> float: ...

    @property
    def stride(self) -> int | None: ...


class PeerDirectory(Protocol):
    """The part of the ClusterView (p2pnode/gossip/cluster_view.py) the router uses."""

    #: Moves whenever a peer's liveness, load or address changes (absent: the router rebuilds on time only).
    version: int

    def peers(self) -> Sequence[PeerInfo]: ...

    def estimate_matches(self, block_hashes: Sequence[int]) -> dict[str, int]: ...


@dataclass
class RoutingCounters:
    decisions: int = 0
    local: int = 0
    forwarded: int = 0
    retries: int = 0
    #: Sum over served requests of |estimated match - engine-reported cached tokens|, and of each alone.
    estimate_abs_error_tokens: int = 0
    estimated_tokens: int = 0
    actual_cached_tokens: int = 0
    served: int = 0
    by_policy: dict[str, int] = field(default_factory=lambda: defaultdict(int))


@dataclass(frozen=True, slots=True)
class Route:
    """A routing decision plus what the ingress needs to forward and account for it."""

    decision: Decision
    block_hashes: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int
    routing_key: str
    block_size: int
    addresses: dict[str, str]
    estimates: dict[str, int]  # node id -> estimated match in blocks; absent: 0

    def estimated_tokens(self, node_id: str) -> int:
        """The estimate in tokens, capped like the engine's hit (never the last prompt token)."""
        usable = (self.prompt_tokens - 1) // self.block_size
        return min(self.estimates.get(node_id, 0), usable) * self.block_size


def derive_routing_key(hashes: Sequence[int], key_blocks: int = DEFAULT_ROUTING_KEY_BLOCKS) -> str:
    """The prompt's leading blocks name its key: requests sharing them share a key."""
    if not hashes:
        return "empty"
    return f"prefix:{hashes[min(key_blocks, len(hashes)) - 1]:016x}"


@dataclass(slots=True)
class _PeerTable:
    """Every peer as of its last report, shared by all requests until the next rebuild (``SNAPSHOT_REFRESH_S``).

    Invariants: ``alive_by_load`` holds the alive bases ordered by (load, node id); ``load_runs`` are its maximal
    runs of equal load as [start, end) pairs; ``variants`` only holds snapshots derived from these bases.
    """

    built_at: float
    version: int  # the directory's version it was built from
    bases: list[PeerSnapshot]  # every known peer but this node, no estimate, nothing in flight
    by_id: dict[str, PeerSnapshot]
    alive_by_load: list[PeerSnapshot]
    alive_ids: tuple[str, ...]  # node ids of alive_by_load, in its order
    alive_set: frozenset[str]  # the same ids, for set comparisons
    ids_by_id: tuple[str, ...]  # the same ids sorted: the population ``sample_peers`` draws from
    load_runs: list[tuple[int, int]]
    addresses: dict[str, str]
    reported_at: dict[str, float]  # node id -> when its current load arrived (this router's clock)
    #: The Pareto front of the alive peers in (load, waiting), lower being better: each point's peers (a tie),
    #: in load order. A peer off the front is beaten on both by one on it (``Router._undominated`` uses this).
    front: list[list[str]] = field(default_factory=list)
    variants: dict[tuple[str, int, int], PeerSnapshot] = field(default_factory=dict)

    def variant(self, base: PeerSnapshot, estimate: int, in_flight: int) -> PeerSnapshot:
        """``base`` with this estimate and in-flight count (snapshots are immutable, so they are reused)."""
        key = (base.node_id, estimate, in_flight)
        snap = self.variants.get(key)
        if snap is None:
            if len(self.variants) >= MAX_SNAPSHOT_VARIANTS:
                self.variants.clear()
            snap = self.variants[key] = PeerSnapshot(  # positional: dataclasses.replace costs 4x more
                base.node_id, False, base.alive, estimate, base.running, base.waiting, base.kv_usage, in_flight,
                base.info_age_s, None, None, base.cached_blocks,
            )
        return snap

    def least_loaded(self, exclude: dict[str, PeerSnapshot], tiebreak: int, count: int) -> list[PeerSnapshot]:
        """Up to ``count`` alive peers not in ``exclude``, least loaded first; a run of equal loads is entered at
        an offset chosen by ``tiebreak``, so ties spread over the whole run as the policy's own rotation would."""
        out: list[PeerSnapshot] = []
        if count <= 0 or len(exclude) >= len(self.alive_by_load) + 1:  # +1: exclude may hold one dead peer
            return out
        for peer in self.by_load(tiebreak):
            if peer.node_id not in exclude:
                out.append(peer)
                if len(out) == count:
                    return out
        return out

    def by_load(self, tiebreak: int) -> Iterator[PeerSnapshot]:
        """The alive peers, least loaded first; each run of equal loads entered at an offset set by ``tiebreak``."""
        alive = self.alive_by_load
        for start, end in self.load_runs:
            size = end - start
            offset = tiebreak % size
            for i in range(size):
                yield alive[start + (offset + i) % size]


class Router:
    """Ranks nodes for each request with ``policy``; tracks in-flight sends and speculative placements."""

    def __init__(
        self,
        self_id: str,
        self_address: str,
        index: PrefixIndex,
        engine_load: Callable[[], EngineLoad],
        directory: PeerDirectory | None,
        policy: str = DEFAULT_POLICY,
        *,
        routing_key_blocks: int = DEFAULT_ROUTING_KEY_BLOCKS,
        speculative: SpeculativeIndex | None = None,
        clock: Callable[[], float] = time.monotonic,
        sparse: bool | None = None,
    ) -> None:
        self.self_id = self_id
        self.self_address = self_address
        self.index = index
        self.engine_load = engine_load
        self.directory = directory
        self.policy_name = policy
        self.policy = get_policy(policy)
        #: Hand the policy only the candidates that can matter (see the module docstring); None: when it allows.
        self.sparse = policy in SPARSE_POLICIES if sparse is None else sparse
        self.routing_key_blocks = routing_key_blocks
        self.speculative = speculative or SpeculativeIndex()
        self.clock = clock
        self.counters = RoutingCounters()
        self._in_flight: dict[str, dict[int, float]] = defaultdict(dict)  # peer -> ticket -> sent at
        self._tickets = 0
        self._table: _PeerTable | None = None
        #: The CacheRoute plan in force (set by plan_sync when gossip delivers a newer one); policies get it.
        self.plan: object | None = None
        #: Called with every routing decision (the rate sketch counts requests per key there).
        self.on_routed: Callable[[Route], None] | None = None

    # --- deciding -----------------------------------------------------------------------------------------

    def _peer_table(self, now: float) -> _PeerTable:
        """The shared per-peer snapshots, rebuilt when the directory reports a change (a few times a second per
        mesh at most, while requests may arrive thousands of times a second) or after ``SNAPSHOT_REFRESH_S``."""
        table = self._table
        version = getattr(self.directory, "version", -1)
        if table is not None and table.version == version and now - table.built_at < SNAPSHOT_REFRESH_S:
            return table
        bases: list[PeerSnapshot] = []
        addresses = {self.self_id: self.self_address}
        views = []
        for peer in self.directory.peers() if self.directory is not None else ():
            if peer.node_id == self.self_id:
                continue
            views.append(peer)
            load = peer.load
            addresses[peer.node_id] = peer.address
            bases.append(
                PeerSnapshot(
                    node_id=peer.node_id,
                    is_self=False,
                    # A peer is a candidate once gossip has told us where it is and how loaded it is.
                    alive=peer.usable and load is not None and bool(peer.address),
                    est_match_blocks=0,
                    running=load.running if load is not None else 0,
                    waiting=load.waiting if load is not None else 0,
                    kv_usage=load.kv_usage if load is not None else 0.0,
                    in_flight=0,
                    info_age_s=peer.info_age_s,
                    cached_blocks=len(peer.hashes) * (peer.stride or 1),
                )
            )
        alive = sorted((b for b in bases if b.alive), key=lambda b: (b.load, b.node_id))
        # Sends since the peer's load arrived are not in it; without a load time, since it was last heard from.
        reported_at = {
            b.node_id: now - getattr(peer, "load_age_s", b.info_age_s) for b, peer in zip(bases, views, strict=True)
        }
        runs: list[tuple[int, int]] = []
        start = 0
        for i in range(1, len(alive) + 1):
            if i == len(alive) or alive[i].load != alive[start].load:
                runs.append((start, i))
                start = i
        front: list[list[str]] = []
        best: tuple[int, int] | None = None
        for b in alive:  # in load order
            if best is None or b.waiting < best[1]:
                best = (b.load, b.waiting)
                front.append([b.node_id])
            elif (b.load, b.waiting) == best:
                front[-1].append(b.node_id)
        self._table = _PeerTable(
            now,
            version,
            bases,
            {b.node_id: b for b in bases},
            alive,
            tuple(b.node_id for b in alive),
            frozenset(b.node_id for b in alive),
            tuple(sorted(b.node_id for b in alive)),
            runs,
            addresses,
            reported_at,
            front,
        )
        return self._table

    def _undominated(self, table: _PeerTable, estimates: dict[str, int], tiebreak: int) -> dict[str, int]:
        """The estimates of the peers a sparse policy could still choose when many peers match (a prompt cached
        mesh-wide): the Pareto front of (longer estimate, lower load, shorter queue) -- up to
        ``LEAST_LOADED_CANDIDATES`` peers of a tie, entered at a tiebreak offset -- plus every peer with sends in
        flight from here (its load is not the table's).

        Why this loses no choice: ``p2p``'s guard admits more with a longer match, a lower load (the overload test)
        and fewer waiting requests (the backlog test; the router leaves ``prefill_backlog_tokens`` unset), and its
        order prefers a longer match, then a lower load; ``flat`` only looks at load. A peer beaten on all three is
        chosen only when the peer beating it would be chosen too.
        """
        kept = {node_id: estimates[node_id] for node_id in self._in_flight if node_id in estimates}
        if len(estimates) >= len(table.alive_ids) and estimates.keys() >= table.alive_set:
            # Every peer matches (a prompt cached mesh-wide): each one's estimate is at least the least of them,
            # so a peer at that floor is beaten on all three by whoever beats it on (load, waiting), and only the
            # table's precomputed front of those (ties capped) and the deeper peers need to stay.
            floor = min(estimates.values())
            kept.update({node_id: m for node_id, m in estimates.items() if m > floor})
            for tie in table.front:
                offset = tiebreak % len(tie)
                for i in range(min(len(tie), LEAST_LOADED_CANDIDATES)):
                    node_id = tie[(offset + i) % len(tie)]
                    kept[node_id] = estimates[node_id]
            if len(kept) <= PRUNE_ABOVE:
                return kept
            estimates, kept = kept, {node_id: m for node_id, m in kept.items() if node_id in self._in_flight}
        front: list[list[int]] = []  # [estimate, waiting, load, peers kept at this point], in load order
        for base in table.by_load(tiebreak):
            node_id = base.node_id
            m = estimates.get(node_id)
            if m is None or node_id in kept:
                continue
            waiting, load = base.waiting, base.load
            for point in front:
                if point[0] >= m and point[1] <= waiting:  # as good or better on all three (load: earlier)
                    if point[:3] == [m, waiting, load] and point[3] < LEAST_LOADED_CANDIDATES:
                        point[3] += 1  # a tie: a few are kept, so that ties still spread
                        kept[node_id] = m
                    break
            else:
                front.append([m, waiting, load, 1])
                kept[node_id] = m
        return kept

    def _in_flight_since(self, peer: str, since: float) -> int:
        return sum(1 for sent_at in self._in_flight.get(peer, {}).values() if sent_at >= since)

    def route(self, tokens: Sequence[int], routing_key: str, max_tokens: int, request_id: str) -> Route:
        now = self.clock()
        bs = self.index.block_size
        hashes = tuple(block_hashes(tokens, bs))
        local = self.engine_load()
        me = PeerSnapshot(
            node_id=self.self_id,
            is_self=True,
            alive=local.healthy,
            est_match_blocks=self.index.match_blocks(hashes),
            running=local.running,
            waiting=local.waiting,
            kv_usage=local.kv_usage,
            in_flight=0,  # the engine's own counts are live for this node
            info_age_s=0.0,
            cached_blocks=len(self.index),
        )
        table = self._peer_table(now)
        by_id, reported_at = table.by_id, table.reported_at
        # The touched peers: a gossiped or speculative estimate, or sends in flight from here since their report.
        estimates = self.directory.estimate_matches(hashes) if self.directory is not None else {}
        for node_id, blocks in self.speculative.match_all(hashes, now).items():
            if blocks > estimates.get(node_id, 0):
                estimates[node_id] = blocks
        tiebreak = zlib.crc32(request_id.encode()) | (self._tickets << 32)
        every_estimate = estimates
        if self.sparse and len(estimates) > PRUNE_ABOVE:
            estimates = self._undominated(table, estimates, tiebreak)
        touched: dict[str, PeerSnapshot] = {}
        for node_id, blocks in estimates.items():
            base = by_id.get(node_id)
            if base is not None and base.alive:
                in_flight = self._in_flight_since(node_id, reported_at[node_id]) if node_id in self._in_flight else 0
                touched[node_id] = table.variant(base, blocks, in_flight)
        for node_id in self._in_flight:
            base = by_id.get(node_id)
            if base is not None and node_id not in touched:
                in_flight = self._in_flight_since(node_id, reported_at[node_id])
                if in_flight:
                    touched[node_id] = table.variant(base, 0, in_flight)
        routing_key = routing_key or derive_routing_key(hashes, self.routing_key_blocks)
        request = RouteRequest(
            block_hashes=hashes,
            prompt_tokens=len(tokens),
            max_tokens=max_tokens,
            routing_key=routing_key,
            block_size=bs,
            tiebreak=tiebreak,
            sampled=sample_peers(table.ids_by_id, tiebreak, p2p.CHOICES),
        )
        if self.sparse:
            chosen = dict(touched)
            planned = getattr(self.plan, "destinations", None)
            for node_id in (*request.sampled, *(planned(routing_key) if planned is not None else ())):
                base = by_id.get(node_id)
                if base is not None and node_id not in chosen:  # with its estimate, even if pruning dropped it
                    chosen[node_id] = table.variant(base, every_estimate.get(node_id, 0), 0) if base.alive else base
            candidates = [me, *chosen.values(), *table.least_loaded(chosen, tiebreak, LEAST_LOADED_CANDIDATES)]
            decision = self.policy(request, candidates, self.plan)
            # The retry order goes on with every other alive peer, by reported load.
            ranked, alive_ids = decision.ranked, table.alive_ids
            if len(ranked) <= 16:
                rest = list(alive_ids)
                for node_id in ranked:
                    if node_id != self.self_id:
                        rest.remove(node_id)  # a C-speed scan per candidate: cheaper than a Python pass per peer
            else:
                seen = set(ranked)
                rest = [node_id for node_id in alive_ids if node_id not in seen]
            if rest:
                decision = Decision(
                    decision.ranked + tuple(rest), decision.policy, decision.est_match_blocks, decision.reason
                )
        else:
            snapshots = [me, *(touched.get(b.node_id, b) for b in table.bases)]
            decision = self.policy(request, snapshots, self.plan)
        self.counters.decisions += 1
        self.counters.by_policy[decision.policy] += 1
        route_estimates = dict(every_estimate)  # every peer's, pruned or not (a C-level copy)
        route_estimates[self.self_id] = me.est_match_blocks
        route = Route(
            decision=decision,
            block_hashes=hashes,
            prompt_tokens=len(tokens),
            max_tokens=max_tokens,
            routing_key=routing_key,
            block_size=bs,
            addresses=table.addresses,
            estimates=route_estimates,
        )
        if self.on_routed is not None:
            self.on_routed(route)
        return route

    # --- accounting ---------------------------------------------------------------------------------------

    def begin(self, route: Route, target: str) -> int:
        """The request is being sent to ``target``; returns a ticket for ``end``."""
        self._tickets += 1
        now = self.clock()
        if target == self.self_id:
            self.counters.local += 1
        else:
            self.counters.forwarded += 1
            self._in_flight[target][self._tickets] = now
            self.speculative.record(target, route.block_hashes, now)
        return self._tickets

    def end(self, target: str, ticket: int) -> None:
        peers = self._in_flight.get(target)
        if peers is not None:
            peers.pop(ticket, None)
            if not peers:
                del self._in_flight[target]

    def record_outcome(self, route: Route, target: str, cached_tokens: int) -> None:
        """Account the gap between what routing expected and what the engine reported."""
        estimated = route.estimated_tokens(target)
        self.counters.served += 1
        self.counters.estimated_tokens += estimated
        self.counters.actual_cached_tokens += cached_tokens
        self.counters.estimate_abs_error_tokens += abs(estimated - cached_tokens)

    def forget_peer(self, peer: str) -> None:
        self.speculative.forget_peer(peer)
        self._in_flight.pop(peer, None)
