"""The simulator predicts the node: the same request stream, routed by the simulator's ingress (``Cluster._arrive``
over its gossip model) and by a node's router (``Router.for_node`` over a real ``ClusterView`` fed the same mesh state
as gossip keys), gets identical decisions -- targets and retry orders -- through in-flight sends, speculative
placements, a load report arriving mid-stream, the peer table's periodic re-read and a rate plan; and, when the mesh
moves KV (a link figure, every node publishing the same KV layout), the same pulls; with KV tiers below every
engine (each tier's summary gossiped beside the engine's), the same decisions priced by where each node holds the
prefix; and for requests that name segments, the same segment-aware decisions (gossiped segment keys for approximate
mode, the prefix summaries an exact-mode layout is judged on).

Both routers share each ingress's own engine (its exact index and live load): what differs is everything the two
code paths could do differently with what an ingress knows about its peers.
"""

from __future__ import annotations

import random

import pytest

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.events import BlockStored
from p2pnode.cache.segment_summary import segment_state_key
from p2pnode.cache.segments import SegmentReuse
from p2pnode.cache.summary import SUMMARY_FAMILIES, SUMMARY_META_KEY, SummaryMeta, encode_meta
from p2pnode.cache.summary_log import SummaryWriter, summary_key
from p2pnode.cache.tiers import Medium
from p2pnode.config import RoutingConfig
from p2pnode.cost import get_profile
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.gossip import GossipConfig
from p2pnode.gossip.keys import ADDRESS_KEY
from p2pnode.gossip.membership import Membership
from p2pnode.gossip.state import ClusterState
from p2pnode.load import LOAD_KEY, NodeLoad, encode_load, rounded
from p2pnode.plan.plan import Plan
from p2pnode.routing.cluster_view import ClusterView
from p2pnode.routing.policies import SPECS, get_spec
from p2pnode.routing.router import RouteQuery, Router
from p2pnode.sim.cluster import SIM_KV_LAYOUT, Cluster, SimConfig, _local_tiers
from p2pnode.sim.des import LoopClock
from p2pnode.sim.staleness import StalenessGossip
from p2pnode.sim.views import MeshParts
from p2pnode.sim.workloads.base import Stream
from p2pnode.sim.workloads.rag import Piece, Rag, RagPrompt

BS = 16
NODES = 6
#: Every policy a node can run (both sides resolve the same spec and bind the same cost profile's speed).
POLICIES = list(SPECS)
#: Runs that move KV: the default rule pricing pulls as it does, and pricing every pull at zero, so that most
#: decisions pull -- as a what-if of the policy, or as a node configured so (``RoutingConfig.kv_pull_force``).
PULLING = [("p2p", 100.0, False), ("p2p@f1", 100.0, False), ("p2p", 100.0, True)]
#: Tiers below every engine, in blocks: a host tier, and a disk tier below it.
HOST_BLOCKS, DISK_BLOCKS = 4096, 8192


