"""The simulated mesh: N engines, a gossip view, and at every node the node's own ``Router``.

Per request: a client picks an ingress node at random; that node's ``Router`` (``p2pnode/routing/router.py``, the
very object a node builds, over the ingress's ``PeerDirectory`` from the view) decides with the configured policy
and the current plan, exactly as ``Node`` would: candidate assembly, the in-flight ledger, the speculative index,
the sparse candidate set, the tie-break. A forwarded request reaches its target after
``forward_latency_s`` and is served there (one hop, never re-forwarded); its ingress ends the send when it finishes.
When the decision pulls the prompt's cached prefix from a peer (``Decision.pull``: only with a link figure,
``SimConfig.routing.kv_link_gbps``), the request then waits at its target for the pull over the holder's link
(``pulls.py``) before it joins the target's queue. With a link figure, an ``approximate`` request's target may also
pull segments its store lacks from the peers whose gossiped keys hold them (its own router decides:
``Router.segment_pulls``), over the same links.

KV tiers (``host_kv_tokens`` / ``disk_kv_tokens`` per node, ``engine/simulated/tiers.py``): every node's engine
gets a host tier (and a disk tier below it) under its paged cache, whatever the policy -- a tier is the node's, not
the policy's; each node's router knows its own tiers' depths exactly, its peers' through the view (the gossip model
publishes each tier beside the engine's summary, ``staleness.py``; the exact view reads them live).

Segments (a workload whose requests name them, ``workloads/rag.py``): ``SimConfig.segments`` says how every request
reuses them -- ``none`` (its prompt as sent, prefix caching only), ``exact`` or ``approximate``
(``engine/simulated/segments.py``); the ingress's router is told (``RouteQuery.segments``) and each
node's engine does the rest. Equal KV capacity: an approximate node's KV is split between its paged cache and its
segment store (``segment_store_share``), the other modes keep it all in the paged cache.

Flow control (``admission_queue``; docs/simulator.md, "Tenants and priorities"): every node gets an admission queue
ahead of its engine -- the node's own ``FairQueue``, fair across tenants (weighted by ``tenant_weights``) and strict
by priority, shedding what waits longer than ``max_queue_s`` (``admission.py``) -- and its engine schedules by
priority with preemption, as vLLM's ``priority`` policy (``engine/simulated/batching.py``). Off (the default),
requests go straight to an FCFS engine, as before; the metrics add per-tenant and per-priority figures only with it.

The run ends when the workload is exhausted and every request has finished; periodic tasks (gossip rounds, plan
periods, speculative-index expiry) stop then.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from p2pnode.cache.segments import SegmentReuse
from p2pnode.cache.tiers import TierDepths
from p2pnode.config import (
    DEFAULT_FORWARD_LATENCY_S,
    DEFAULT_SEGMENT_POLICY,
    DEFAULT_SEGMENT_STORE_THRESHOLD,
    DEFAULT_SIM_BLOCK_SIZE,
    DEFAULT_SIM_EVICTION,
    DEFAULT_SIM_MAX_QUEUE_LENGTH,
    DEFAULT_SIM_MAX_QUEUE_S,
    DEFAULT_SIM_NODES,
    DEFAULT_SIM_PROFILE,
    DEFAULT_SIM_SEGMENT_STORE_SHARE,
    DEFAULT_SIM_SEGMENTS,
    DEFAULT_SIM_TIER_EVICTION,
    DEFAULT_SIM_TIER_PROMPT_ONLY,
    DEFAULT_SIM_TIER_STORE_THRESHOLD,
    RoutingConfig,
)
from p2pnode.cost import CostProfile, get_profile
from p2pnode.engine.simulated.batching import NodeEngine
from p2pnode.engine.simulated.kvcache import PagedPrefixCache
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.engine.simulated.segments import SimSegments
from p2pnode.engine.simulated.tiers import NodeTiers, TierConfig
from p2pnode.gossip.config import DEFAULT_GOSSIP_INTERVAL_S, DEFAULT_SUMMARY_STRIDE, GossipConfig
from p2pnode.plan.plan import Plan
from p2pnode.plan.rates import RateSketch
from p2pnode.plan.work import decode_token_cost
from p2pnode.routing.peer_table import SharedBases
from p2pnode.routing.policies import DEFAULT_POLICY, SPECS, PolicySpec, get_spec
from p2pnode.routing.policies.types import Decision
from p2pnode.routing.router import RouteQuery, Router
from p2pnode.routing.segments import by_holder
from p2pnode.sim import upper_bound
from p2pnode.sim.admission import MeshShares, NodeQueue
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.des import EventLoop, fewer_collections
from p2pnode.sim.metrics import Recorder
from p2pnode.sim.plan import PlanInput, PlanProvider, provider_for
from p2pnode.sim.pulls import KvPulls
from p2pnode.sim.staleness import StalenessGossip, check_settings, default_delay
from p2pnode.sim.views import ExactView, MeshParts, SimView

__all__ = ["Cluster", "SimConfig", "check_config", "policy_spec"]


#: Speculative-index expiry runs every this many TTLs.
SPECULATIVE_EXPIRE_TTLS = 10
#: The KV layout fingerprint every simulated node publishes when the run moves KV: one model, one engine, one block
#: size, so any node's blocks fit any other's (a node's is derived from its model and engine; ``PeerSnapshot``).
SIM_KV_LAYOUT = "sim"
#: Seconds between two samples of every node's KV held by running requests and queue (``metrics.py``: what bounds a
#: mesh whose KV is short; reading, never changing, the engines).
KV_SAMPLE_PERIOD_S = 1.0
#: A pull's fixed time besides the holder's engine step unless measured (``SimConfig.kv_pull_fixed_s``): what the
#: default policy prices it at.
DEFAULT_PULL_FIXED_S: float = SPECS[DEFAULT_POLICY].defaults["pull_rtt_s"]


#: The routing configuration a simulated node runs unless told otherwise: a node's defaults on the simulator's cost
#: profile, with the shadow gate off (not modelled: the plan's affinity stays on, ``sim/plan.py``).
SIM_ROUTING = RoutingConfig(cost_profile=DEFAULT_SIM_PROFILE, shadow_gate=False)


@dataclass(frozen=True)
class SimConfig:
    """One simulated run's settings (the workload and its rate are given to ``Cluster.run``).

    Every simulated node runs ``routing``, a node's own routing configuration; gossip settings default to a node's
    (``gossip/config.py``). ``for_node`` derives a run from a node's configuration.
    """

    nodes: int = DEFAULT_SIM_NODES
    #: What every node's router runs, as on a node (``p2pnode/config.py``): the policy, the engine cost profile every
    #: simulated engine runs too, the speculative TTL (0 turns the index off), the routing key's length, the plan's
    #: period, the link figure KV pulls are priced with (0: no pulls; the simulated links run at it unless
    #: ``kv_pull_link_gbps`` says otherwise) and whether every pull is priced at zero. Its shadow gate is not
    #: modelled: the plan's affinity stays on.
    routing: RoutingConfig = SIM_ROUTING
    block_size: int = DEFAULT_SIM_BLOCK_SIZE
    eviction: str = DEFAULT_SIM_EVICTION
    gossip_interval_s: float = DEFAULT_GOSSIP_INTERVAL_S
    gossip_delay_s: float | None = None  # None: the agent's measured lag (staleness.default_delay); model only
    gossip: str = "model"  # "model": staleness.StalenessGossip; "agent": the real GossipAgent (gossip_view.py)
    #: Blocks per published summary depth; None: each view's default (the model's exact summary, 1; the agent's
    #: ``DEFAULT_SUMMARY_STRIDE``, 4 -- 1,024 tokens at 256-token blocks against 64 on a node's 16-token blocks).
    summary_stride: int | None = None
    forward_latency_s: float = DEFAULT_FORWARD_LATENCY_S
    #: The TTFT threshold of every policy that trades affinity for load above one (``PolicySpec.ttft_slo_param``:
    #: DualMap's); None: each one's own. Never taken from the SLO a run is judged by, so no flag changes a policy
    #: behind the user's back.
    policy_ttft_slo_s: float | None = None
    warmup_s: float = 0.0
    seed: int = 0
    kv_capacity_tokens: int | None = None  # override the profile's KV cache size (tests, what-ifs)
    #: Override the profile's ``long_prefill_token_threshold`` (vLLM's cap on one prefill's tokens a step; 0: none).
    long_prefill_token_threshold: int | None = None
    #: What the simulated links really move, Gb/s (None: ``routing.kv_link_gbps``; a what-if of a link slower or
    #: faster than priced, or a measured figure: ``pulls.py``, "Calibration").
    kv_pull_link_gbps: float | None = None
    #: A pull's fixed time in the model, s, besides the holder's engine step (None: what the default policy prices,
    #: its ``pull_rtt_s``; set from measured pulls: ``pulls.py``, "Calibration").
    kv_pull_fixed_s: float | None = None
    #: Nodes that take clients' requests (the first ``ingresses`` of them; 0: every node): a client picks one at
    #: random, as with every node. 1 is one shared router with the exact in-flight picture of the mesh; N is the
    #: mesh's own claim, N routers each with gossip's picture (scripts/bench_ingresses.py compares them).
    ingresses: int = 0
    #: How requests reuse the segments they name: ``none`` (prefix caching only), ``exact`` or ``approximate``
    #: (module docstring); a workload without segments is the same in every mode.
    segments: str = DEFAULT_SIM_SEGMENTS
    #: In ``approximate`` runs, the share of each node's KV capacity its segment store holds (the rest is its paged
    #: cache): equal KV capacity across modes.
    segment_store_share: float = DEFAULT_SIM_SEGMENT_STORE_SHARE
    #: In ``approximate`` runs that pull segments (a link figure): whether a node also stores the segments it pulled
    #: (False: the holder keeps the one copy; a what-if, ``engine/simulated/segments.py``).
    segment_store_pulled: bool = False
    #: In ``approximate`` runs, the offers a computed segment needs before a node's store keeps it (the node's
    #: ``--segment-store-threshold``).
    segment_store_threshold: int = DEFAULT_SEGMENT_STORE_THRESHOLD
    #: In ``approximate`` runs, the order of every node's segment store (the node's ``--segment-policy``): its own,
    #: apart from the paged cache's ``eviction``, as on a node.
    segment_policy: str = DEFAULT_SEGMENT_POLICY
    #: KV tiers below every node's engine, in tokens per node (0: none; a disk tier needs a host tier above it), and
    #: how they store: offers a block needs before it is stored, prompts only or outputs too, their eviction
    #: (``engine/simulated/tiers.py``).
    host_kv_tokens: int = 0
    disk_kv_tokens: int = 0
    tier_store_threshold: int = DEFAULT_SIM_TIER_STORE_THRESHOLD
    tier_prompt_only: bool = DEFAULT_SIM_TIER_PROMPT_ONLY
    tier_eviction: str = DEFAULT_SIM_TIER_EVICTION
    #: Flow control at every node (module docstring): an admission queue ahead of the engine and priority scheduling
    #: in it; off, requests go straight to an FCFS engine. A request waits in the queue at most ``max_queue_s``
    #: (then it is shed), at most ``max_queue_length`` wait; ``tenant_weights`` weigh the tenants' fair shares
    #: ((tenant, weight) pairs; a tenant not named weighs 1).
    admission_queue: bool = False
    max_queue_s: float = DEFAULT_SIM_MAX_QUEUE_S
    max_queue_length: int = DEFAULT_SIM_MAX_QUEUE_LENGTH
    tenant_weights: tuple[tuple[str, float], ...] = ()
    #: With flow control: tenants' fair shares over the whole mesh -- each node's queue charged the work the other
    #: nodes served each tenant, heard every gossip round after the gossip delay (``admission.MeshShares``) -- rather
    #: than per node. On, as every node does (``flow/served``).
    mesh_shares: bool = True

    @classmethod
    def for_node(cls, routing: RoutingConfig, gossip: GossipConfig | None = None, **run: Any) -> SimConfig:
        """A simulated mesh of nodes configured like this one (``run``: the simulator's own settings)."""
        interval_s = gossip.interval_s if gossip is not None else DEFAULT_GOSSIP_INTERVAL_S
        return cls(routing=routing, gossip_interval_s=interval_s, **run)

    def with_routing(self, **changes: Any) -> SimConfig:
        """These settings with ``routing``'s fields ``changes`` replaced (``policy="flat"``, ``kv_link_gbps=100``)."""
        return replace(self, routing=replace(self.routing, **changes))


def policy_spec(name: str, profile: CostProfile, ttft_slo_s: float | None = None) -> PolicySpec:
    """The policy ``name`` names (``routing.policies.get_spec``, or the ``upper-bound`` reference), its speed
    parameters bound from ``profile`` -- as a node running that profile binds them (``Router.for_node``) -- and, for a
    policy that steers by a TTFT threshold (``PolicySpec.with_ttft_slo``), ``ttft_slo_s`` when given."""
    spec = upper_bound.SPEC if name == upper_bound.NAME else get_spec(name)
    return spec.with_ttft_slo(ttft_slo_s).for_profile(profile)


def _profile(cfg: SimConfig) -> CostProfile:
    """The engines' cost profile: the routing configuration's, with ``kv_capacity_tokens`` and
    ``long_prefill_token_threshold`` when given."""
    profile = get_profile(cfg.routing.cost_profile)
    if cfg.kv_capacity_tokens is not None:
        profile = replace(profile, kv_capacity_tokens=cfg.kv_capacity_tokens)
    if cfg.long_prefill_token_threshold is not None:
        if cfg.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {cfg.long_prefill_token_threshold}")
        profile = replace(profile, long_prefill_token_threshold=cfg.long_prefill_token_threshold)
    return profile


def check_config(cfg: SimConfig) -> SimConfig:
    """``cfg``, once what a ``Cluster`` would refuse at its start is checked (ValueError, one line): the CLI checks
    before its runs start, not in each (a traceback per worker under ``--jobs``)."""
    _profile(cfg)
    _tier_config(cfg)
    check_settings(cfg.gossip_interval_s, cfg.gossip_delay_s, 1 if cfg.summary_stride is None else cfg.summary_stride)
    return cfg


def _tier_config(cfg: SimConfig) -> TierConfig:
    """Every node's tiers, in blocks of the run's size; ValueError for sizes or knobs out of range."""
    if cfg.host_kv_tokens < 0 or cfg.disk_kv_tokens < 0:
        raise ValueError(f"tier sizes must be >= 0 tokens, got host {cfg.host_kv_tokens}, disk {cfg.disk_kv_tokens}")
    return TierConfig(
        host_blocks=cfg.host_kv_tokens // cfg.block_size,
        disk_blocks=cfg.disk_kv_tokens // cfg.block_size,
        store_threshold=cfg.tier_store_threshold,
        prompt_only=cfg.tier_prompt_only,
        eviction=cfg.tier_eviction,
    )


def _segment_mode(cfg: SimConfig) -> SegmentReuse:
    """How the run's requests reuse their segments; ValueError for a mode or a store share out of range."""
    try:
        mode = SegmentReuse(cfg.segments)
    except ValueError:
        valid = ", ".join(m.value for m in SegmentReuse)
        raise ValueError(f"segments must be one of {valid}, got {cfg.segments!r}") from None
    if not 0 < cfg.segment_store_share < 1:
        raise ValueError(f"segment_store_share must be in (0, 1), got {cfg.segment_store_share}")
    return mode


class Cluster:
    """Build once per run: ``Cluster(cfg).run(requests)`` returns the run's summary."""

    def __init__(self, cfg: SimConfig, view: SimView | None = None, plan_provider: PlanProvider | None = None):
        if cfg.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {cfg.nodes}")
        if cfg.ingresses < 0:
            raise ValueError(f"ingresses must be >= 0 (0: every node), got {cfg.ingresses}")
        self.cfg = cfg
        self.loop = EventLoop()
        self.space = BlockSpace(cfg.block_size)
        self.profile = profile = _profile(cfg)
        n = self.n = cfg.nodes
        width = max(2, len(str(n - 1)))
        self.node_ids = tuple(f"n{j:0{width}d}" for j in range(n))
        self.id_index = {nid: j for j, nid in enumerate(self.node_ids)}
        self.segment_mode = _segment_mode(cfg)
        self.tier_config = _tier_config(cfg)
        self.engines = self._engines()
        self.queues = self._queues()
        self.exact = cfg.routing.policy == upper_bound.NAME
        #: Every node's KV layout: one shared fingerprint when the run moves KV, else none (no pull is priced).
        self.kv_layout = SIM_KV_LAYOUT if cfg.routing.kv_link_gbps > 0 else ""
        self.pulls = self._kv_pulls()
        self.spec = policy_spec(cfg.routing.policy, profile, cfg.policy_ttft_slo_s)
        self.view = view if view is not None else self._default_view()
        if plan_provider is None:
            plan_provider = provider_for(self.spec, decode_token_cost(profile), cfg.routing.plan_period_s)
        self.plan_provider = plan_provider
        self.plan: Plan | None = None
        self.plans_built = 0
        self.sketches = [RateSketch() for _ in range(n)] if plan_provider is not None else []
        self._plan_keys: dict[SimRequest, str] = {}  # requests in flight -> routing key, for the sketches
        speculative_ttl_s = cfg.routing.speculative_ttl_s
        self.use_speculative = speculative_ttl_s > 0 and not self.exact
        self.routers: list[Router] = []  # one per node, built when the run starts (the view must be running)
        self._shared_bases: dict[int, SharedBases] = {}  # id of a directory several routers read -> their bases
        self.in_transit = [0] * n  # forwarded requests on their way to each node
        # Expiry only frees memory (lookups check expiry themselves); every few TTLs, each entry is scanned ~once.
        self._expire_period_s = SPECULATIVE_EXPIRE_TTLS * speculative_ttl_s
        self._rand = random.Random(cfg.seed).random
        self.n_ingresses = min(cfg.ingresses, n) if cfg.ingresses else n
        self._id_prefix = f"s{cfg.seed}-"
        self.recorder = Recorder(
            n, cfg.block_size, cfg.warmup_s, cfg.forward_latency_s, self.tier_config.enabled, cfg.admission_queue
        )
        self._it: Iterator[SimRequest] = iter(())
        self._stream_done = False
        self._pending_follow = 0
        self.n_arrived = 0
        self.n_finished = 0
        self.last_arrival = 0.0
        self.t_last_finish = 0.0
        self.decisions: list[Decision] | None = None  # set to a list to keep every decision (tests)

    def _engines(self) -> list[NodeEngine]:
        """One engine per node, its KV split between its paged cache and, in ``approximate`` runs, its segment
        store (``segment_store_share``): every mode holds the same KV."""
        cfg, profile = self.cfg, self.profile
        store_tokens = 0
        if self.segment_mode is SegmentReuse.APPROXIMATE:
            store_tokens = int(profile.kv_capacity_tokens * cfg.segment_store_share)
        blocks = max(1, (profile.kv_capacity_tokens - store_tokens) // cfg.block_size)
        tiers = self.tier_config
        engines = []
        for j in range(self.n):
            node_tiers = None
            if tiers.enabled:
                node_tiers = NodeTiers(tiers, cfg.block_size * profile.kv_bytes_per_token)
            cache = PagedPrefixCache(blocks, cfg.block_size, cfg.eviction, self.space.block_tokens, tiers=node_tiers)
            segments = None
            if self.segment_mode is not SegmentReuse.NONE:
                segments = SimSegments(cache, store_tokens, cfg.segment_policy, store_pulled=cfg.segment_store_pulled,
                                       store_threshold=cfg.segment_store_threshold)
            engines.append(NodeEngine(
                j, self.loop, profile, cache, self._on_finish, segments=segments, priority_policy=cfg.admission_queue
            ))
        return engines

    def _queues(self) -> list[NodeQueue] | None:
        """Every node's admission queue with flow control, else None (requests go straight to the engines)."""
        cfg = self.cfg
        if not cfg.admission_queue:
            return None
        weights = dict(cfg.tenant_weights)
        if any(w <= 0 for w in weights.values()):
            raise ValueError(f"tenant weights must be > 0, got {cfg.tenant_weights}")

        def weight_of(tenant: str) -> float:
            return weights.get(tenant, 1.0)

        return [
            NodeQueue(eng, self.loop, self._on_finish, cfg.max_queue_s, cfg.max_queue_length, weight_of)
            for eng in self.engines
        ]
    def _kv_pulls(self) -> KvPulls | None:
        """The links KV pulls run over, when the run moves KV (a link figure); None otherwise."""
        cfg, profile = self.cfg, self.profile
        link_gbps = cfg.routing.kv_link_gbps
        if link_gbps < 0:
            raise ValueError(f"kv_link_gbps must be >= 0, got {link_gbps}")
        if not self.kv_layout:
            return None
        if profile.kv_bytes_per_token <= 0:
            raise ValueError(f"profile {profile.name} gives no KV bytes per token: no pull can be priced")
        if cfg.kv_pull_link_gbps is not None:
            link_gbps = cfg.kv_pull_link_gbps
        fixed_s = DEFAULT_PULL_FIXED_S if cfg.kv_pull_fixed_s is None else cfg.kv_pull_fixed_s
        return KvPulls(
            self.loop, self.engines, cfg.block_size, profile.kv_bytes_per_token, link_gbps * 1e9 / 8, fixed_s,
            self._pulled, self._observe_pull,
        )

    def _default_view(self) -> SimView:
        """What the routers see of their peers: exact state for the upper bound, else the configured gossip."""
        cfg = self.cfg
        if self.exact:
            return ExactView()
        if cfg.gossip == "agent":
            from p2pnode.sim.gossip_view import AgentGossip  # imported on demand: it loads the gossip package

            stride = {} if cfg.summary_stride is None else {"summary_stride": cfg.summary_stride}
            return AgentGossip(cfg.gossip_interval_s, cfg.seed, **stride)
        if cfg.gossip != "model":
            raise ValueError(f"gossip must be 'model' or 'agent', got {cfg.gossip!r}")
        stride = 1 if cfg.summary_stride is None else cfg.summary_stride  # 0 is refused, not taken for 1
        return StalenessGossip(cfg.gossip_interval_s, cfg.gossip_delay_s, cfg.seed, stride)

    def _router(self, j: int) -> Router:
        """Node j's router, built as ``Node.start`` builds one."""
        eng = self.engines[j]
        loop = self.loop
        routing = self.cfg.routing
        if not self.use_speculative:  # exact state (upper-bound): nothing to speculate about
            routing = replace(routing, speculative_ttl_s=0.0)
        stride = self.cfg.summary_stride
        if stride is None:
            stride = DEFAULT_SUMMARY_STRIDE if self.cfg.gossip == "agent" and not self.exact else 1
        directory = self.view.directory_for(j)
        return Router.for_node(
            routing,
            self.node_ids[j],
            self.node_ids[j],
            eng.cache.index,
            eng.load,
            directory,
            spec=self.spec,
            profile=self.profile,
            clock=lambda: loop.now,
            # A node's router also re-reads every peer once a second, for what drifts between load reports (info
            # ages, cached sizes from summary hashes); a simulated directory reports its cached sizes with its loads,
            # through ``version``, so the periodic re-read has nothing to catch up and is left out (it is most of the
            # routing cost of a large simulated mesh).
            refresh_s=math.inf,
            kv_layout=self.kv_layout,
            local_segments=eng.segments.holds if eng.segments is not None else None,
            summary_stride=stride,
            local_tiers=_local_tiers(eng) if eng.cache.tiers is not None else None,
            shared_bases=self._shared_bases.get(id(directory)),
        )

    def _bases_to_share(self) -> dict[int, SharedBases]:
        """One ``SharedBases`` per directory that several ingresses read (the gossip model's one, heard by all at
        the same moment): each round is then read once for all their routers, not once per router. The exact view
        moves its version at every read, so it has nothing to share; the agent's views are one per ingress."""
        if self.exact:
            return {}
        readers: dict[int, int] = {}
        for j in range(self.n):
            key = id(self.view.directory_for(j))
            readers[key] = readers.get(key, 0) + 1
        return {key: SharedBases() for key, count in readers.items() if count > 1}

    # --- lifecycle -----------------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """The workload is exhausted and every request that arrived has finished."""
        return self._stream_done and self.n_finished == self.n_arrived and not self._pending_follow

    def run(self, requests: Iterator[SimRequest] | list[SimRequest]) -> dict[str, Any]:
        self._it = iter(requests)
        self.view.start(
            MeshParts(self.loop, self.node_ids, self.engines, lambda: self.done, self.in_transit, self.kv_layout)
        )
        self._shared_bases = self._bases_to_share()
        self.routers = [self._router(j) for j in range(self.n)]
        if self.plan_provider is not None:
            self.loop.at(self.plan_provider.period_s, self._replan, None)
        if self.use_speculative:
            self.loop.at(self._expire_period_s, self._expire_speculative, None)
        if self.queues is not None and self.cfg.mesh_shares:
            cfg = self.cfg
            delay = cfg.gossip_delay_s
            if delay is None:
                delay = default_delay(cfg.gossip_interval_s, self.n)
            MeshShares(self.loop, self.queues, cfg.gossip_interval_s, delay, lambda: self.done).start()
        self.loop.at(max(self.cfg.warmup_s, KV_SAMPLE_PERIOD_S), self._sample, None)
        self._pull()
        with fewer_collections():
            self.loop.run()
        if not self.done:
            raise RuntimeError(f"simulation stalled: {self.n_arrived} arrived, {self.n_finished} finished")
        return self.recorder.summary(
            self.engines,
            arrived=self.n_arrived,
            last_arrival=self.last_arrival,
            sim_time=self.t_last_finish,  # not loop.now: a periodic task may tick once after the last request
            gossip_bytes=self.view.gossip_bytes(),
            events=self.loop.events,
        )

    def _pull(self) -> None:
        nxt = next(self._it, None)
        if nxt is None:
            self._stream_done = True
            return
        if nxt.arrival < self.last_arrival:
            raise ValueError(f"workload out of order: request {nxt.rid} at {nxt.arrival} after {self.last_arrival}")
        self.last_arrival = nxt.arrival
        self.loop.at(nxt.arrival, self._arrive_stream, nxt)

    def _arrive_stream(self, r: SimRequest) -> None:
        self._arrive(r)
        self._pull()

    def _arrive_follow(self, r: SimRequest) -> None:
        self._pending_follow -= 1
        self._arrive(r)

    # --- routing -------------------------------------------------------------------------------------------------

    def _arrive(self, r: SimRequest) -> None:
        self.n_arrived += 1
        loop = self.loop
        ing = int(self._rand() * self.n_ingresses)
        r.ingress = ing
        router = self.routers[ing]
        seg = r.segments
        spans = None
        if seg is not None:
            seg.mode = self.segment_mode
            spans = seg.spans_for_routing()
        query = RouteQuery(
            tuple(r.chain[: r.n_prompt_blocks]), r.prompt_tokens, r.output_tokens, r.key, f"{self._id_prefix}{r.rid}",
            segments=spans, tokens=seg.tokens if spans is not None else None,  # type: ignore[union-attr]
            priority=r.priority,
        )
        route = router.route_blocks(query)
        decision = route.decision
        if self.decisions is not None:
            self.decisions.append(decision)
        r.est_match_blocks = decision.est_match_blocks
        if route.segment_estimates is not None:  # what the target would reuse of its segments
            r.est_match_blocks = route.estimated_tokens(decision.target) // self.cfg.block_size
        t = r.target = self.id_index[decision.target]
        if self.sketches:
            self._plan_keys[r] = route.routing_key  # counted when served (_on_finish), as a node counts
        r.ticket = router.begin(route, decision.target)
        pull = decision.pull
        if pull is not None and self.pulls is not None and pull.target == decision.target:
            r.pull_holder = self.id_index[pull.holder]
            r.pull_blocks = pull.blocks
        self.in_transit[t] += 1
        if t == ing:
            self._deliver(r)
            return
        r.forwarded = True
        loop.at(loop.now + self.cfg.forward_latency_s, self._deliver, r)

    def _deliver(self, r: SimRequest) -> None:
        """``r`` is at its target: it pulls its prefix or its segments there, outside the batch until that ends (a
        request does one or the other: ``p2p`` gives a request with segments no prefix pull), or joins the queue."""
        if r.pull_holder >= 0:
            self.pulls.request(r)  # type: ignore[union-attr]
            return
        self._note_held_elsewhere(r)
        asks = self._segment_asks(r)
        if asks:
            self.pulls.request_segments(r, asks)  # type: ignore[union-attr]
            return
        self._submit(r)

    def _submit(self, r: SimRequest) -> None:
        """``r`` joins its target's admission queue, or its engine's queue without flow control."""
        self.in_transit[r.target] -= 1
        if self.queues is not None:
            self.queues[r.target].arrive(r)
        else:
            self.engines[r.target].submit(r)

    def _note_held_elsewhere(self, r: SimRequest) -> None:
        """With an admission threshold: which of ``r``'s segments its target's gossip says a peer holds (evidence of
        reuse the target's store counts when ``r`` ends, ``Router.segments_held_elsewhere``)."""
        seg = r.segments
        if self.cfg.segment_store_threshold <= 1 or seg is None or seg.mode is not SegmentReuse.APPROXIMATE:
            return
        spans = seg.spans_for_routing()
        assert spans is not None
        seg.held_elsewhere = self.routers[r.target].segments_held_elsewhere(spans)

    def _segment_asks(self, r: SimRequest) -> dict[int, tuple[int, ...]]:
        """The segments ``r``'s target pulls from peers, as its own router decides (``Router.segment_pulls``): per
        holder index, the segment indices asked of it."""
        seg = r.segments
        if self.pulls is None or seg is None or seg.mode is not SegmentReuse.APPROXIMATE:
            return {}
        spans = seg.spans_for_routing()
        assert spans is not None
        asks = by_holder(self.routers[r.target].segment_pulls(spans))
        return {self.id_index[holder]: indices for holder, indices in asks.items()}

    def _observe_pull(self, r: SimRequest, holder: int, moved_bytes: int, seconds: float, ok: bool) -> None:
        """A pull ended: the router that decided it learns the holder's link (``links.py``), as on a node -- a prefix
        pull's ingress (from the final message, ``ingress.py``), a segment job's target (``local.py``)."""
        decided_by = r.ingress if r.pull_holder >= 0 else r.target
        self.routers[decided_by].record_pull(self.node_ids[holder], moved_bytes, seconds, ok)

    def _pulled(self, r: SimRequest) -> None:
        """``r``'s pull is over (whatever moved): it joins its target's queue."""
        self._submit(r)

    # --- completions ---------------------------------------------------------------------------------------------

    def _on_finish(self, r: SimRequest) -> None:
        self.n_finished += 1
        self.t_last_finish = r.t_done
        if r.forwarded:
            self.routers[r.ingress].end(self.node_ids[r.target], r.ticket)
        self.recorder.record(r)
        key = self._plan_keys.pop(r, None)
        if key is not None and not r.dropped and not r.shed:  # the plan counts served work as a node (plan/work.py)
            self.sketches[r.ingress].observe(key, r.t_done, r.prompt_tokens, r.cached_tokens, r.output_tokens)
        f = r.follow
        if f is not None:
            back = self.cfg.forward_latency_s if r.forwarded else 0.0
            f.arrival = r.t_done + back + r.follow_gap_s
            self._pending_follow += 1
            self.loop.at(f.arrival, self._arrive_follow, f)

    # --- periodic tasks ------------------------------------------------------------------------------------------

    def _replan(self, _: object) -> None:
        provider = self.plan_provider
        assert provider is not None
        if self.done:
            return
        now = self.loop.now
        inp = PlanInput(
            now=now,
            node_ids=self.node_ids,
            rates=tuple(sk.summary(now) for sk in self.sketches),
            previous=self.plan,
            loads=tuple((e.running, e.n_waiting) for e in self.engines),
        )
        self.plan = plan = provider.plan(inp)
        for router in self.routers:
            router.plan = plan
        self.plans_built += 1
        self.loop.at(now + provider.period_s, self._replan, None)

    def _sample(self, _: object) -> None:
        if self.done:
            return
        self.recorder.sample(self.engines)
        self.loop.at(self.loop.now + KV_SAMPLE_PERIOD_S, self._sample, None)

    def _expire_speculative(self, _: object) -> None:
        if self.done:
            return
        now = self.loop.now
        for router in self.routers:
            if router.speculative is not None:
                router.speculative.expire(now)
        self.loop.at(now + self._expire_period_s, self._expire_speculative, None)


def _local_tiers(eng: NodeEngine) -> Callable[[Sequence[int], int], TierDepths]:
    """A node's own tiers' depths of a prompt, for its router (``Router.local_tiers``): what its engine would load."""
    tiers = eng.cache.tiers
    assert tiers is not None

    def depths(hashes: Sequence[int], gpu: int) -> TierDepths:
        host, disk = tiers.depths(hashes, gpu, len(hashes))
        return TierDepths(gpu, host, disk)

    return depths


def run_once(cfg: SimConfig, requests: Iterator[SimRequest] | list[SimRequest]) -> dict[str, Any]:
    """Convenience: one run with the default view and plan provider."""
    return Cluster(cfg).run(requests)

