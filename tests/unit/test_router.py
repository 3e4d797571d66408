"""The ingress router: the sparse candidate set decides like the policy over every peer, the retry order covers
every alive peer once, in-flight sends and speculative placements count, and a warm key reaches its planned
destination even when it is neither touched nor among the least loaded (the speculative index itself:
test_speculative.py).
"""

from __future__ import annotations

import dataclasses
import random

import msgpack
import pytest

from p2pnode.cache.block_hash import block_hashes, token_buffer
from p2pnode.cache.namespace import CacheNamespace
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.summary import SUMMARY_META_KEY, SummaryMeta, encode_meta
from p2pnode.cache.summary_log import SummaryWriter, summary_key
from p2pnode.gossip import GossipConfig, SimClock
from p2pnode.gossip.keys import ADDRESS_KEY
from p2pnode.gossip.membership import Membership
from p2pnode.gossip.state import ClusterState
from p2pnode.load import LOAD_KEY, WIRE_FIELDS, NodeLoad, encode_load
from p2pnode.plan.plan import Plan
from p2pnode.request import SamplingOptions
from p2pnode.routing import candidates
from p2pnode.routing import router as router_module
from p2pnode.routing.candidates import LEAST_LOADED_CANDIDATES
from p2pnode.routing.cluster_view import ClusterView
from p2pnode.routing.ledger import InFlightLedger
from p2pnode.routing.policies import get_spec
from p2pnode.routing.router import Route, Router
from p2pnode.routing.speculative import SpeculativeIndex
from tests.requests import admitted

BS = 16
STRIDE = 4


class Mesh:
    """A ClusterView of ``peers`` peers with random loads; each document cached (a random prefix) by some peers."""

    def __init__(
        self, peers: int, docs: list[list[int]], rng: random.Random, holders: int, max_load: int = 8, shared: int = 0
    ):
        self.clock = SimClock()
        config = GossipConfig(cluster_secret=b"s" * 32)
        self.membership = Membership("self", config)
        self.view = ClusterView(ClusterState("self", 1), self.membership, self.clock, block_size=BS)
        self.ids = [f"p{p:03d}" for p in range(peers)]
        for p, node in enumerate(self.ids):
            self.view.on_node_added(node, 1)
            self.membership.on_node(node, 1, 0.0)
            self.view.on_key_changed(node, ADDRESS_KEY, f"10.0.0.{p}:1".encode())
            load = NodeLoad(running=rng.randrange(max_load), waiting=rng.randrange(3), kv_usage=rng.random())
            self.view.on_key_changed(node, LOAD_KEY, encode_load(load))
            self.view.on_key_changed(node, SUMMARY_META_KEY, encode_meta(SummaryMeta(STRIDE, BS)))
            published = []
            for c, doc in enumerate(docs):
                for d in range(STRIDE, shared + 1, STRIDE):  # the first ``shared`` blocks are cached mesh-wide
                    published.append(block_hashes(doc, BS)[d - 1])
                if (p + c) % peers < holders:
                    chain = block_hashes(doc, BS)
                    for d in range(STRIDE, rng.randrange(0, len(chain) + 1) + 1, STRIDE):
                        published.append(chain[d - 1])
            for key, value in SummaryWriter().update([summary_key(h) for h in published], []):
                self.view.on_key_changed(node, key, value)

    def router(self, policy: str, *, sparse: bool, local: NodeLoad | None = None) -> Router:
        """The policy's router; ``sparse`` False hands it every peer, whatever its spec allows."""
        load = local or NodeLoad(running=3, waiting=1)
        spec = get_spec(policy)
        if not sparse:
            reads_of = spec.reads_of
            spec = dataclasses.replace(spec, reads_of=lambda p: dataclasses.replace(reads_of(p), sparse=False))
        return Router("self", "127.0.0.1:1", PrefixIndex(block_size=BS), lambda: load, self.view, spec,
                      clock=self.clock.now, speculative=SpeculativeIndex())


def docs_for(rng: random.Random, n: int = 6, tokens: int = 512) -> list[list[int]]:
    return [[rng.randrange(3, 500) for _ in range(tokens)] for _ in range(n)]


def key_of(route: Route, loads: dict[str, int]) -> tuple[int, int]:
    """What a policy's choice is made of: the target's estimated match and its load."""
    target = route.decision.target
    return route.estimates.get(target, 0), loads[target]


