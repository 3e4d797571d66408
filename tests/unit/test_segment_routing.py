"""Segment-aware routing: a node gossips the hot segment keys its engine's store holds (bounded bytes, tombstones,
nothing from an engine without a store), its peers' ClusterView answers which of a request's segments each usable peer
holds, and the router sends a request with segments where they are -- approximate mode by the gossiped keys, exact
mode by what a layout would reuse of the peers' prefix summaries -- while a request without segments routes as before.
"""

from __future__ import annotations

import dataclasses
import random
import zlib

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.events import BlockStored
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.segment_summary import SEGMENT_ENTRY_BYTES, SegmentPublisher, key_segment, segment_state_key
from p2pnode.cache.segments import SegmentReuse, SegmentSpans, segment_key
from p2pnode.cache.summary import SUMMARY_META_KEY, SummaryMeta, encode_meta, hash_key, key_hash
from p2pnode.cache.summary_log import SummaryWriter, summary_key
from p2pnode.config import RoutingConfig
from p2pnode.gossip import GossipAgent, GossipConfig, InMemoryNetwork, MemberState, SimClock
from p2pnode.gossip.keys import ADDRESS_KEY
from p2pnode.gossip.membership import Membership
from p2pnode.gossip.state import ClusterState
from p2pnode.load import LOAD_KEY, NodeLoad, encode_load
from p2pnode.peering import peer
from p2pnode.routing.cluster_view import ClusterView
from p2pnode.routing.policies import get_spec, p2p
from p2pnode.routing.policies.types import PeerSnapshot, RouteRequest
from p2pnode.routing.router import Router
from p2pnode.routing.segments import approximate_estimates, exact_estimates
from tests.requests import admitted

BS = 16
STRIDE = 4


