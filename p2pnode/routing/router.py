"""The ingress router: turns one request into a ranked list of nodes, by calling a pure policy.

Per request: hash the prompt's blocks; estimate every peer's cached prefix (the directory's gossiped estimate,
raised by the speculative index's); assemble the candidates (``candidates.py``) from this node's exact state (its
own PrefixIndex and live engine load), the shared peer table (``peer_table.py``) and the in-flight ledger
(``ledger.py``); call the policy with the plan in force. The node and the simulator both route through
``Router.route_blocks``, so the simulator predicts the node's own decisions.

The router owns the only routing state a node keeps between gossip updates: the in-flight ledger (so a burst does
not herd onto one peer before the peer's gossiped load reflects it) and the speculative index
(``speculative.py``: a prefix just routed to a peer is assumed cached there for a TTL).

A request that names reusable segments (``cache/segments.SegmentSpans``) is routed, for a policy that reads them
(``Reads.segments``: ``p2p``), by what each node would reuse of its segments (``segments.py``): every peer's from
the directory (gossiped segment keys, or its prefix summary for an exact-mode layout), this node's from its own
engine and index. Other policies, and requests without segments, route exactly as before.

KV tiers below the engines (``cache/tiers.py``): every candidate's snapshot carries the cumulative depths of the
request's prefix in its tiers -- this node's exactly (``local_tiers``), a peer's as its directory estimates them
(``estimate_tier_matches``, one walk per medium for every peer; a directory without it, or peers that publish no tier,
leave them at the engine's estimate) -- so a policy can price the blocks a node would load from its tiers
(``policies/p2p.py``). A peer whose tiers hold the prefix past its engine's estimate is touched by the request like a
holder (``candidates.py``), and the router draws holders by the deepest of the two.

Cost per request (the decision budget is ~100 us at 64 peers and 4k tokens): hashing the prompt's blocks, one
inverted-index walk for every peer's estimate (``ClusterView.estimate_matches``), one for the speculative index,
and a snapshot only for the peers the request *touches*; every other peer's snapshot is shared between requests
(``peer_table.py``).
"""

from __future__ import annotations

import functools
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.segments import SegmentReuse, SegmentSpans
from p2pnode.cache.tiers import Medium, TierDepths
from p2pnode.config import (
    DEFAULT_ADAPTER_LOAD_TOKENS,
    DEFAULT_ROUTING_KEY_BLOCKS,
    PEER_TABLE_REFRESH_S,
    RoutingConfig,
)
from p2pnode.frozen import fast_init, replace
from p2pnode.load import NO_LOAD, NodeLoad
from p2pnode.lora import NO_ADAPTERS, AdapterSet
from p2pnode.plan.plan import Plan
from p2pnode.routing.candidates import DRAW_HOLDERS_ABOVE, CandidateSet, assemble
from p2pnode.routing.directory import PeerDirectory
from p2pnode.routing.effective_load import EffectiveLoadOrder
from p2pnode.routing.estimates import LevelCuts, raised_levels
from p2pnode.routing.keys import RoutingKeys
from p2pnode.routing.ledger import InFlightLedger
from p2pnode.routing.links import LinkEstimates
from p2pnode.routing.peer_table import PeerTable, SharedBases
from p2pnode.routing.policies import DEFAULT_POLICY, get_spec
from p2pnode.routing.policies.spec import CostModel, PolicySpec
from p2pnode.routing.policies.types import (
    Decision,
    NoAliveCandidate,
    PeerSnapshot,
    Policy,
    RouteRequest,
    context_homes,
    draw_holders,
    draw_holders_by_depth,
    sample_peers,
)
from p2pnode.routing.segments import (
    SegmentPull,
    SegmentPullPrice,
    approximate_estimates,
    exact_estimates,
    segment_pulls,
)
from p2pnode.routing.speculative import SpeculativeIndex
from p2pnode.routing.split import PlanSplit

if TYPE_CHECKING:  # the request type only: routing decides on it, never builds one
    from p2pnode.request import Request

__all__ = ["DEFAULT_ROUTING_KEY_BLOCKS", "Route", "RouteQuery", "Router", "request_tiebreak"]


@dataclass
class RoutingCounters:
    decisions: int = 0
    local: int = 0
    forwarded: int = 0
    retries: int = 0
    #: Sequences continued on another node after their node failed mid-stream (``serving/migration.py``).
    migrations: int = 0
    #: Sum over served requests of |estimated match - engine-reported cached tokens|, and of each alone.
    estimate_abs_error_tokens: int = 0
    estimated_tokens: int = 0
    actual_cached_tokens: int = 0
    served: int = 0
    by_policy: dict[str, int] = field(default_factory=lambda: defaultdict(int))