@pytest.mark.parametrize("policy", ["p2p", "flat"])
@pytest.mark.parametrize(("holders", "shared"), [(0, 0), (3, 0), (40, 0), (3, 8), (40, 8)])
def test_sparse_candidates_choose_what_the_full_view_chooses(policy: str, holders: int, shared: int) -> None:
    """Same target up to ties: the chosen peer's (estimate, load) is the one the policy picks seeing every peer.
    ``shared``: blocks every peer caches (a system prompt cached mesh-wide)."""
    rng = random.Random(holders)
    docs = docs_for(rng)
    mesh = Mesh(40, docs, rng, holders, shared=shared)
    sparse, full = mesh.router(policy, sparse=True), mesh.router(policy, sparse=False)
    loads = {p.node_id: p.load.running + p.load.waiting for p in mesh.view.peers() if p.load is not None}
    loads["self"] = 4
    for i in range(200):
        doc = docs[i % len(docs)][: rng.randrange(BS, 512)]
        a, b = sparse.route(admitted(doc, "", 8, f"r{i}")), full.route(admitted(doc, "", 8, f"r{i}"))
        assert key_of(a, loads) == key_of(b, loads), (i, a.decision, b.decision)
        assert a.estimates == {k: v for k, v in b.estimates.items() if v or k == "self"}


@pytest.mark.parametrize("salt", ["", "tenant-a"])
def test_a_prompt_kept_in_its_wire_bytes_routes_as_its_token_list(salt: str) -> None:
    """A client's token ids are read from the wire with their bytes (``Request.packed_tokens``), and the router hashes
    those instead of the list: the same estimates and target for every prompt (in a salted namespace too). A copy
    with other tokens (a migration's continuation, an exact-mode layout) drops the bytes of the old ones."""
    rng = random.Random(3)
    docs = docs_for(rng)
    mesh = Mesh(20, docs, rng, holders=4)
    namespace = CacheNamespace("", salt)
    for i in range(60):
        doc = docs[i % len(docs)][: rng.randrange(BS, 512)]
        plain = admitted(doc, "", 8, f"r{i}", namespace=namespace)
        packed = dataclasses.replace(plain, packed_tokens=bytes(token_buffer(doc)))
        a, b = mesh.router("p2p", sparse=True).route(plain), mesh.router("p2p", sparse=True).route(packed)
        assert (a.estimates, a.decision.target) == (b.estimates, b.decision.target)
    # the bytes are what is hashed: another document's, of the prompt's length, route as that document
    doc, other = docs[0], docs[1]
    swapped = admitted(doc, "", 8, "s", namespace=namespace, packed_tokens=bytes(token_buffer(other)))
    expected = mesh.router("p2p", sparse=True).route(admitted(other, "", 8, "s", namespace=namespace))
    assert mesh.router("p2p", sparse=True).route(swapped).estimates == expected.estimates
    assert swapped.with_tokens(doc).packed_tokens is None
    assert mesh.router("p2p", sparse=True).route(swapped.with_tokens(doc)).estimates == (
        mesh.router("p2p", sparse=True).route(admitted(doc, "", 8, "s", namespace=namespace)).estimates
    )


@pytest.mark.parametrize("holders", [0, 5])
def test_retry_order_holds_every_alive_peer_once(holders: int) -> None:
    rng = random.Random(7)
    docs = docs_for(rng)
    mesh = Mesh(30, docs, rng, holders)
    mesh.membership.on_node("p005", 1, 0.0)
    router = mesh.router("p2p", sparse=True)
    for i in range(20):
        ranked = router.route(admitted(docs[i % len(docs)], "", 8, f"r{i}")).decision.ranked
        assert sorted(ranked) == sorted(["self", *mesh.ids])
    # The candidates the policy saw come first: at most touched + least loaded + self, then the rest by load.
    assert len(set(ranked[: LEAST_LOADED_CANDIDATES + 1 + holders])) == LEAST_LOADED_CANDIDATES + 1 + holders


def test_in_flight_sends_count_against_a_peer_in_both_modes() -> None:
    """A burst from one ingress spreads: each send raises the target's load until gossip reports it."""
    rng = random.Random(3)
    mesh = Mesh(10, docs_for(rng), rng, holders=0, max_load=1)  # every peer idle-ish: loads 0 + waiting 0..2
    for sparse in (True, False):
        router = mesh.router("flat", sparse=sparse, local=NodeLoad(running=50))
        targets = []
        for i in range(30):
            route = router.route(admitted([1] * 40, "k", 8, f"b{i}"))
            targets.append(route.decision.target)
            router.begin(route, route.decision.target)
        counts = {t: targets.count(t) for t in set(targets)}
        assert len(counts) == 10 and max(counts.values()) - min(counts.values()) <= 3, counts


