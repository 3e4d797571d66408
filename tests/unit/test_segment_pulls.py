"""Moving segments between nodes: the serving node pulls a document its store lacks from a peer whose gossiped keys
hold it, when the link figure says moving it costs less than computing it (``routing/segments.segment_pulls``, priced
like a prefix pull); only ``p2p``-family routers pull, only in approximate mode, only between equal KV layouts; in the
simulator the pull runs over the holder's link (``sim/pulls.py``), what moved counts as pulled (not as the node's own
hit), what its holder evicted since is computed, and a pulled segment is not stored twice unless asked."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.segment_summary import segment_state_key
from p2pnode.cache.segments import SegmentReuse, SegmentSpans, segment_key
from p2pnode.cache.summary import SUMMARY_META_KEY, SummaryMeta, encode_meta
from p2pnode.config import RoutingConfig
from p2pnode.cost import get_profile
from p2pnode.engine.simulated.request import PULL_FAILED, PULL_FULL, SimRequest
from p2pnode.gossip import GossipConfig, SimClock
from p2pnode.gossip.keys import ADDRESS_KEY
from p2pnode.gossip.membership import Membership
from p2pnode.gossip.state import ClusterState
from p2pnode.load import LOAD_KEY, NodeLoad, encode_load
from p2pnode.routing.cluster_view import ClusterView
from p2pnode.routing.policies.p2p import PullPrice
from p2pnode.routing.policies.types import PeerSnapshot
from p2pnode.routing.router import Router
from p2pnode.routing.segments import SegmentPull, segment_pulls
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.workloads import Limit, get_workloads
from p2pnode.sim.workloads.rag import Piece, Rag, RagPrompt

PROFILE = get_profile("llama-3.1-8b-h100")
PRICE = PullPrice(PROFILE.kv_bytes_per_token, PROFILE.prefill_s_per_token)
GBPS = 1e9 / 8
BS = 64


def spans(*sizes: int, mode: SegmentReuse = SegmentReuse.APPROXIMATE, recompute: int = 0) -> SegmentSpans:
    """Segments of ``sizes`` tokens back to back after a 100-token context, keyed 1, 2, ..."""
    out, at = [], 100
    for n in sizes:
        out.append((at, at + n))
        at += n
    return SegmentSpans(mode, tuple(out), tuple(range(1, len(sizes) + 1)), recompute)


def peer(node_id: str, gbps: float, running: int = 0, *, alive: bool = True) -> PeerSnapshot:
    return PeerSnapshot(node_id=node_id, alive=alive, load=NodeLoad(running=running), kv_layout="L",
                        link_bytes_per_s=gbps * GBPS)


# --- the price (pure) ---------------------------------------------------------------------------------------------


def test_a_missing_segment_is_pulled_from_its_holder_when_the_link_pays_and_computed_when_it_does_not() -> None:
    seg = spans(1000, 800)
    holders = {"a": [0, 1]}
    fast = segment_pulls(seg, lambda key: key == 2, holders, {"a": peer("a", 100)}, PRICE)
    assert fast == (SegmentPull(0, "a", 1000),)  # the held one (key 2) is loaded here, never pulled
    # 1,000 tokens of 8B KV (131 MB) over 1 Gb/s: ~1 s, against ~4 x 40 ms to compute them
    assert segment_pulls(seg, lambda key: False, holders, {"a": peer("a", 1)}, PRICE) == ()
    assert segment_pulls(seg, lambda key: False, {}, {"a": peer("a", 100)}, PRICE) == ()
    exact = spans(1000, 800, mode=SegmentReuse.EXACT)  # exact reuse is a prefix: p2p's own pulls
    assert segment_pulls(exact, lambda key: False, holders, {"a": peer("a", 100)}, PRICE) == ()


def test_each_segment_comes_from_its_cheapest_holder_and_one_holders_segments_queue_on_its_link() -> None:
    seg = spans(1000, 1000, 1000)
    holders = {"slow": [0, 1, 2], "fast": [0, 1], "dead": [2]}
    peers = {"slow": peer("slow", 25), "fast": peer("fast", 100), "dead": peer("dead", 400, alive=False)}
    pulls = segment_pulls(seg, lambda key: False, holders, peers, PRICE)
    assert pulls == (SegmentPull(0, "fast", 1000), SegmentPull(1, "fast", 1000), SegmentPull(2, "slow", 1000))
    # At 10 Gb/s one segment pays (~105 ms of link against ~4 x 40 ms of prefill), a second behind it on the same
    # link does not: it would arrive only after both.
    alone = segment_pulls(spans(1000, 1000), lambda key: False, {"a": [0, 1]}, {"a": peer("a", 10)}, PRICE)
    assert alone == (SegmentPull(0, "a", 1000),)
    # A segment's recomputed first tokens are computed anyway: a segment no longer than them saves nothing.
    assert segment_pulls(spans(40, recompute=64), lambda key: False, {"a": [0]}, {"a": peer("a", 100)}, PRICE) == ()


def test_a_busy_holder_is_priced_by_its_engine_step() -> None:
    seg = spans(600)
    idle, busy = peer("idle", 100), peer("busy", 100, running=400)
    assert segment_pulls(seg, lambda key: False, {"busy": [0], "idle": [0]}, {"idle": idle, "busy": busy},
                         PRICE) == (SegmentPull(0, "idle", 600),)
    with pytest.raises(ValueError, match="KV bytes"):
        PullPrice(0, 4e-5)


# --- the router as the serving node (over a ClusterView) ----------------------------------------------------------


DOC_A, DOC_B, DOC_C = list(range(10_000, 10_300)), list(range(20_000, 20_250)), list(range(30_000, 30_410))


class Mesh:
    """This node ("me") and peers p1 (layout L) and p2 (another layout), gossip applied by hand."""

    def __init__(self, policy: str = "p2p", link_gbps: float = 100.0, layout: str = "L", force: bool = False) -> None:
        clock = SimClock()
        membership = Membership("me", GossipConfig(cluster_secret=b"s" * 32))
        self.view = ClusterView(ClusterState("me", 1), membership, clock, block_size=16)
        for i, (node, peer_layout) in enumerate((("p1", "L"), ("p2", "M"))):
            self.view.on_node_added(node, 1)
            membership.on_node(node, 1, 0.0)
            self.view.on_key_changed(node, ADDRESS_KEY, f"10.0.0.{i}:1".encode())
            self.view.on_key_changed(node, SUMMARY_META_KEY, encode_meta(SummaryMeta(1, 16, peer_layout)))
            self.view.on_key_changed(node, LOAD_KEY, encode_load(NodeLoad(running=1, prefill_backlog_tokens=0)))
        self.held: set[int] = set()
        self.router = Router.for_node(
            RoutingConfig(policy=policy, kv_link_gbps=link_gbps, kv_pull_force=force), "me", "me:1", PrefixIndex(16),
            lambda: NodeLoad(running=1), self.view, profile=PROFILE, kv_layout=layout,
            local_segments=self.held.__contains__,
        )

    def stores(self, node: str, *docs: list[int]) -> None:
        for doc in docs:
            self.view.on_key_changed(node, segment_state_key(segment_key("", doc)), b"")


def segments_of(*docs: list[int], mode: SegmentReuse = SegmentReuse.APPROXIMATE) -> SegmentSpans:
    out, at = [], 50
    for doc in docs:
        out.append((at, at + len(doc)))
        at += len(doc)
    return SegmentSpans(mode, tuple(out), tuple(segment_key("", d) for d in docs))


def test_the_serving_node_pulls_what_its_store_lacks_from_peers_of_its_layout_only() -> None:
    mesh = Mesh()
    mesh.stores("p1", DOC_A, DOC_C)
    mesh.stores("p2", DOC_B)  # another KV layout: its blocks would be noise here
    mesh.held.add(segment_key("", DOC_C))  # this node's own store holds C
    seg = segments_of(DOC_A, DOC_B, DOC_C)
    assert mesh.router.segment_pulls(seg) == (SegmentPull(0, "p1", len(DOC_A)),)
    assert mesh.router.segment_pulls(dataclasses.replace(seg, mode=SegmentReuse.EXACT)) == ()


def test_the_serving_node_knows_which_segments_any_peer_holds_as_evidence_of_reuse() -> None:
    mesh = Mesh()
    mesh.stores("p1", DOC_A)
    mesh.stores("p2", DOC_C)  # another KV layout: no pull from it, but the mesh computed C
    mesh.stores("me", DOC_B)  # this node's own gossip is not a peer's
    assert mesh.router.segments_held_elsewhere(segments_of(DOC_A, DOC_B, DOC_C)) == {0, 2}
    assert mesh.router.segments_held_elsewhere(segments_of(DOC_B)) == frozenset()


def test_kv_pull_force_pulls_segments_a_slow_link_would_compute_and_names_the_holders_address() -> None:
    priced, forced = Mesh(link_gbps=1e-4), Mesh(link_gbps=1e-4, force=True)
    for mesh in (priced, forced):
        mesh.stores("p1", DOC_A)
    assert priced.router.segment_pulls(segments_of(DOC_A)) == ()
    assert forced.router.segment_pulls(segments_of(DOC_A)) == (SegmentPull(0, "p1", len(DOC_A)),)
    assert forced.router.address_of("p1") == "10.0.0.0:1"  # what the serving node dials for the pull


@pytest.mark.parametrize(("policy", "link", "layout"), [("flat", 100.0, "L"), ("p2p", 0.0, "L"), ("p2p", 100.0, "")])
def test_no_segment_pulls_under_a_baseline_without_a_link_or_without_a_layout(
    policy: str, link: float, layout: str
) -> None:
    mesh = Mesh(policy, link, layout)
    mesh.stores("p1", DOC_A)
    assert mesh.router.segment_pulls(segments_of(DOC_A)) == ()


# --- the simulator: the pull over the holder's link ---------------------------------------------------------------


def doc(d: int) -> Piece:
    return Piece("doc", d, 600 + 37 * d)


def rag_request(rid: int, docs: list[int], cluster: Cluster) -> SimRequest:
    pieces = (Piece("history", 1000 + rid, 200), *(doc(d) for d in docs), Piece("question", 2000 + rid, 40),
              Piece("answer", 3000 + rid, 8))
    prompt = RagPrompt(0.0, pieces, "test")
    r = Rag().request(rid, prompt, BS)
    r.segments.mode = cluster.segment_mode  # type: ignore[union-attr]
    return r


def store(cluster: Cluster, j: int, r: SimRequest, i: int) -> None:
    """Node j's store holds segment i of ``r``, as if a request there had computed it."""
    seg = r.segments
    assert seg is not None
    start, end = seg.spans[i]
    segments = cluster.engines[j].segments
    assert segments is not None and segments.store is not None
    assert segments.store.admit(seg.keys[i], seg.tokens[start:end], start)[0]
    segments.sizes[seg.keys[i]] = end - start