@fast_init
@dataclass(frozen=True, slots=True)
class Route:
    """A routing decision plus what the ingress needs to forward and account for it.

    The routing key is derived when first read (``routing_key``) unless the policy needed it to decide: for a
    policy that ignores keys (``p2p``, ``flat``, ...) deriving it (tens of µs on a long prompt, ``keys.py``) is
    bookkeeping for the rate plan, done after the request is on its way, not part of the decision."""

    decision: Decision
    block_hashes: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int
    block_size: int
    addresses: dict[str, str]
    #: node id -> estimated match in blocks; absent: 0 (a dict, or the same mapping kept by depth where a prefix is
    #: cached mesh-wide: ``routing/estimates.py``)
    estimates: MutableMapping[str, int]
    #: The rate plan in force when routing (epoch 0: none), and the destinations it gave the request's key when the
    #: policy routes by the plan (``cacheroute``) and affinity is on -- the target is one of them unless none is
    #: alive; the final message reports them (``GenerateFinal``).
    plan_epoch: int = 0
    plan_planner: str = ""
    plan_destinations: tuple[str, ...] = ()
    #: The key, or how to derive it on first read (one slot, replaced by the key).
    _key: list[str | Callable[[], str]] = field(default_factory=list)
    #: For a request routed by its segments: every node's estimate of the segment tokens it would reuse (absent: 0),
    #: which replaces the prefix estimate in ``estimated_tokens``; None otherwise.
    segment_estimates: dict[str, int] | None = None
    #: The nodes whose KV tiers hold the prefix past their engine's estimate, with the deepest such depth in blocks
    #: (what they would reuse loading from their tiers); None: none.
    tier_depths: dict[str, int] | None = None

    @property
    def routing_key(self) -> str:
        key = self._key[0]
        if not isinstance(key, str):
            key = self._key[0] = key()
        return key

    def estimated_tokens(self, node_id: str) -> int:
        """The estimate in tokens, capped like the engine's hit (never the last prompt token); a node told to pull
        the prefix is expected to hold it, and one whose tiers hold it to load it."""
        if self.segment_estimates is not None:
            return min(self.segment_estimates.get(node_id, 0), self.prompt_tokens - 1)
        usable = (self.prompt_tokens - 1) // self.block_size
        blocks = self.estimates.get(node_id, 0)
        if self.tier_depths is not None:
            blocks = max(blocks, self.tier_depths.get(node_id, 0))
        pull = self.decision.pull
        if pull is not None and pull.target == node_id:
            blocks = max(blocks, pull.blocks)
        return min(blocks, usable) * self.block_size


@fast_init
@dataclass(frozen=True, slots=True)
class RouteQuery:
    """What routing needs of a request: its prompt's block hashes (in its namespace) and sizes, its key and id, its
    adapter, and its segments with the prompt's tokens (an exact-mode estimate lays them out). ``Router.route``
    derives it from a ``Request``; the simulator builds it from its block chains."""

    hashes: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int
    routing_key: str
    request_id: str
    adapter: str = ""
    segments: SegmentSpans | None = None
    tokens: Sequence[int] | None = None
    #: False for a prompt outside the default namespace: its KV never moves (``RouteRequest.kv_movable``).
    kv_movable: bool = True
    #: The request's scheduling priority (vLLM's: lower first, 0 the default). Better than the default, it is routed
    #: by the part of each node's queue it would wait behind (``NodeLoad.urgent``): it skips the rest there.
    priority: int = 0


#: Every peer's positive estimate grouped by depth, deepest first: ``(depth, node ids)``, one per depth
#: (``ClusterView.estimate_levels``).
Levels = list[tuple[int, tuple[str, ...]]]


def common_match(
    estimates: dict[str, int], own: int, nodes: int, levels: Levels | None = None, self_id: str = ""
) -> int:
    """The deepest match a majority of ``nodes`` hold (``RouteRequest.common_match_blocks``), from every peer's
    estimate and this node's own match; with the estimates' ``levels``, by counting down the depths instead of
    sorting every peer's. This node counts once, by ``own``: its own gossiped estimate (``self_id``'s, which a
    node's directory holds beside its peers') is left out -- counted twice, a prefix only it held read as held
    mesh-wide in a mesh of 2 or 3, and ``p2p`` sent the request away from it."""
    need = nodes // 2 + 1
    if len(estimates) - (self_id in estimates) + (own > 0) < need:
        return 0
    if levels is not None:
        held = 0
        for depth, ids in levels:
            if own >= depth and own:  # this node holds it as deep: it counts first
                held += 1
                if held >= need:
                    return own
                own = 0
            held += len(ids) - (self_id in ids)
            if held >= need:
                return depth
        return own
    depths = [v for node_id, v in estimates.items() if node_id != self_id]
    depths.append(own)
    depths.sort()
    return depths[-need]


def _tier_depths(me: PeerSnapshot, tiers: dict[str, tuple[int, int]]) -> dict[str, int] | None:
    """``Route.tier_depths``: every node's deepest tier depth past its engine's estimate, this one's included."""
    if not tiers and me.est_disk_blocks <= me.est_match_blocks:
        return None
    out = {node_id: disk for node_id, (_, disk) in tiers.items()}
    if me.est_disk_blocks > me.est_match_blocks:
        out[me.node_id] = me.est_disk_blocks
    return out


def _urgent(candidates: CandidateSet) -> CandidateSet:
    """The candidates as a request of better than the default priority sees them: each node's queue only as far as
    it would wait behind it there (``NodeLoad.urgent``)."""
    return replace(candidates, snapshots=[replace(s, load=s.load.urgent()) for s in candidates.snapshots])