class Mesh:
    """One mesh state told to both sides: the simulator's gossip model and a node's ClusterView."""

    def __init__(self, cluster: Cluster, rng: random.Random, kv_layout: str = "") -> None:
        self.cluster = cluster
        self.ids = cluster.node_ids
        self.model = StalenessGossip(1.0, delay_s=0.0)
        self.clock = LoopClock(cluster.loop)
        membership = Membership(self.ids[0], GossipConfig(cluster_secret=b"s" * 32))
        self.view = ClusterView(ClusterState(self.ids[0], 1), membership, self.clock, block_size=BS)
        for nid in self.ids:
            self.view.on_node_added(nid, 1)
            membership.on_node(nid, 1, 0.0)
            self.view.on_key_changed(nid, ADDRESS_KEY, nid.encode())
            self.view.on_key_changed(nid, SUMMARY_META_KEY, encode_meta(SummaryMeta(1, BS, kv_layout)))
        self.blocks: list[set[int]] = [set() for _ in self.ids]
        self.logs = [SummaryWriter() for _ in self.ids]
        self.kv_layout = kv_layout
        self.tier_logs: dict[Medium, list[SummaryWriter]] = {}
        self.rng = rng

    def report(self, j: int, blocks: set[int], load: NodeLoad, segments: set[int] | None = None) -> None:
        """Node j's summary, load and (when given) segment keys, heard now by both sides."""
        segment_changes: tuple[list[int], list[int]] = ([], [])
        if segments is not None:
            segment_changes = (list(segments), [])
            for key in segments:
                self.view.on_key_changed(self.ids[j], segment_state_key(key), b"")
        added, removed = blocks - self.blocks[j], self.blocks[j] - blocks
        self.blocks[j] = set(blocks)
        nid = self.ids[j]
        for key, value in self.logs[j].update([summary_key(h) for h in added], [summary_key(h) for h in removed]):
            self.view.on_key_changed(nid, key, value)
        self.view.on_key_changed(nid, LOAD_KEY, encode_load(load))
        changes = [*added, *(~h for h in removed)]  # journal entries: a hash added, ~hash removed
        self.model._apply((j, 0.0, changes, None, (rounded(load), len(blocks)), segment_changes))


    def report_tier(self, j: int, medium: Medium, blocks: list[int]) -> None:
        """Node j's tier of ``medium`` holds ``blocks`` (it held nothing there before): heard now by both sides, as
        the summary of its own that a node publishes beside its engine's."""
        nid = self.ids[j]
        family = SUMMARY_FAMILIES[medium]
        logs = self.tier_logs.setdefault(medium, [SummaryWriter(family.log) for _ in self.ids])
        self.view.on_key_changed(nid, family.meta_key, encode_meta(SummaryMeta(1, BS, self.kv_layout)))
        for key, value in logs[j].update([summary_key(h) for h in blocks], []):
            self.view.on_key_changed(nid, key, value)
        self.model._apply_tiers(1 << j, {medium: [(0, True, h) for h in blocks]})