def cluster(**kw: object) -> Cluster:
    cfg = {"nodes": 2, "block_size": BS, "segments": "approximate", **kw}
    c = Cluster(SimConfig(**cfg).with_routing(kv_link_gbps=100.0))  # type: ignore[arg-type]
    c.recorder.keep_rids = True
    c.pulls.observe = None  # type: ignore[union-attr]  # no routers here: the pulls are driven by hand
    return c


def serve_with_pull(c: Cluster, r: SimRequest, asks: dict[int, tuple[int, ...]]) -> None:
    """What ``Cluster._deliver`` does when node 0's router asks these pulls (holder -> segment indices)."""
    r.target = r.ingress = 0
    c.in_transit[0] += 1
    c.pulls.request_segments(r, asks)  # type: ignore[union-attr]
    c.loop.run()
    assert r.t_done >= 0 and c.in_transit == [0, 0]


def test_a_pulled_segment_loads_at_the_target_counts_as_pulled_and_is_not_stored_twice() -> None:
    for store_pulled in (False, True):
        c = cluster(segment_store_pulled=store_pulled)
        r = rag_request(0, [3, 5], c)
        store(c, 1, r, 0)
        serve_with_pull(c, r, {1: (0,)})
        size = 600 + 37 * 3
        assert r.pull_outcome == PULL_FULL and r.segments.pulled == (0,)  # type: ignore[union-attr]
        assert r.loaded_tokens == r.pulled_tokens == size and r.cached_tokens == 0
        assert r.pull_bytes == size * c.profile.kv_bytes_per_token
        link_s = r.pull_bytes / (100.0 * GBPS)
        assert r.pull_s >= link_s + c.pulls.fixed_s  # type: ignore[union-attr]
        here = c.engines[0].segments
        assert here is not None and here.holds(r.segments.keys[1])  # type: ignore[union-attr]  # computed: stored
        assert here.holds(r.segments.keys[0]) is store_pulled  # type: ignore[union-attr]
        s = c.recorder.summary(c.engines, arrived=1, last_arrival=0.0, sim_time=r.t_done, gossip_bytes=0, events=0)
        assert s["pulled_frac"] == pytest.approx(size / r.prompt_tokens)
        assert s["kv_hit"] == pytest.approx(s["kv_hit_local"] + s["pulled_frac"])
        assert s["pull_bytes_per_req"] == r.pull_bytes