@pytest.mark.parametrize("policy", ["p2p", "cacheroute"])
@pytest.mark.parametrize(("holders", "shared"), [(80, 0), (80, 8), (3, 8)])
def test_speculative_raises_decide_as_the_estimates_sorted_do(policy: str, holders: int, shared: int) -> None:
    """A busy ingress: prompts just sent to several peers (whole and cut short, some expired), over 80 peers whose
    estimates the view keeps by depth (a mesh-wide level where ``shared``). The raised peers moved within the levels
    give the decisions -- targets, retry orders, estimates -- of a router that sorts every estimate instead."""
    rng = random.Random(holders + shared)
    docs = docs_for(rng)
    mesh = Mesh(80, docs, rng, holders, shared=shared)
    by_levels, by_sort = mesh.router(policy, sparse=True), mesh.router(policy, sparse=True)
    by_sort._estimate_levels = None  # the directory's estimates as a dict, no levels
    raised = 0
    for i in range(300):
        doc = docs[i % len(docs)][: rng.randrange(BS, 512)]
        if i % 3 == 0:
            chain = block_hashes(doc, BS)
            cut = rng.choice([len(chain), rng.randrange(1, len(chain) + 1)])
            for router in (by_levels, by_sort):
                router.speculative.record(random.Random(i).choice(mesh.ids), chain[:cut], mesh.clock.now())
        a, b = by_levels.route(admitted(doc, "", 8, f"r{i}")), by_sort.route(admitted(doc, "", 8, f"r{i}"))
        assert a.decision == b.decision, i
        assert dict(a.estimates) == dict(b.estimates), i
        raised += any(v > by_levels.directory.estimate_matches(a.block_hashes).get(k, 0)
                      for k, v in a.estimates.items() if k != "self")
        mesh.clock.advance(0.05)  # 15 s in all: placements expire as others come
    assert raised > 50


def test_a_routers_speculative_index_holds_what_its_ttl_covers_not_what_its_bound_allows() -> None:
    """Forwards go on for longer than the index's TTL: what expired is dropped as new sends are recorded, so the
    index holds about a TTL's worth of blocks (it grew to its size bound before)."""
    rng = random.Random(3)
    docs = docs_for(rng, n=40)
    mesh = Mesh(8, docs, rng, 0)
    router = mesh.router("p2p", sparse=True)
    ttl = router.speculative.ttl_s
    held = []
    for i in range(200):  # 4 sends a second for 50 s: 10 TTLs
        route = router.route(admitted(docs[i % len(docs)], "", 8, f"r{i}"))
        target = next(n for n in route.decision.ranked if n != "self")
        router.end(target, router.begin(route, target))
        held.append(len(router.speculative))
        mesh.clock.advance(0.25)
    per_send = len(block_hashes(docs[0], BS))
    assert max(held[-40:]) <= (ttl / 0.25 + 1) * per_send  # a TTL's sends at most
    assert max(held[-40:]) < sum(held[-40:]) / 40 * 1.5 and held[-1] > 0


def test_speculative_placement_co_locates_a_burst() -> None:
    """A new prefix routed to a peer is matched there by the next request, before gossip says so."""
    rng = random.Random(4)
    mesh = Mesh(20, docs_for(rng), rng, holders=0)
    router = mesh.router("p2p", sparse=True, local=NodeLoad(running=50))
    doc = [rng.randrange(3, 500) for _ in range(256)]
    first = router.route(admitted(doc, "", 8, "a"))
    router.begin(first, first.decision.target)
    second = router.route(admitted(doc + [7] * 32, "", 8, "b"))
    assert second.decision.target == first.decision.target
    assert second.estimates[first.decision.target] == 256 // BS


def test_warm_key_reaches_its_planned_destination_when_untouched() -> None:
    rng = random.Random(5)
    mesh = Mesh(30, docs_for(rng), rng, holders=0)
    router = mesh.router("cacheroute", sparse=True, local=NodeLoad(running=50))
    busiest = max(mesh.view.peers(), key=lambda p: p.load.running + p.load.waiting).node_id
    router.plan = Plan(1, "self", 0.0, 10.0, {"hot": (busiest,)}, {"hot": 1.0}, {busiest: 1.0})
    assert router.route(admitted([1] * 64, "hot", 8, "w")).decision.target == busiest
    assert router.route(admitted([1] * 64, "cold", 8, "c")).decision.target != busiest