def request_tiebreak(request_id: str, ticket: int) -> int:
    """A request's 64-bit tiebreak: its id's CRC in the low half, the ingress's ticket count in the high half (so
    a repeated id still draws afresh)."""
    return zlib.crc32(request_id.encode()) | (ticket << 32)


class Router:
    """Ranks nodes for each request with ``policy``; tracks in-flight sends and speculative placements.

    ``policy``: the policy's spec (or its name, ``get_spec``); what the router prepares for a request -- sparse
    candidates, a routing key, homes, the holders it draws -- is what the spec says the policy reads (``spec.reads``).
    ``speculative`` None: no speculative index. ``kv_layout``: this node's KV layout fingerprint ("": it takes part in
    no KV transfer); ``links``: the link figure of pulls from each peer (None: no pulls). ``local_segments(key)``:
    whether this node's engine holds segment ``key`` in its store (None: it keeps none); ``bos_token_id``: the token
    an exact-mode layout keeps first; ``segment_slack_blocks``: how far under a chain it holds whole a peer's summary
    may estimate it (its stride - 1; ``segments.py``); ``segment_pull_price``: what a segment pull is priced with
    (None: this node pulls no segments; ``segment_pulls``). ``local_tiers(hashes, gpu)``: this node's tier depths of
    a prompt's block hashes whose first ``gpu`` blocks its engine holds (None: it has no tier; module docstring).
    ``shared_bases``: the peer bases of every router that reads this same directory (the simulator's; ``PeerTable``).
    """

    def __init__(
        self,
        self_id: str,
        self_address: str,
        index: PrefixIndex,
        local_load: Callable[[], NodeLoad | None],
        directory: PeerDirectory | None,
        policy: PolicySpec | str = DEFAULT_POLICY,
        *,
        routing_key_blocks: int = DEFAULT_ROUTING_KEY_BLOCKS,
        speculative: SpeculativeIndex | None = None,
        clock: Callable[[], float] = time.monotonic,
        refresh_s: float = PEER_TABLE_REFRESH_S,
        kv_layout: str = "",
        links: LinkEstimates | None = None,
        local_segments: Callable[[int], bool] | None = None,
        bos_token_id: int | None = None,
        segment_slack_blocks: int = 0,
        segment_pull_price: SegmentPullPrice | None = None,
        local_adapters: Callable[[], AdapterSet] = lambda: NO_ADAPTERS,
        on_routed: Callable[[Route], None] | None = None,
        local_tiers: Callable[[Sequence[int], int], TierDepths] | None = None,
        shared_bases: SharedBases | None = None,
    ) -> None:
        self.self_id = self_id
        self.self_address = self_address
        self.index = index
        #: This node's live load; None while its engine cannot serve (this node is then no candidate).
        self.local_load = local_load
        self.directory = directory
        self._prepare_for(get_spec(policy) if isinstance(policy, str) else policy)
        #: Keys for requests whose client gives none (``keys.py``); derived before deciding only for a policy that
        #: reads them, otherwise when the route's key is first read.
        self.keys = RoutingKeys(routing_key_blocks)
        self.speculative = speculative
        #: Mesh-wide levels cut of the peers the speculative index raised (``estimates.raised_levels``), remembered.
        self._level_cuts = LevelCuts()
        self.clock = clock
        self.refresh_s = refresh_s
        self.counters = RoutingCounters()
        self.ledger = InFlightLedger()
        #: This ingress's split of each warm key over its destinations (``split.py``).
        self.split = PlanSplit()
        #: This node's KV layout and every holder's link figure: what a KV pull is priced with (``links.py``).
        self.kv_layout = kv_layout
        self.links = links
        self._links_version = links.version if links is not None else 0
        #: Bases shared with the other routers that read this directory (``peer_table.SharedBases``): taken only when
        #: this router's hold nothing of its own (no link figure, no served rates).
        shareable = shared_bases is not None and links is None and not self.reads_served_rates
        self.table = PeerTable(
            self_id, self_address, links.get if links is not None else None, served_rates=self.reads_served_rates,
            shared=shared_bases if shareable else None,
        )
        self.local_segments = local_segments
        self.bos_token_id = bos_token_id
        self.segment_slack_blocks = segment_slack_blocks
        #: Segment pulls, as the serving node (``segment_pulls``): only with links, and for a policy that routes by
        #: segments (the baselines never pull).
        self.segment_pull_price = segment_pull_price if links is not None and self.reads_segments else None
        #: The CacheRoute plan in force (set by plan sync when gossip delivers a newer one); policies get it.
        self.plan: Plan | None = None
        #: Called with every routing decision (the rate sketch counts requests per key there).
        self.on_routed = on_routed
        #: This node's LoRA adapters (its engine's; none by default), and what routing charges a node that likely
        #: must load a request's adapter first.
        self.local_adapters = local_adapters
        self.adapter_load_tokens = DEFAULT_ADAPTER_LOAD_TOKENS
        #: This node's KV tiers' depths of a prompt (None: it has none), and the directory's estimates of its peers'.
        self.local_tiers = local_tiers
        self._estimate_tiers: Callable[[Sequence[int], Medium], dict[str, int]] | None = getattr(
            directory, "estimate_tier_matches", None
        )
        # a directory that says whether any peer publishes a tier (``ClusterView.tiers_published``), else None
        self._tiers_of = directory if hasattr(directory, "tiers_published") else None
        self._estimate_levels: Callable[[Sequence[int]], tuple[dict[str, int], Levels]] | None = getattr(
            directory, "estimate_levels", None
        )

    def _prepare_for(self, spec: PolicySpec) -> None:
        """Takes ``spec``'s policy, and what the router prepares for each request from what it reads (``spec.reads``):
        the attributes ``route_blocks`` reads, set once here so that a decision reads no spec."""
        reads = spec.reads
        self.spec = spec
        self.policy_name = spec.name
        self.policy: Policy = spec
        #: Hand the policy only the candidates that can matter, plus this many least-loaded others (``candidates.py``).
        self.sparse = reads.sparse
        self.least_loaded = reads.least_loaded
        #: Random peers drawn for each request (``RouteRequest.sampled``).
        self.sampled = reads.sampled
        #: With many holders the router draws this many of the policy's (``types.draw_holders``; 0: none), so it is
        #: handed those few instead of every peer holding a prompt cached mesh-wide (``candidates.py``).
        self.draws_holders = reads.holders
        self.keyed = reads.keyed  # it reads the routing key: derived before deciding
        self.routes_by_plan = reads.plan  # what ``Route.plan_destinations`` reports
        self.homes = reads.homes  # how many homes to name for each request (``types.context_homes``)
        #: Requests with segments are routed by them (``segments.py``) when the policy reads them.
        self.reads_segments = reads.segments
        #: Every peer's served rate is kept only for a policy that reads it (``served_rate.py``).
        self.reads_served_rates = reads.served_rates
        self.sends_elsewhere = reads.sends_elsewhere  # hand every peer with sends in flight (``Reads``)
        #: For a policy that chooses by load alone: every alive peer by load with its sends counted, kept as sends
        #: come and go (``effective_load.py``; None for any other policy).
        self.by_load = EffectiveLoadOrder() if reads.load_only and reads.sparse else None

    @classmethod
    def for_node(
        cls,
        routing: RoutingConfig,
        self_id: str,
        self_address: str,
        index: PrefixIndex,
        local_load: Callable[[], NodeLoad | None],
        directory: PeerDirectory | None,
        *,
        profile: CostModel | None = None,
        spec: PolicySpec | None = None,
        clock: Callable[[], float] = time.monotonic,
        refresh_s: float = PEER_TABLE_REFRESH_S,
        kv_layout: str = "",
        local_segments: Callable[[int], bool] | None = None,
        bos_token_id: int | None = None,
        summary_stride: int = 1,
        local_adapters: Callable[[], AdapterSet] = lambda: NO_ADAPTERS,
        on_routed: Callable[[Route], None] | None = None,
        local_tiers: Callable[[Sequence[int], int], TierDepths] | None = None,
        shared_bases: SharedBases | None = None,
    ) -> Router:
        """The router a node with this routing configuration runs (``Node.start``; the simulator builds each of its
        nodes' routers here too): the policy ``routing.policy`` names (or ``spec``), its speed parameters bound from
        ``profile`` (the engine's cost profile). ``local_segments``, ``bos_token_id``, ``local_tiers``,
        ``shared_bases``: as for ``Router``; ``summary_stride``: the peers' summary stride (the gossip
        configuration's)."""
        ttl = routing.speculative_ttl_s
        policy = (spec or get_spec(routing.policy)).for_profile(profile)
        if routing.kv_pull_force and policy.force_pull_param:
            policy = policy.with_params(**{policy.force_pull_param: True})
        links = LinkEstimates(routing.kv_link_gbps * 1e9 / 8) if routing.kv_link_gbps > 0 and kv_layout else None
        pull_price = None
        price_of = policy.segment_pull_price
        kv_bytes = getattr(profile, "kv_bytes_per_token", 0)
        if links is not None and profile is not None and local_segments is not None and kv_bytes > 0 and price_of:
            pull_price = price_of(policy.effective, profile, routing.kv_pull_force)
        return cls(
            self_id,
            self_address,
            index,
            local_load,
            directory,
            policy,
            routing_key_blocks=routing.routing_key_blocks,
            speculative=SpeculativeIndex(ttl_s=ttl) if ttl > 0 else None,
            clock=clock,
            refresh_s=refresh_s,
            kv_layout=kv_layout,
            links=links,
            local_segments=local_segments,
            bos_token_id=bos_token_id,
            segment_slack_blocks=max(0, summary_stride - 1),
            segment_pull_price=pull_price,
            local_adapters=local_adapters,
            on_routed=on_routed,
            local_tiers=local_tiers,
            shared_bases=shared_bases,
        )

    # --- deciding -----------------------------------------------------------------------------------------

    def peer_table(self, now: float) -> PeerTable:
        """The shared per-peer snapshots, caught up with the directory (``peer_table.py``) and the link figures."""
        links = self.links
        if links is not None and links.version != self._links_version:
            self._links_version = links.version
            self.table.version = -1  # a link figure moved: re-read every peer
        self.table.refresh(self.directory, now, self.refresh_s)
        return self.table

    def _self_snapshot(self, hashes: tuple[int, ...]) -> PeerSnapshot:
        """This node, exactly: its own index's match (and its tiers' depths) and the engine's live load (nothing in
        flight to itself)."""
        local = self.local_load()
        rates = self.table.served_rates
        gpu = self.index.match_blocks(hashes)
        host = disk = 0
        if self.local_tiers is not None:
            depths = self.local_tiers(hashes, gpu)
            if depths.disk > gpu:
                host, disk = depths.host, depths.disk
        return PeerSnapshot(
            node_id=self.self_id,
            is_self=True,
            alive=local is not None,
            est_match_blocks=gpu,
            est_host_blocks=host,
            est_disk_blocks=disk,
            load=local if local is not None else NO_LOAD,
            cached_blocks=len(self.index),
            served_rate=rates.observe(self.self_id, local) if local is not None and rates is not None else None,
            kv_layout=self.kv_layout,
            link_bytes_per_s=self.links.default if self.links is not None else 0.0,
        )

    def _estimates(self, hashes: tuple[int, ...], now: float) -> tuple[dict[str, int], Levels | None]:
        """Every peer's positive estimate: the directory's, raised by the speculative index's; and the same grouped
        by depth when the directory groups them (``ClusterView.estimate_levels``; the raised peers moved to their new
        depths: ``raised_levels``), None otherwise (the readers sort the estimates instead)."""
        levels: Levels | None = None
        if self._estimate_levels is not None:
            estimates, levels = self._estimate_levels(hashes)
        else:
            estimates = self.directory.estimate_matches(hashes) if self.directory is not None else {}
        if self.speculative is not None:
            raised: dict[str, int] = {}
            left: dict[int, list[str]] = {}
            for node_id, blocks in self.speculative.match_all(hashes, now).items():
                was = estimates.get(node_id, 0)
                if blocks > was:
                    estimates[node_id] = raised[node_id] = blocks
                    if was:
                        left.setdefault(was, []).append(node_id)
            if raised and levels is not None:
                levels = raised_levels(levels, raised, left, self._level_cuts)
        return estimates, levels

    def _tier_estimates(self, hashes: tuple[int, ...], estimates: dict[str, int]) -> dict[str, tuple[int, int]]:
        """The peers whose tiers hold the prompt past their estimate (the directory's, raised by the speculative
        index's), with their cumulative (host, disk) depths; empty when no peer publishes a tier that reaches
        further."""
        lookup = self._estimate_tiers
        if lookup is None or (self._tiers_of is not None and not self._tiers_of.tiers_published):
            return {}
        host = lookup(hashes, Medium.HOST)
        disk = lookup(hashes, Medium.DISK)
        if not host and not disk:
            return {}
        out: dict[str, tuple[int, int]] = {}
        self_id = self.self_id
        for node_id in (*host, *(n for n in disk if n not in host)):  # ordered: decisions reproduce
            if node_id == self_id:
                continue
            gpu = estimates.get(node_id, 0)
            h = max(gpu, host.get(node_id, 0))
            d = max(h, disk.get(node_id, 0))
            if d > gpu:
                out[node_id] = (h, d)
        return out

    def _homes_of(
        self, hashes: tuple[int, ...], own: int, estimates: dict[str, int], table: PeerTable, levels: Levels | None
    ) -> tuple[str, ...]:
        """The request's homes (``types.context_homes``) among every alive node, past the deepest estimated match."""
        if levels is not None:
            deepest = max(own, levels[0][0] if levels else 0)
        else:
            deepest = max(own, max(estimates.values(), default=0))
        return context_homes(hashes, deepest, table.mesh_ids, self.homes)

    def _segment_estimates(self, segments: SegmentSpans, tokens: Sequence[int] | None) -> dict[str, int]:
        """Every node's estimate of the request's segment tokens it would reuse, this one's included
        (``segments.py``)."""
        directory = self.directory
        if segments.mode is SegmentReuse.APPROXIMATE:
            holders = self._segment_holders(segments)
            held = self.local_segments
            mine = [i for i, key in enumerate(segments.keys) if held(key)] if held is not None else []
            if mine:
                holders[self.self_id] = mine
            return approximate_estimates(segments, holders)
        if tokens is None:
            raise ValueError("routing an exact-mode request by its segments needs its tokens")
        index, self_id = self.index, self.self_id
        slack = self.segment_slack_blocks

        def estimate(chain: list[int]) -> dict[str, int]:
            out = directory.estimate_matches(chain) if directory is not None else {}
            out.pop(self_id, None)
            own = index.match_blocks(chain)
            if own:
                out[self_id] = own
            return out

        head = 1 if tokens and tokens[0] == self.bos_token_id and segments.spans[0][0] >= 1 else 0
        return exact_estimates(
            tokens, segments, index.block_size, estimate, head=head,
            slack=lambda node_id: 0 if node_id == self_id else slack,
        )

    def route(self, request: Request) -> Route:
        """Decide where a request goes. Its namespace (adapter and cache salt): its blocks are hashed in it (so every
        estimate is of KV it can use), a key its client gives is kept apart from other namespaces' (derived keys are:
        they come from the hashes), only nodes that serve its adapter are candidates, and outside the default
        namespace its KV is never pulled (``RouteRequest.kv_movable``). Its segments: see the module docstring."""
        tokens, namespace, routing_key = request.tokens, request.namespace, request.routing_key
        hashes = tuple(request.block_hashes(self.index.block_size))
        if routing_key and not namespace.is_default:
            routing_key = f"{namespace.label}/{routing_key}"
        return self.route_blocks(
            RouteQuery(
                hashes, len(tokens), request.max_tokens, routing_key, request.request_id, namespace.adapter,
                request.segments, tokens, kv_movable=namespace.is_default, priority=request.sampling.priority,
            )
        )

    def _adapter_servers(self, adapter: str) -> dict[str, bool]:
        """The alive nodes that serve ``adapter`` (this one included), each with whether it likely holds it loaded."""
        servers: dict[str, bool] = {}
        mine = self.local_adapters()
        if adapter in mine.served:
            servers[self.self_id] = adapter in mine.resident
        lookup = getattr(self.directory, "adapters", None)
        if lookup is not None:
            for node_id in self.table.alive_ids:
                theirs = lookup(node_id)
                if theirs is not None and adapter in theirs.served:
                    servers[node_id] = adapter in theirs.resident
        return servers

    def _for_adapter(self, candidates: CandidateSet, adapter: str) -> tuple[CandidateSet, dict[str, bool]]:
        """Only nodes that serve ``adapter`` stay candidates (the others look dead to the policy); one that likely
        has to load it first carries the load as queued work (``DEFAULT_ADAPTER_LOAD_TOKENS``)."""
        servers = self._adapter_servers(adapter)
        if not servers:
            raise NoAliveCandidate(f"no alive node serves adapter {adapter!r}")
        adapted = []
        handed = {s.node_id for s in candidates.snapshots}
        missing = [self.table.by_id[n] for n in servers if n not in handed and n in self.table.by_id]
        for s in (*candidates.snapshots, *missing):  # a sparse set may lack the few nodes that serve it
            resident = servers.get(s.node_id)
            if resident is None:
                s = replace(s, alive=False)
            elif not resident:
                backlog = (s.load.prefill_backlog_tokens or 0) + self.adapter_load_tokens
                s = replace(s, load=replace(s.load, prefill_backlog_tokens=backlog))
            adapted.append(s)
        return replace(candidates, snapshots=adapted), servers

    def route_blocks(self, query: RouteQuery) -> Route:
        """Decide where a prompt goes, given its block hashes (``route`` computes them; the simulator has them):
        only the nodes that serve its adapter are candidates; its segments (and the prompt's tokens, which an
        exact-mode estimate lays out): see the module docstring."""
        hashes, prompt_tokens, max_tokens = query.hashes, query.prompt_tokens, query.max_tokens
        now = self.clock()
        table = self.peer_table(now)
        me = self._self_snapshot(hashes)
        estimates, levels = self._estimates(hashes, now)
        tiers = self._tier_estimates(hashes, estimates)
        segment_estimates = self._segment_reuse(query.segments, query.tokens)
        if segment_estimates is not None:
            me = replace(me, est_segment_tokens=segment_estimates.get(self.self_id, 0))
        key, routing_key = self._key_of(hashes, query.routing_key, query.request_id)
        plan = self.plan
        warm = self.keyed and plan is not None and routing_key in plan
        request, peer_segments = self._request(  # asked with the key derived here, if it is
            query, routing_key, me, estimates, segment_estimates, table, plan if warm else None, tiers, levels
        )
        planned = plan.destinations(routing_key) if warm else ()  # type: ignore[union-attr]
        candidates = self._candidates(request, me, estimates, table, planned, peer_segments, tiers)
        if query.priority < 0:
            candidates = _urgent(candidates)
        decision = self._decide(request, candidates, plan, query.adapter)
        self.counters.decisions += 1
        self.counters.by_policy[decision.policy] += 1
        route = Route(
            decision=decision,
            block_hashes=hashes,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            block_size=request.block_size,
            addresses=table.lend_addresses(),
            estimates=candidates.estimates,
            plan_epoch=plan.epoch if plan is not None else 0,
            plan_planner=plan.planner_id if plan is not None else "",
            plan_destinations=planned if warm and self.routes_by_plan and plan.affinity else (),  # type: ignore[union-attr]
            _key=[key],
            segment_estimates=segment_estimates,
            tier_depths=_tier_depths(me, tiers),
        )
        if self.on_routed is not None:
            self.on_routed(route)
        return route

    def _segment_reuse(self, segments: SegmentSpans | None, tokens: Sequence[int] | None) -> dict[str, int] | None:
        """Every node's estimate of the request's segment tokens it would reuse when the request is routed by its
        segments (it names some, and the policy reads them: ``Reads.segments``); None: routed by its prefix."""
        if segments is None or not self.reads_segments or segments.mode is SegmentReuse.NONE:
            return None
        return self._segment_estimates(segments, tokens)

    def _key_of(
        self, hashes: tuple[int, ...], routing_key: str, request_id: str
    ) -> tuple[str | Callable[[], str], str]:
        """The request's key for its ``Route`` (the key, or how to derive it when first read) and the key the policy
        and the plan see: the client's, else derived (``keys.py``) -- before deciding only for a policy that reads
        keys; one that does not sees ``request:<id>``."""
        if routing_key:
            return routing_key, routing_key
        if self.keyed:
            derived = self.keys.key(hashes, request_id)
            return derived, derived
        return functools.partial(self.keys.key, hashes, request_id), f"request:{request_id}"

    def _request(
        self,
        query: RouteQuery,
        routing_key: str,
        me: PeerSnapshot,
        estimates: dict[str, int],
        segment_estimates: dict[str, int] | None,
        table: PeerTable,
        warm_plan: Plan | None,
        tiers: dict[str, tuple[int, int]],
        levels: Levels | None = None,
    ) -> tuple[RouteRequest, dict[str, int] | None]:
        """What the policy is asked, with what it reads of the mesh drawn for this request (its tiebreak, sampled
        peers, drawn holders -- by the deepest of a peer's estimate and its ``tiers`` --, common prefix, homes, the
        plan's sends of its key when warm: ``warm_plan``); and the peers' segment estimates when it is routed by its
        segments (None otherwise). ``routing_key``: the query's, or the one derived for it (``_key_of``); ``levels``:
        the estimates by depth (``_estimates``), when known."""
        hashes, prompt_tokens, segments = query.hashes, query.prompt_tokens, query.segments
        tiebreak = request_tiebreak(query.request_id, self.ledger.tickets)
        sampled = sample_peers(table.ids_by_id, tiebreak, self.sampled)
        mode: SegmentReuse | None = None
        peer_segments: dict[str, int] | None = None
        homes: tuple[str, ...] = ()
        if segments is not None and segment_estimates is not None:  # routed by its segments
            mode = segments.mode
            peer_segments = {k: v for k, v in segment_estimates.items() if k != self.self_id}
            holders = self._draw_holders(peer_segments, prompt_tokens, tiebreak, sampled, table)  # by segment tokens
        else:
            if self.homes:
                homes = self._homes_of(hashes, me.est_match_blocks, estimates, table, levels)
            depths = estimates
            if tiers:
                depths = dict(estimates.items())  # a LevelEstimates' dict at C speed
                for node_id, (_, disk) in tiers.items():
                    depths[node_id] = disk
            holders = self._draw_holders(
                depths, len(hashes), tiebreak, (*sampled, *homes), table, None if tiers else levels
            )
        request = RouteRequest(
            block_hashes=hashes,
            prompt_tokens=prompt_tokens,
            max_tokens=query.max_tokens,
            routing_key=routing_key,
            block_size=self.index.block_size,
            tiebreak=tiebreak,
            sampled=sampled,
            holders=holders,
            common_match_blocks=(
                common_match(estimates, me.est_match_blocks, len(table.alive_by_load) + 1, levels, self.self_id)
                if mode is None
                else 0
            ),
            homes=homes,
            plan_sends=self.split.sends(warm_plan, routing_key) if warm_plan is not None else None,
            segment_mode=mode,
            kv_movable=query.kv_movable,
        )
        return request, peer_segments

    def _candidates(
        self,
        request: RouteRequest,
        me: PeerSnapshot,
        estimates: dict[str, int],
        table: PeerTable,
        planned: tuple[str, ...],
        peer_segments: dict[str, int] | None,
        tiers: dict[str, tuple[int, int]],
    ) -> CandidateSet:
        """What the policy is handed for ``request`` (``candidates.assemble``): this node's exact snapshot ``me``, and
        the peers it touches -- by ``estimates``, ``peer_segments``, ``tiers``, the key's ``planned`` destinations,
        its sample, holders and homes, sends in flight -- or every peer, as the policy reads (``Reads.sparse``)."""
        return assemble(
            me,
            table,
            estimates,
            self.ledger,
            tiebreak=request.tiebreak,
            sampled=request.sampled,
            planned=planned,
            homes=request.homes,
            sparse=self.sparse,
            least_loaded=self.least_loaded,
            sends_elsewhere=self.sends_elsewhere,
            holders=request.holders if request.holders else None,
            segment_estimates=peer_segments,
            tier_estimates=tiers or None,
            by_load=self.by_load,
        )

    def _draw_holders(
        self,
        depths: dict[str, int],
        full: int,
        tiebreak: int,
        candidates: tuple[str, ...],
        table: PeerTable,
        levels: Levels | None = None,
    ) -> tuple[str, ...]:
        """The holders the router draws for a policy that lets it (``Reads.holders``) when more than
        ``DRAW_HOLDERS_ABOVE`` peers hold some of the request (``depths`` of ``full``: prefix blocks, or segment
        tokens), besides this node and the policy's other ``candidates`` (its sample and homes: ``p2p`` draws its
        holders among the rest, so a home that is also among the deepest is not drawn twice) (``types.draw_holders``;
        from ``levels``, the same depths grouped, when given); none otherwise."""
        if not self.draws_holders or len(depths) <= DRAW_HOLDERS_ABOVE:
            return ()
        exclude = {self.self_id, *candidates}
        if levels is not None:
            return draw_holders_by_depth(
                levels, full, tiebreak, exclude, table.is_alive, self.draws_holders, table.sorted_alive
            )
        return draw_holders(depths, full, tiebreak, exclude, table.is_alive, self.draws_holders)

    def _decide(self, request: RouteRequest, candidates: CandidateSet, plan: Plan | None, adapter: str) -> Decision:
        """The policy's decision on ``candidates``, completed with every other alive peer (``CandidateSet.complete``);
        with an ``adapter``, among the nodes that serve it only."""
        servers = None
        if adapter:
            candidates, servers = self._for_adapter(candidates, adapter)
        decision = candidates.complete(self.policy(request, candidates.snapshots, plan), self.self_id)
        if servers is not None:
            ranked = tuple(n for n in decision.ranked if n in servers)
            if not ranked:
                raise NoAliveCandidate(f"no alive node serves adapter {adapter!r}")
            decision = replace(decision, ranked=ranked)
        return decision

    # --- accounting ---------------------------------------------------------------------------------------

    def begin(self, route: Route, target: str) -> int:
        """The request is being sent to ``target``; returns a ticket for ``end``."""
        if self.keyed and self.plan is not None and route.routing_key in self.plan:
            self.split.record(self.plan, route.routing_key, target)
        if target == self.self_id:
            self.counters.local += 1
            return self.ledger.issue()
        now = self.clock()
        self.counters.forwarded += 1
        if self.speculative is not None:
            self.speculative.expire(now, front_only=True)  # what expired goes as sends come: memory follows the TTL
            self.speculative.record(target, route.block_hashes, now)
        return self.ledger.begin(target, now, route.prompt_tokens - route.estimated_tokens(target))

    def _segment_holders(self, segments: SegmentSpans) -> dict[str, list[int]]:
        """Per peer (not this node), the indices of the request's segments its gossip says its store holds (none
        from a directory that carries no segment keys)."""
        holders_of = getattr(self.directory, "segment_holders", None)
        holders = holders_of(segments.keys) if holders_of is not None else {}
        holders.pop(self.self_id, None)
        return holders

    def segments_held_elsewhere(self, segments: SegmentSpans) -> frozenset[int]:
        """As the node serving a request: the indices of its segments some peer's gossip says its store holds -- the
        mesh computed them before, evidence of reuse for this node's store (``SegmentStore.offer``)."""
        return frozenset(i for indices in self._segment_holders(segments).values() for i in indices)

    def segment_pulls(self, segments: SegmentSpans) -> tuple[SegmentPull, ...]:
        """As the node serving a request: the segments its store lacks that it should pull from peers, and from whom
        (``segments.segment_pulls``: priced like a prefix pull, by the peers' gossiped keys and link figures); none
        without a price, a store or links."""
        price, held = self.segment_pull_price, self.local_segments
        if price is None or held is None or segments.mode is not SegmentReuse.APPROXIMATE:
            return ()
        holders = self._segment_holders(segments)
        if not holders:
            return ()
        table = self.peer_table(self.clock())
        layout = self.kv_layout
        peers = {
            node_id: p
            for node_id in holders
            if (p := table.by_id.get(node_id)) is not None and p.kv_layout == layout and layout
        }
        return segment_pulls(segments, held, holders, peers, price)

    def address_of(self, node_id: str) -> str:
        """A known node's address ("" when unknown), as of the last routing decision or segment pull."""
        return self.table.addresses.get(node_id, "")

    def end(self, target: str, ticket: int) -> None:
        self.ledger.end(target, ticket)

    def refused(self, target: str) -> None:
        """``target`` failed a send before any output (it refused, drains, its engine is down): what this ingress
        guessed it caches since (the speculative index) goes, or the next request of the same prompt would try it
        first again -- every request of a prompt paid a refused hop at a draining peer whose load fell to 0."""
        if self.speculative is not None and target != self.self_id:
            self.speculative.forget_peer(target)

    def record_outcome(self, route: Route, target: str, cached_tokens: int) -> None:
        """Account the gap between what routing expected and what the engine reported."""
        estimated = route.estimated_tokens(target)
        self.counters.served += 1
        self.counters.estimated_tokens += estimated
        self.counters.actual_cached_tokens += cached_tokens
        self.counters.estimate_abs_error_tokens += abs(estimated - cached_tokens)

    def record_pull(self, holder: str, moved_bytes: int, seconds: float, ok: bool) -> None:
        """A pull this ingress routed finished: its holder's link figure learns from it (``links.py``)."""
        if self.links is not None:
            self.links.observe(holder, moved_bytes, seconds, ok)

    def forget_peer(self, peer: str) -> None:
        if self.speculative is not None:
            self.speculative.forget_peer(peer)
        self.ledger.forget(peer)
        if self.links is not None:
            self.links.forget(peer)