def test_a_segment_its_holder_evicted_since_moves_nothing_and_is_computed() -> None:
    c = cluster()
    r = rag_request(0, [3], c)
    serve_with_pull(c, r, {1: (0,)})  # node 1's store does not hold it (any more)
    assert r.pull_outcome == PULL_FAILED and r.pull_bytes == 0 and r.pulled_tokens == r.loaded_tokens == 0
    assert r.pull_s == pytest.approx(c.pulls.fixed_s)  # type: ignore[union-attr]  # the holder answered at once


def test_segments_of_two_holders_move_side_by_side_and_a_holders_pin_holds_until_its_job_ends() -> None:
    c = cluster(nodes=3)
    r = rag_request(0, [3, 5], c)
    store(c, 1, r, 0)
    store(c, 2, r, 1)
    r.target = r.ingress = 0
    c.in_transit[0] += 1
    step = c.engines[1].step_s()  # both holders idle: the same step
    c.pulls.request_segments(r, {1: (0,), 2: (1,)})  # type: ignore[union-attr]
    holder = c.engines[1].segments.store  # type: ignore[union-attr]
    assert holder._entries[r.segments.keys[0]].pins == 1  # type: ignore[union-attr]  # on the link
    c.loop.run()
    assert holder._entries[r.segments.keys[0]].pins == 0  # type: ignore[union-attr]
    assert sorted(r.segments.pulled) == [0, 1] and r.pull_outcome == PULL_FULL  # type: ignore[union-attr]
    fixed = c.pulls.fixed_s  # type: ignore[union-attr]
    longest = max(600 + 37 * 3, 600 + 37 * 5) * c.profile.kv_bytes_per_token / (100.0 * GBPS)
    assert r.pull_s == pytest.approx(fixed + step + longest)  # side by side: the longer one, not both in a row