def test_a_route_names_the_plan_and_destinations_it_followed() -> None:
    """What the final message reports (``GenerateFinal.plan_*``): the plan in force, and the key's destinations only
    when the policy routed by them -- not for a cold key, nor under a plan whose gate turned affinity off."""
    rng = random.Random(6)
    mesh = Mesh(8, docs_for(rng), rng, holders=0)
    router = mesh.router("cacheroute", sparse=True)
    none = router.route(admitted([1] * 64, "hot", 8, "n"))
    assert (none.plan_epoch, none.plan_planner, none.plan_destinations) == (0, "", ())
    router.plan = Plan(7, "p001", 0.0, 10.0, {"hot": ("p002", "p005")}, {"hot": 2.0}, {"p002": 1.0, "p005": 1.0})
    warm = router.route(admitted([1] * 64, "hot", 8, "w"))
    assert (warm.plan_epoch, warm.plan_planner, warm.plan_destinations) == (7, "p001", ("p002", "p005"))
    assert warm.decision.target in warm.plan_destinations
    assert router.route(admitted([1] * 64, "cold", 8, "c")).plan_destinations == ()
    router.plan = dataclasses.replace(router.plan, affinity=False)
    off = router.route(admitted([1] * 64, "hot", 8, "o"))
    assert (off.plan_epoch, off.plan_destinations) == (7, ())


def test_sends_count_until_a_newer_load_arrives() -> None:
    """In-flight sends are the router's own correction to a stale load: counted until the peer's next load value."""
    rng = random.Random(6)
    mesh = Mesh(2, [], rng, holders=0, max_load=1)
    for node in mesh.ids:  # both idle
        mesh.view.on_key_changed(node, LOAD_KEY, encode_load(NodeLoad()))
    router = mesh.router("flat", sparse=True, local=NodeLoad(running=50))
    x, y = mesh.ids
    for i, target in enumerate([x, x, x, y, y]):
        router.begin(router.route(admitted([1] * 40, "k", 8, f"s{i}")), target)
    assert router.route(admitted([1] * 40, "k", 8, "probe")).decision.target == y  # 3 sends in flight to x, 2 to y
    mesh.clock.advance(2.0)
    # x reports a load that reflects its sends (here: they finished); y has not reported since.
    mesh.view.on_key_changed(x, LOAD_KEY, encode_load(NodeLoad(running=1)))
    mesh.view.on_key_changed(x, LOAD_KEY, encode_load(NodeLoad()))
    assert router.route(admitted([1] * 40, "k", 8, "after")).decision.target == x


def test_an_urgent_request_skips_a_queue_of_default_priority_work() -> None:
    """A node that holds the prompt but has a long queue of default-priority prefills loses a default request to an
    idle node, while a request of better priority goes to it: it would wait behind none of that queue there
    (vLLM's priority scheduling runs it first)."""
    rng = random.Random(11)
    doc = docs_for(rng, n=1, tokens=1024)[0]
    mesh = Mesh(2, [doc], rng, holders=0)
    chain = block_hashes(doc, BS)
    for key, value in SummaryWriter().update(
        [summary_key(chain[d - 1]) for d in range(STRIDE, len(chain) + 1, STRIDE)], []
    ):
        mesh.view.on_key_changed("p000", key, value)  # p000 holds the whole prompt
    busy = NodeLoad(running=4, waiting=40, prefill_backlog_tokens=200_000, urgent_waiting=0, urgent_backlog_tokens=0)
    mesh.view.on_key_changed("p000", LOAD_KEY, encode_load(busy))
    mesh.view.on_key_changed("p001", LOAD_KEY, encode_load(NodeLoad(prefill_backlog_tokens=0)))
    router = mesh.router("p2p", sparse=False, local=NodeLoad(running=60, waiting=60, prefill_backlog_tokens=900_000))
    urgent = SamplingOptions(8, 1.0, 1.0, 0, priority=-1)
    assert router.route(admitted(doc, "", 8, "default")).decision.target == "p001"
    assert router.route(dataclasses.replace(admitted(doc, "", 8, "urgent"), sampling=urgent)).decision.target == "p000"

    # A node from before the urgent counts (its load value is shorter) is judged by its whole queue.
    old = msgpack.packb([getattr(busy, name) for name in WIRE_FIELDS[: WIRE_FIELDS.index("urgent_waiting")]])
    mesh.view.on_key_changed("p000", LOAD_KEY, old)
    assert router.route(dataclasses.replace(admitted(doc, "", 8, "late"), sampling=urgent)).decision.target == "p001"


class CountingLedger(InFlightLedger):
    """The ledger, counting the peers whose sends a decision reads."""

    __slots__ = ("reads",)

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def since(self, peer: str, since: float) -> tuple[int, int]:
        self.reads += 1
        return super().since(peer, since)