def text(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


DOC_A, DOC_B, DOC_C = text(10_000, 300), text(20_000, 250), text(30_000, 410)


def request(context: list[int], docs: list[list[int]], question: list[int], mode: SegmentReuse) -> tuple:
    """A prompt ``context + docs + question`` and its segments (the documents)."""
    tokens = list(context)
    spans = []
    for doc in docs:
        spans.append((len(tokens), len(tokens) + len(doc)))
        tokens += doc
    tokens += question
    keys = tuple(segment_key("", doc) for doc in docs)
    return tokens, SegmentSpans(mode, tuple(spans), keys)


# --- gossip: what a node publishes and what its peers see --------------------------------------------------------


def test_segment_keys_round_trip_and_the_published_set_is_bounded_by_bytes() -> None:
    rng = random.Random(0)
    for _ in range(100):
        key = rng.getrandbits(63)
        assert key_segment(segment_state_key(key)) == key
        assert key_hash(segment_state_key(key), "h/") is None  # another family's prefix never matches
        assert key_segment(hash_key(key, "h/")) is None
    holdings = {k: 100 for k in range(1, 26)}  # oldest first
    publisher = SegmentPublisher(lambda: holdings, max_bytes=10 * SEGMENT_ENTRY_BYTES)
    added, removed = publisher.poll()
    assert sorted(added) == list(range(16, 26)) and removed == []  # the ten newest
    assert publisher.poll() == ([], [])
    del holdings[25], holdings[3]
    holdings[40] = 7
    added, removed = publisher.poll()
    assert added == [40] and removed == [25] and len(publisher.published) == 10
    assert SegmentPublisher(lambda: holdings, max_bytes=SEGMENT_ENTRY_BYTES - 1).poll() == ([], [])


async def test_peers_see_the_segments_a_node_gossips_until_it_drops_them_or_dies() -> None:
    clock = SimClock()
    net = InMemoryNetwork(clock, seed=1)
    config = GossipConfig(cluster_secret=b"cluster secret for the unit tests")
    held: dict[int, int] = {}
    keys = [segment_key("", doc) for doc in (DOC_A, DOC_B, DOC_C)]
    agents, peerings = [], []
    for i in range(3):
        node_id = f"n{i}"
        agent = GossipAgent(
            config, node_id, f"{node_id}:7000", net.transport(f"{node_id}:7000"), clock, seeds=["n0:7000"],
            rng=random.Random(zlib.crc32(node_id.encode())),
        )
        # n1's engine keeps a store; n2's keeps none (the simulated engine's case): it publishes no segment key
        holdings = (lambda: held) if i == 1 else None
        peerings.append(peer(agent, PrefixIndex(BS), segment_holdings=holdings))
        await agent.start()
        agents.append(agent)
    view = peerings[0].view
    held[keys[0]] = len(DOC_A)
    held[keys[2]] = len(DOC_C)

    def advance_until(done: object, limit: float = 20.0) -> None:
        start = clock.now()
        while not done():  # type: ignore[operator]
            assert clock.now() - start < limit
            clock.advance(0.25)

    advance_until(lambda: view.segment_holders(keys) == {"n1": [0, 2]})
    assert peerings[2].segments is None
    assert not [k for k, _ in agents[2].state.self_node.items() if k.startswith("s/")]
    del held[keys[0]]  # its store evicted document A: a tombstone reaches the peers
    advance_until(lambda: view.segment_holders(keys) == {"n1": [2]})
    await agents[1].stop(leave=False)  # a crash: once dead, its keys no longer count
    advance_until(lambda: view.peer("n1").state is MemberState.DEAD, limit=60.0)  # type: ignore[union-attr]
    assert view.segment_holders(keys) == {}
    for agent in (agents[0], agents[2]):
        await agent.stop(leave=False)


# --- estimates -----------------------------------------------------------------------------------------------------


def test_approximate_estimates_count_the_tokens_of_held_segments_past_their_recompute() -> None:
    _, spans = request(text(5, 40), [DOC_A, DOC_B, DOC_C], text(7, 20), SegmentReuse.APPROXIMATE)
    assert approximate_estimates(spans, {"x": [0, 2], "y": [1], "z": []}) == {"x": 300 + 410, "y": 250}
    epic = dataclasses.replace(spans, recompute=16)
    assert approximate_estimates(epic, {"x": [0, 2]}) == {"x": 300 - 16 + 410 - 16}


def test_exact_estimates_follow_the_deepest_chain_each_node_holds() -> None:
    """x caches the layout [B][A] (then other text), y [C] alone, z holds [A] but its summary is stride-sampled:
    within the slack it still counts as whole and the search goes on from it."""
    tokens, spans = request(text(5, 40), [DOC_A, DOC_B, DOC_C], text(7, 20), SegmentReuse.EXACT)
    caches = {"x": PrefixIndex(BS), "y": PrefixIndex(BS), "z": PrefixIndex(BS)}
    for node, held in (("x", DOC_B + DOC_A + text(9, 64)), ("y", DOC_C), ("z", DOC_A + DOC_C)):
        chain = block_hashes(held, BS)
        caches[node].apply(BlockStored(tuple(chain), None, tuple(held[: len(chain) * BS]), BS))

    def estimate(chain: list[int]) -> dict[str, int]:
        out = {n: index.match_blocks(chain) for n, index in caches.items()}
        out["z"] -= out["z"] % STRIDE  # z's estimate comes from a stride-4 summary
        return {n: m for n, m in out.items() if m}

    got = exact_estimates(tokens, spans, BS, estimate, slack=lambda n: STRIDE - 1 if n == "z" else 0)
    assert got["x"] == (len(DOC_B) + len(DOC_A)) // BS * BS  # the whole chain, to its last full block
    assert got["y"] == len(DOC_C) // BS * BS
    assert got["z"] == (len(DOC_A) + len(DOC_C)) // BS // STRIDE * STRIDE * BS  # found through its slack
    one = exact_estimates(tokens, spans, BS, estimate, max_probes=1)  # bounded: only [A] was tried
    assert one == {"z": len(DOC_A) // BS // STRIDE * STRIDE * BS}


# --- the policy ----------------------------------------------------------------------------------------------------


def snapshot(node_id: str, load: int, segment_tokens: int = 0, match: int = 0, is_self: bool = False) -> PeerSnapshot:
    return PeerSnapshot(
        node_id=node_id, is_self=is_self, load=NodeLoad(running=load, prefill_backlog_tokens=0), cached_blocks=10,
        est_segment_tokens=segment_tokens, est_match_blocks=match,
    )


def test_p2p_prices_a_candidates_segment_tokens_by_mode_and_ignores_them_without_segments() -> None:
    peers = [snapshot("me", 0, is_self=True), snapshot("holder", 3, segment_tokens=4800, match=0),
             snapshot("prefix", 3, match=40)]
    base = RouteRequest(tuple(range(100)), 6400, 64, "k", 64, tiebreak=5, sampled=("holder", "prefix"))
    assert p2p.route(base, peers).target == "prefix"  # no segments: the prefix estimate decides, segments unread
    for mode in (SegmentReuse.EXACT, SegmentReuse.APPROXIMATE):
        with_segments = dataclasses.replace(base, segment_mode=mode)
        assert p2p.route(with_segments, peers).target == "holder"  # 4,800 tokens reused there outweigh its queue
    ignored = get_spec("p2p").variant("p2p@y0")  # approximate segments weighted 0: nothing is worth a queue
    assert ignored(dataclasses.replace(base, segment_mode=SegmentReuse.APPROXIMATE), peers).target == "me"


# --- the router over a ClusterView --------------------------------------------------------------------------------


class View:
    """A node's ClusterView of peers p1..p3 (their gossip applied by hand), and its router."""

    def __init__(self) -> None:
        self.clock = SimClock()
        self.membership = Membership("me", GossipConfig(cluster_secret=b"s" * 32))
        self.view = ClusterView(ClusterState("me", 1), self.membership, self.clock, block_size=BS)
        self.ids = ["p1", "p2", "p3"]
        for i, node in enumerate(self.ids):
            self.view.on_node_added(node, 1)
            self.membership.on_node(node, 1, 0.0)
            self.view.on_key_changed(node, ADDRESS_KEY, f"10.0.0.{i}:1".encode())
            self.view.on_key_changed(node, SUMMARY_META_KEY, encode_meta(SummaryMeta(STRIDE, BS)))
            load = NodeLoad(running=2 + i, waiting=0, kv_usage=0.1, prefill_backlog_tokens=0)
            self.view.on_key_changed(node, LOAD_KEY, encode_load(load))
        self.index = PrefixIndex(BS)
        self.held: set[int] = set()
        self.logs: dict[str, SummaryWriter] = {}
        self.router = Router.for_node(
            RoutingConfig(policy="p2p"), "me", "me:1", self.index, lambda: NodeLoad(running=1), self.view,
            local_segments=self.held.__contains__, summary_stride=STRIDE,
        )

    def caches(self, node: str, tokens: list[int]) -> None:
        """``node``'s summary publishes the stride-sampled chain of ``tokens``."""
        chain = block_hashes(tokens, BS)
        writer = self.logs.setdefault(node, SummaryWriter())
        for key, value in writer.update([summary_key(chain[d - 1]) for d in range(STRIDE, len(chain) + 1, STRIDE)], []):
            self.view.on_key_changed(node, key, value)

    def stores(self, node: str, docs: list[list[int]]) -> None:
        for doc in docs:
            self.view.on_key_changed(node, segment_state_key(segment_key("", doc)), b"")


def test_the_router_sends_a_request_where_its_segments_are_and_one_without_them_by_its_prefix() -> None:
    mesh = View()
    system = text(50_000, 96)
    mesh.caches("p1", system + text(60_000, 64))  # p1 holds the request's system prompt as a prefix
    mesh.stores("p2", [DOC_A, DOC_C])  # p2's store holds two of its documents
    mesh.caches("p3", DOC_B + DOC_A + text(61_000, 32))  # p3's cache holds the layout [B][A]
    tokens, approximate = request(system, [DOC_A, DOC_B, DOC_C], text(70_000, 30), SegmentReuse.APPROXIMATE)
    plain = mesh.router.route(admitted(tokens, "", 64, "r1"))
    assert plain.decision.target == "p1" and plain.segment_estimates is None  # its prefix, as before

    route = mesh.router.route(admitted(tokens, "", 64, "r2", segments=approximate))
    assert route.decision.target == "p2"
    assert route.segment_estimates == {"p2": len(DOC_A) + len(DOC_C)}
    assert route.estimated_tokens("p2") == len(DOC_A) + len(DOC_C)

    exact = dataclasses.replace(approximate, mode=SegmentReuse.EXACT)
    route = mesh.router.route(admitted(tokens, "", 64, "r3", segments=exact))
    assert route.decision.target == "p3"  # what a layout would reuse: [B][A] from p3's prefix summary
    assert route.segment_estimates == {"p3": (len(DOC_B) + len(DOC_A)) // BS // STRIDE * STRIDE * BS}

    mesh.held.update(segment_key("", d) for d in (DOC_A, DOC_B, DOC_C))  # now this node's own store holds all three
    route = mesh.router.route(admitted(tokens, "", 64, "r4", segments=approximate))
    assert route.decision.target == "me" and route.segment_estimates["me"] == 300 + 250 + 410  # type: ignore[index]