def run(policy: str, link: float, mode: str = "approximate") -> dict:
    cfg = SimConfig(nodes=4, segments=mode, kv_capacity_tokens=60_000, warmup_s=5.0)
    c = Cluster(cfg.with_routing(policy=policy, kv_link_gbps=link))
    return c.run(get_workloads("rag")[0].requests(8.0, 0, c.space, Limit(max_requests=300)))


def test_a_small_mesh_pulls_segments_and_accounts_for_every_byte() -> None:
    res = run("p2p", 100.0)
    assert res["completed"] == res["requests"] == 300
    assert res["pulled_frac"] > 0 and res["pulls_per_req"] > 0 and res["pull_bytes_per_req"] > 0
    assert res["kv_hit"] == pytest.approx(res["kv_hit_local"] + res["pulled_frac"])
    assert res["kv_hit"] > run("p2p", 0.0)["kv_hit"]


@pytest.mark.parametrize(("policy", "mode"), [("flat", "approximate"), ("p2p", "exact")])
def test_baselines_and_exact_mode_never_pull_segments(policy: str, mode: str) -> None:
    res = run(policy, 100.0, mode)
    assert res["pulled_frac"] == res["pull_bytes_per_req"] == 0
    assert {k: v for k, v in res.items() if k != "events"} == {
        k: v for k, v in run(policy, 0.0, mode).items() if k != "events"
    }


def test_the_serving_node_tells_its_engine_which_segments_a_peer_holds() -> None:
    """With a store threshold above 1 the node hands the peers' holdings to the engine with the request's segments
    (the connector counts each as one offer more); without the hook the segments go as the request named them."""
    from p2pnode.request import Request, SamplingOptions
    from p2pnode.serving.local import LocalHooks, LocalServer, _Job

    seg = segments_of(DOC_A, DOC_B)
    request = Request("r", list(range(50)) + DOC_A + DOC_B, SamplingOptions(8, 0.0, 1.0, 0), segments=seg)
    for hook, told in ((lambda s: frozenset({1}), (1,)), (None, ())):
        hooks = LocalHooks(segments_held_elsewhere=hook)
        server = LocalServer("me", object(), PrefixIndex(16), 4, hooks)  # type: ignore[arg-type]
        job = _Job(server, *server._as_served(request))
        assert asyncio.run(job.pull_segments()) == []
        assert job.served.segments is not None and job.served.segments.held_elsewhere == told
        assert job.served.segments.keys == seg.keys and job.request.segments == seg