def test_a_busy_ingress_reads_only_its_candidates_sends_for_p2p() -> None:
    """With sends in flight from this ingress to every peer, ``p2p`` (which samples) is handed only its candidates:
    it reads the ledger for a few peers per request, not every peer it sent to, and decides as it would if handed
    them all -- the same target, match and reason; only the retries past its candidates then go by reported load."""
    rng = random.Random(11)
    docs = docs_for(rng)
    mesh = Mesh(40, docs, rng, holders=12)
    lean = mesh.router("p2p", sparse=True)
    spec = get_spec("p2p")
    every = Router("self", "127.0.0.1:1", PrefixIndex(block_size=BS), lambda: NodeLoad(running=3, waiting=1),
                   mesh.view, dataclasses.replace(spec, reads_of=lambda p, r=spec.reads_of: dataclasses.replace(
                       r(p), sends_elsewhere=True)), clock=mesh.clock.now, speculative=SpeculativeIndex())
    lean.ledger = CountingLedger()
    for router in (lean, every):
        router.peer_table(mesh.clock.now())
        for node in mesh.ids:  # a busy ingress: sends since every peer's report
            for _ in range(1 + mesh.ids.index(node) % 3):
                router.ledger.begin(node, mesh.clock.now(), 256)
    for i in range(100):
        doc = docs[i % len(docs)][: rng.randrange(BS, 512)]
        a, b = lean.route(admitted(doc, "", 8, f"r{i}")), every.route(admitted(doc, "", 8, f"r{i}"))
        assert (a.decision.target, a.decision.est_match_blocks, a.decision.reason) == (
            b.decision.target, b.decision.est_match_blocks, b.decision.reason), i
        assert sorted(a.decision.ranked) == sorted(["self", *mesh.ids])
    assert lean.ledger.reads <= 100 * 6  # type: ignore[attr-defined]  # the sample, the home, the drawn holders


def effective_loads(router: Router) -> dict[str, int]:
    """Every alive peer's load with this ingress's sends since its report counted, and this node's: what ``flat``
    handed every peer ranks by."""
    table = router.peer_table(router.clock())
    loads = {"self": router.local_load().requests}  # type: ignore[union-attr]
    for base in table.alive_by_load:
        loads[base.node_id] = base.requests + router.ledger.since(base.node_id, table.reported_at[base.node_id])[0]
    return loads


def test_flat_at_a_busy_ingress_reads_a_few_peers_and_picks_the_least_loaded_with_its_sends() -> None:
    """``flat`` chooses by load alone, its sends counted: handed only the least loaded from an order kept as sends
    come and go (``Reads.load_only``), it reads the ledger for a few peers per request -- not every peer it sent to
    or every holder of the prompt -- and its target carries the least load a router handed every peer sees, with the
    target's own estimate. The sends go through the router and straight into the ledger alike, and a peer's fresh
    report (its sends before it no longer counted) moves it in the order."""
    rng = random.Random(11)
    docs = docs_for(rng)
    mesh = Mesh(40, docs, rng, holders=40, max_load=2)  # every peer holds some, loads tie often
    lean = mesh.router("flat", sparse=True, local=NodeLoad(running=50))
    spec = get_spec("flat")
    every = Router("self", "127.0.0.1:1", PrefixIndex(block_size=BS), lambda: NodeLoad(running=50), mesh.view,
                   dataclasses.replace(spec, reads_of=lambda p, r=spec.reads_of: dataclasses.replace(
                       r(p), load_only=False, sends_elsewhere=True)), clock=mesh.clock.now,
                   speculative=SpeculativeIndex())
    assert lean.by_load is not None and every.by_load is None
    lean.ledger = CountingLedger()
    for router in (lean, every):
        router.peer_table(mesh.clock.now())
        for node in mesh.ids:  # a busy ingress: sends since every peer's report
            for _ in range(mesh.ids.index(node) % 3):
                router.ledger.begin(node, mesh.clock.now(), 256)
    for i in range(200):
        doc = docs[i % len(docs)][: rng.randrange(BS, 512)]
        a, b = lean.route(admitted(doc, "", 8, f"r{i}")), every.route(admitted(doc, "", 8, f"r{i}"))
        loads = effective_loads(every)
        assert loads[a.decision.target] == loads[b.decision.target] == min(loads.values()), i
        assert a.decision.est_match_blocks == b.estimates.get(a.decision.target, 0), i
        assert sorted(a.decision.ranked) == sorted(["self", *mesh.ids])
        if i % 4 == 0:  # a burst goes on through both routers: the next decisions count these sends too
            for router, route in ((lean, a), (every, b)):
                router.begin(route, a.decision.target)
        if i == 100:  # a peer reports: its sends until now are in its load
            mesh.clock.advance(1.0)
            mesh.view.on_key_changed(mesh.ids[5], LOAD_KEY, encode_load(NodeLoad(running=0)))
    assert lean.ledger.reads <= 40 + 200 * 8  # type: ignore[attr-defined]  # a first read of every peer, then a few