def node_router(cluster: Cluster, j: int, routing: RoutingConfig, view: ClusterView, kv_layout: str = "") -> Router:
    """Ingress j's router as ``Node.start`` builds it, on ingress j's own engine (its segment store and KV tiers
    included)."""
    eng = cluster.engines[j]
    return Router.for_node(
        routing, cluster.node_ids[j], cluster.node_ids[j], eng.cache.index,
        eng.load,
        view,
        profile=get_profile(routing.cost_profile),
        clock=lambda: cluster.loop.now,
        kv_layout=kv_layout,
        local_segments=eng.segments.holds if eng.segments is not None else None,
        local_tiers=_local_tiers(eng) if eng.cache.tiers is not None else None,
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_the_simulators_ingress_decides_like_the_nodes_router(policy: str) -> None:
    _same_decisions(policy, 0.0)


@pytest.mark.parametrize(("policy", "link_gbps", "force"), PULLING)
def test_with_kv_pulls_the_simulators_ingress_pulls_like_the_nodes_router(
    policy: str, link_gbps: float, force: bool
) -> None:
    pulls = _same_decisions(policy, link_gbps, force)
    assert pulls  # some decisions pulled, the same on both sides


def test_pricing_every_pull_at_zero_pulls_more_on_both_sides() -> None:
    """The node's ``kv_pull_force`` reaches the simulated routers too (the simulator runs the node's configuration)."""
    assert _same_decisions("p2p", 100.0, force=True) > _same_decisions("p2p", 100.0)


@pytest.mark.parametrize("policy", POLICIES)
def test_with_kv_tiers_the_simulators_ingress_decides_like_the_nodes_router(policy: str) -> None:
    _same_decisions(policy, 0.0, tiers=True)


@pytest.mark.parametrize(("policy", "link_gbps", "force"), PULLING)
def test_with_kv_tiers_and_pulls_both_sides_pull_alike(policy: str, link_gbps: float, force: bool) -> None:
    assert _same_decisions(policy, link_gbps, force, tiers=True)


def test_tiers_change_the_default_policys_decisions() -> None:
    """The tiers the test gives the nodes matter: the default policy routes otherwise with them than without."""
    assert _targets("p2p", tiers=True) != _targets("p2p", tiers=False)


def _targets(policy: str, tiers: bool) -> list[str]:
    decisions: list[str] = []
    _same_decisions(policy, 0.0, tiers=tiers, out=decisions)
    return decisions


def _same_decisions(
    policy: str, link_gbps: float, force: bool = False, tiers: bool = False, out: list[str] | None = None
) -> int:
    """Route one stream on both sides; returns how many decisions pulled. ``tiers``: every node has a host and a
    disk tier, some of the stream's prefixes in them; ``out``: gets every decision's target."""
    rng = random.Random(7)
    routing = RoutingConfig(policy=policy, kv_link_gbps=link_gbps, kv_pull_force=force)
    sizes = {"host_kv_tokens": HOST_BLOCKS * BS, "disk_kv_tokens": DISK_BLOCKS * BS} if tiers else {}
    cluster = Cluster(SimConfig.for_node(routing, nodes=NODES, block_size=BS, seed=3, **sizes))
    layout = SIM_KV_LAYOUT if link_gbps > 0 else ""
    assert cluster.kv_layout == layout
    mesh = Mesh(cluster, rng, layout)
    cluster.view = mesh.model
    mesh.model.start(
        MeshParts(cluster.loop, cluster.node_ids, cluster.engines, lambda: False, cluster.in_transit, layout)
    )
    cluster.routers = [cluster._router(j) for j in range(NODES)]  # what Cluster.run does
    nodes = [node_router(cluster, j, routing, mesh.view, layout) for j in range(NODES)]

    # Conversations of a few turns each (the simulator's own block space): every turn extends the one before.
    prompts: list[SimRequest] = []
    for e in range(8):
        stream = Stream(cluster.space, e)
        prompts += [stream.request(len(prompts), 0.0, f"k{e}", rng.randrange(2, 5) * BS + rng.randrange(BS), 8, "")
                    for _ in range(5)]
    for j in range(NODES):  # each peer already holds a few of them, and reports a load
        held = rng.sample(prompts, 6)
        for r in held:
            cluster.engines[j].cache.index.apply(
                BlockStored(tuple(r.chain[: r.n_prompt_blocks]), None,
                            cluster.space.token_array(r.cids[: r.n_prompt_blocks]), BS)
            )
        blocks = {h for r in held for h in r.chain[: rng.randrange(1, r.n_prompt_blocks + 1)]}
        load = NodeLoad(
            running=rng.randrange(6), waiting=rng.randrange(3), kv_usage=round(rng.random(), 3),
            prefill_backlog_tokens=rng.randrange(4000),
        )
        mesh.report(j, blocks, load)
        if tiers:  # some prefixes in its tiers too (prefix-closed, as LRU keeps them): the host's, and deeper on disk
            node_tiers = cluster.engines[j].cache.tiers
            assert node_tiers is not None and node_tiers.disk is not None
            host = list(dict.fromkeys(h for r in rng.sample(prompts, 8) for h in r.chain[: rng.randrange(2, 6)]))
            disk = list(dict.fromkeys(h for r in rng.sample(prompts, 8) for h in r.chain[: rng.randrange(3, 7)]))
            node_tiers.host.insert(host)
            node_tiers.disk.insert(disk)
            mesh.report_tier(j, Medium.HOST, host)
            mesh.report_tier(j, Medium.DISK, disk)
    if get_spec(policy).reads.plan:
        plan = Plan(1, cluster.node_ids[0], 0.0, 10.0, {"k1": ("n02", "n04"), "k3": ("n05",)},
                    {"k1": 5.0, "k3": 2.0}, {nid: 1.0 for nid in cluster.node_ids}, 3.0, 30.0)
        for router in (*cluster.routers, *nodes):
            router.plan = plan

    decisions: list[tuple[str, ...]] = []
    cluster.decisions = []
    for i in range(300):
        cluster.loop.now += 0.05  # 15 s in all: speculative entries expire, the node's table re-reads its peers
        if i == 150:  # a load report arrives mid-stream: in-flight counts restart from it on both sides
            mesh.report(2, mesh.blocks[2], NodeLoad(running=9, waiting=4, kv_usage=0.5, prefill_backlog_tokens=30_000))
        r = rng.choice(prompts)
        key = r.key if rng.random() < 0.5 else ""  # a client-given key, or the one the router derives
        request = SimRequest(1000 + i, cluster.loop.now, key, r.prompt_tokens, r.output_tokens, r.chain, r.cids, BS)
        ing = rng.randrange(NODES)
        route = nodes[ing].route_blocks(
            RouteQuery(
                tuple(request.chain[: request.n_prompt_blocks]), request.prompt_tokens, request.output_tokens,
                request.key, f"{cluster._id_prefix}{request.rid}",
            )
        )
        cluster._rand = lambda ing=ing: (ing + 0.5) / NODES
        cluster._arrive(request)
        nodes[ing].begin(route, route.decision.target)
        decisions.append(route.decision.ranked)
        assert cluster.decisions[-1].ranked == route.decision.ranked, (i, policy)
        assert cluster.decisions[-1].pull == route.decision.pull, (i, policy)
        assert cluster.decisions[-1].est_match_blocks == route.decision.est_match_blocks, (i, policy)
    targets = {d[0] for d in decisions}
    assert len(targets) > 1  # the stream exercised real choices, not one constant answer
    if out is not None:
        out += [d[0] for d in decisions]
    return sum(d.pull is not None for d in cluster.decisions)


@pytest.mark.parametrize("policy", ["p2p", "cacheroute"])
@pytest.mark.parametrize("mode", ["exact", "approximate"])
def test_requests_with_segments_are_routed_alike(policy: str, mode: str) -> None:
    """RAG prompts naming their documents: some nodes' stores hold some documents (gossiped keys) and some nodes'
    caches hold laid-out chains of them (prefix summaries); both sides choose the same targets, by the segments."""
    rng = random.Random(11)
    routing = RoutingConfig(policy=policy)
    cluster = Cluster(SimConfig.for_node(routing, nodes=NODES, block_size=BS, seed=5, segments=mode))
    mesh = Mesh(cluster, rng)
    cluster.view = mesh.model
    mesh.model.start(MeshParts(cluster.loop, cluster.node_ids, cluster.engines, lambda: False, cluster.in_transit))
    cluster.routers = [cluster._router(j) for j in range(NODES)]
    nodes = [node_router(cluster, j, routing, mesh.view) for j in range(NODES)]
    rag = Rag()
    docs = [Piece("doc", d, rng.randrange(40, 200)) for d in range(10)]
    for j in range(NODES):
        held = rng.sample(docs, 3)
        chain_tokens = [t for d in held for t in d.token_ids()]  # a laid-out chain of three documents
        chain = block_hashes(chain_tokens, BS)
        index = cluster.engines[j].cache.index
        index.apply(BlockStored(tuple(chain), None, tuple(chain_tokens[: len(chain) * BS]), BS))
        keys = set()
        store = cluster.engines[j].segments.store  # type: ignore[union-attr]
        for d in rng.sample(docs, 3) if store is not None else ():
            tokens = d.token_ids()
            key = rag.key_of(d, tokens)
            store.admit(key, tokens, 0)
            keys.add(key)
        load = NodeLoad(running=rng.randrange(6), waiting=rng.randrange(3), kv_usage=0.2,
                        prefill_backlog_tokens=rng.randrange(3000))
        mesh.report(j, set(chain[: rng.randrange(1, len(chain) + 1)]), load, keys if mode == "approximate" else None)

    decisions = []
    cluster.decisions = []
    for i in range(120):
        cluster.loop.now += 0.05
        context = Piece("system", rng.randrange(3), 50) if rng.random() < 0.5 else Piece("history", i, 70)
        picked = rng.sample(docs, rng.randrange(2, 5))
        prompt = RagPrompt(cluster.loop.now, (context, *picked, Piece("question", 1000 + i, 20),
                                              Piece("answer", 2000 + i, 8)), "rag")
        request = rag.request(100 + i, prompt, BS)
        seg = request.segments
        assert seg is not None
        seg.mode = SegmentReuse(mode)
        ing = rng.randrange(NODES)
        route = nodes[ing].route_blocks(
            RouteQuery(
                tuple(request.chain[: request.n_prompt_blocks]), request.prompt_tokens, request.output_tokens, "",
                f"{cluster._id_prefix}{request.rid}", segments=seg.spans_for_routing(), tokens=list(seg.tokens),
            )
        )
        cluster._rand = lambda ing=ing: (ing + 0.5) / NODES
        cluster._arrive(request)
        nodes[ing].begin(route, route.decision.target)
        decisions.append(route)
        assert cluster.decisions[-1].ranked == route.decision.ranked, (i, policy, mode)
    assert len({r.decision.target for r in decisions}) > 1
    assert sum(bool(r.segment_estimates) for r in decisions) > 60  # most requests found some segment somewhere