@pytest.mark.parametrize("policy", ["p2p", "cacheroute"])
@pytest.mark.parametrize("holders", [3, 40])
def test_an_idle_ingress_hands_what_the_general_assembly_hands(policy: str, holders: int) -> None:
    """At an idle ingress (no send in flight) a request without segments or tiers is assembled in one pass
    (``candidates._assemble_idle``): the same snapshots, in the same order, as the general assembly hands when one
    send is in flight to a peer nothing else touches -- with drawn holders (40 of them) and without (3), with
    speculative placements raising estimates (of peers alive and not), through a plan that names a peer nothing else
    touches and one that is not alive."""
    rng = random.Random(17 + holders)
    docs = docs_for(rng)
    mesh = Mesh(40, docs, rng, holders)
    router = mesh.router(policy, sparse=True)
    handed: list[list[object]] = []
    assemble, one_pass = candidates.assemble, candidates._assemble_idle
    passes = []

    def counted(*args: object) -> candidates.CandidateSet:
        passes.append(1)
        return one_pass(*args)  # type: ignore[arg-type]

    def both(*args: object, **kwargs: object) -> candidates.CandidateSet:
        idle = assemble(*args, **kwargs)
        ledger = InFlightLedger()
        untouched = next(n for n in reversed(mesh.ids) if n not in idle.estimates and not any(
            n in kwargs[k] for k in ("sampled", "planned", "homes")))  # type: ignore[operator]
        ledger.begin(untouched, mesh.clock.now(), 64)
        general = assemble(*args[:3], ledger, **{**kwargs, "sends_elsewhere": False})  # type: ignore[arg-type]
        assert general.snapshots == idle.snapshots
        assert [s.node_id for s in general.snapshots] == [s.node_id for s in idle.snapshots]
        handed.append(idle.snapshots)
        return idle

    router_assemble = router_module.assemble
    router_module.assemble, candidates._assemble_idle = both, counted  # the router's own call, both ways
    try:
        for node in mesh.ids[:2]:  # two peers without an address: known, not alive
            mesh.view.on_key_changed(node, ADDRESS_KEY, None)
        planned = (mesh.ids[-1], mesh.ids[1])
        router.plan = Plan(1, "p001", 0.0, 10.0, {"k": planned}, {"k": 1.0}, dict.fromkeys(planned, 1.0))
        for i in range(120):
            doc = docs[i % len(docs)][: rng.randrange(BS, 512)]
            if i % 5 == 3:  # a speculative placement, on a peer that is not alive every other time
                router.speculative.record(mesh.ids[i % 4], block_hashes(doc, BS), mesh.clock.now())
            router.route(admitted(doc, "k" if i % 7 == 0 else "", 8, f"r{i}"))
    finally:
        router_module.assemble, candidates._assemble_idle = router_assemble, one_pass
    assert len(handed) == 120 and len(passes) == 120  # every request took the one pass
    assert any(len(s) > 4 for s in handed)


def test_the_routers_holders_are_the_ones_p2p_draws_itself() -> None:
    """The holders the router draws for ``p2p`` leave out its other candidates -- this node, the sample and the
    homes -- as ``p2p``'s own draw over every peer does: a home among the deepest holders is not drawn again in place
    of the next holder (it was, which cost ``cacheroute`` 0.681 -> 0.673 KV hit on tool-agent in the simulator)."""
    rng = random.Random(13)
    docs = docs_for(rng, n=12)
    mesh = Mesh(24, docs, rng, holders=24)
    spec = get_spec("p2p")
    asked = []

    drawn = mesh.router("p2p", sparse=True)
    decide = drawn.policy

    def policy(request, peers, plan):  # type: ignore[no-untyped-def]
        asked.append(request)
        return decide(request, peers, plan)

    drawn.policy = policy
    own = Router("self", "127.0.0.1:1", PrefixIndex(block_size=BS), lambda: NodeLoad(running=3, waiting=1), mesh.view,
                 dataclasses.replace(spec, reads_of=lambda p: dataclasses.replace(spec.reads_of(p), holders=0)),
                 clock=mesh.clock.now, speculative=SpeculativeIndex())
    overlaps = 0
    for i in range(600):
        doc = docs[i % len(docs)][: rng.randrange(BS, 512)]
        a, b = drawn.route(admitted(doc, "", 8, f"r{i}")), own.route(admitted(doc, "", 8, f"r{i}"))
        request = asked[-1]
        assert not set(request.holders) & {"self", *request.sampled, *request.homes}
        overlaps += any(h in request.homes for h in drawn._draw_holders(
            {k: v for k, v in a.estimates.items() if k != "self"}, len(request.block_hashes), request.tiebreak,
            request.sampled, drawn.table))
        assert (a.decision.target, a.decision.est_match_blocks) == (b.decision.target, b.decision.est_match_blocks)
    assert overlaps > 0  # homes among the deepest holders: the case is met


def test_cacheroute_with_the_p2p_fallback_reads_only_its_candidates() -> None:
    """``cacheroute`` with its default ``p2p`` fallback is handed what ``p2p`` is (the sample, the home, the holders
    the router draws, a warm key's destinations) and only their sends: at a busy ingress, over warm keys (split by the
    plan), cold keys and a prefix every peer holds, it decides as it did when handed every peer with an estimate (its
    fallback drawing its holders itself), every peer it sent to and the four least loaded -- the same target, match
    and reason -- reading the ledger for a few peers a request, not for every peer it sent to."""
    rng = random.Random(12)
    docs = docs_for(rng)
    mesh = Mesh(40, docs, rng, holders=12, shared=4)
    spec = get_spec("cacheroute")
    old_reads = dataclasses.replace(  # what it read before
        spec.reads_of(spec.defaults), holders=0, least_loaded=LEAST_LOADED_CANDIDATES, sends_elsewhere=True
    )
    lean = mesh.router("cacheroute", sparse=True)
    every = Router("self", "127.0.0.1:1", PrefixIndex(block_size=BS), lambda: NodeLoad(running=3, waiting=1),
                   mesh.view, dataclasses.replace(spec, reads_of=lambda p: old_reads), clock=mesh.clock.now,
                   speculative=SpeculativeIndex())
    lean.ledger = CountingLedger()
    plan = Plan(3, "p001", 0.0, 10.0, {"k0": ("p003", "p007", "p011"), "k1": ("p005",)}, {"k0": 3.0, "k1": 1.0},
                {"p003": 1.0, "p007": 1.0, "p011": 1.0, "p005": 1.0})
    for router in (lean, every):
        router.plan = plan
        router.peer_table(mesh.clock.now())
        for node in mesh.ids:  # a busy ingress: sends since every peer's report
            for _ in range(1 + mesh.ids.index(node) % 3):
                router.ledger.begin(node, mesh.clock.now(), 256)
    reasons = set()
    for i in range(150):
        doc = docs[i % len(docs)][: rng.randrange(BS, 512)]
        key = ("k0", "k1", "", "cold")[i % 4]
        routes = []
        for router in (lean, every):
            route = router.route(admitted(doc, key, 8, f"r{i}"))
            router.begin(route, route.decision.target)  # the plan's split counts this ingress's sends of a key
            routes.append(route)
        a, b = routes
        assert (a.decision.target, a.decision.est_match_blocks, a.decision.reason) == (
            b.decision.target, b.decision.est_match_blocks, b.decision.reason), i
        assert sorted(a.decision.ranked) == sorted(["self", *mesh.ids])
        reasons.add(a.decision.reason.split(":")[0].split(",")[0])
    assert {"warm key", "cold key"} <= reasons
    assert lean.ledger.reads <= 150 * 8  # type: ignore[attr-defined]  # the sample, home, holders, destinations


def test_a_peer_that_refused_a_send_is_no_longer_guessed_to_hold_its_prompts() -> None:
    """The speculative index guesses that a peer holds a prompt just sent to it. A peer that refused the send (it
    drains, its engine is down) kept that guess for the TTL, renewed at every retry: with its load fallen to 0, every
    request of the prompt (30 of 30, one every 0.9 s) tried it first and paid a refused hop. Refused, the guess goes."""
    rng = random.Random(1)
    docs = docs_for(rng, n=1, tokens=1024)
    mesh = Mesh(8, docs, rng, holders=0)
    router = mesh.router("p2p", sparse=True, local=NodeLoad(running=6, waiting=4))
    refused_first: list[int] = []
    draining = None
    for i in range(30):
        route = router.route(admitted(docs[0] + [7, 7, i], "", 8, f"turn{i}"))
        if draining is None:  # where the prompt goes first starts draining: its load falls to 0, it refuses sends
            draining = route.decision.ranked[0]
            mesh.view.on_key_changed(draining, LOAD_KEY, encode_load(NodeLoad(running=0, waiting=0)))
        for target in route.decision.ranked:
            ticket = router.begin(route, target)
            if target != draining:
                router.end(target, ticket)
                break
            refused_first.append(i)
            router.refused(target)  # the ingress, on a failure before any output
            router.end(target, ticket)
        mesh.clock.advance(0.9)
    assert refused_first == [0]


def test_this_node_counts_once_in_the_prefix_a_majority_holds() -> None:
    """A node's directory holds its own gossiped summary beside its peers': the majority count took it as well as
    the node's own match, so in a 3-node mesh a prefix only this node held read as held mesh-wide, and ``p2p`` sent
    the request away from the one node holding it (to an idle peer without it)."""
    bs, stride = 16, 4
    clock = SimClock()
    membership = Membership("self", GossipConfig(cluster_secret=b"s" * 32))
    view = ClusterView(ClusterState("self", 1), membership, clock, block_size=bs)
    doc = [(7 * i) % 500 + 3 for i in range(512)]
    chain = block_hashes(doc, bs)
    busy = NodeLoad(running=6, waiting=1, prefill_backlog_tokens=4000)
    for node in ("self", "p1", "p2"):
        view.on_node_added(node, 1)
        if node != "self":
            membership.on_node(node, 1, 0.0)
        view.on_key_changed(node, ADDRESS_KEY, f"{node}:1".encode())
        load = busy if node == "self" else NodeLoad(running=2, prefill_backlog_tokens=0)
        view.on_key_changed(node, LOAD_KEY, encode_load(load))
        view.on_key_changed(node, SUMMARY_META_KEY, encode_meta(SummaryMeta(stride, bs)))
    keys = [summary_key(chain[d - 1]) for d in range(stride, len(chain) + 1, stride)]
    for key, value in SummaryWriter().update(keys, []):  # only this node caches the document, and gossips it
        view.on_key_changed("self", key, value)
    index = PrefixIndex(block_size=bs)
    index.store_hashed(chain, None)
    assert view.estimate_matches(chain) == {"self": len(chain)}
    assert router_module.common_match({"self": len(chain)}, len(chain), 3, None, "self") == 0
    router = Router("self", "self:1", index, lambda: busy, view, "p2p", clock=clock.now, speculative=SpeculativeIndex())
    route = router.route(admitted(doc, "", 8, "r1"))
    assert route.decision.ranked[0] == "self", route.decision.reason


def test_p2p_what_ifs_take_finite_non_negative_values_and_always_allow_the_cheapest() -> None:
    """``p2p@a0.5`` (an allowance below 1), ``p2p@anan`` and ``p2p@s-20000`` were accepted, and no candidate fell
    within their bound: IndexError, every request INTERNAL."""
    for bad in ("p2p@anan", "p2p@s-20000", "p2p@winf", "chwbl@b-1"):
        with pytest.raises(ValueError, match="finite number >= 0"):
            get_spec(bad)
    rng = random.Random(5)
    mesh = Mesh(2, docs_for(rng, 2, 5000), rng, holders=0)
    route = mesh.router("p2p@a0.5", sparse=True).route(admitted(list(range(3, 5003)), "", 8, "r1"))
    assert sorted(route.decision.ranked) == ["p000", "p001", "self"]


def test_least_loaded_peers_are_found_past_dead_excluded_ones() -> None:
    """A warm key's planned destinations are excluded from the least-loaded draw even when dead (a plan outlives
    them until the next one); the draw took more exclusions than alive peers for "none left" and handed
    ``cacheroute-flat`` no least-loaded peer at all (it then picked a busier node than the full view did)."""
    from p2pnode.routing.policies.types import PeerSnapshot

    rng = random.Random(6)
    mesh = Mesh(3, docs_for(rng, 1), rng, holders=0)
    router = mesh.router("flat", sparse=True)
    table = router.peer_table(mesh.clock.now())
    dead = {f"d{i}": PeerSnapshot(node_id=f"d{i}", alive=False) for i in range(4)}
    found = table.least_loaded(dead, tiebreak=0, count=2)
    assert len(found) == 2 and all(p.node_id in mesh.ids for p in found)
    assert table.least_loaded({p: table.by_id[p] for p in mesh.ids}, tiebreak=0, count=2) == []


def test_a_route_keeps_the_addresses_it_was_decided_with() -> None:
    """A route held the peer table's live address map: a peer forgotten after the decision vanished from it, and a
    retry to that peer was a KeyError (the client got INTERNAL, the other candidates untried)."""
    rng = random.Random(7)
    mesh = Mesh(3, docs_for(rng, 1), rng, holders=0)
    router = mesh.router("flat", sparse=False)
    route = router.route(admitted(list(range(3, 200)), "", 8, "r1"))
    before = dict(route.addresses)
    gone = mesh.ids[0]
    mesh.view.on_node_removed(gone)
    mesh.view.on_key_changed(mesh.ids[1], ADDRESS_KEY, b"10.9.9.9:1")
    router.route(admitted(list(range(3, 200)), "", 8, "r2"))  # the table catches up with the directory
    assert gone not in router.table.addresses and router.table.addresses[mesh.ids[1]] == "10.9.9.9:1"
    assert route.addresses == before and gone in route.addresses
