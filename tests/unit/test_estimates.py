"""A request's estimates kept by level and slot (``routing/estimates.py``) read, write and iterate as the dict they
stand for, in its order, also once a slot changed owner; the directory hands them out past ``LAZY_ESTIMATES_ABOVE``
peers, and the router decides and routes the same with them as with the dict."""

from __future__ import annotations

import random
from array import array
from unittest import mock

import pytest

from p2pnode.routing import cluster_view
from p2pnode.routing.estimates import LAZY_ESTIMATES_ABOVE, LevelEstimates
from tests.scripts import load_script


class Slots:
    """``SlotOwners`` as the directory keeps them: a slot per known peer, freed slots taken again."""

    def __init__(self) -> None:
        self.slot_epoch = 0
        self.owners: dict[str, int] = {}

    def slot_of(self, node_id: str) -> int | None:
        return self.owners.get(node_id)

    def move(self, rng: random.Random) -> None:
        """A peer leaves and a new one takes its slot."""
        if self.owners:
            gone = rng.choice(sorted(self.owners))
            self.owners[f"new-{rng.randrange(10**6)}"] = self.owners.pop(gone)
            self.slot_epoch += 1


def random_levels(rng: random.Random, slots: Slots) -> tuple[list[tuple[int, tuple[str, ...]]], array[int]]:
    """Levels of random peers (some known peers in none), and their depths by slot, as the directory's C writes them."""
    known = [f"p{i:04d}" for i in range(rng.choice([0, 5, 80, 300]))]
    order = list(range(len(known) + 3))
    rng.shuffle(order)
    slots.owners = dict(zip(known, order, strict=False))
    ids = [node_id for node_id in known if rng.random() < 0.9]
    rng.shuffle(ids)
    levels, depth = [], 200
    depths = array("I", [0]) * (len(known) + 3)
    while ids:
        size = rng.choice([1, 3, 64, 150])
        depth -= rng.randrange(1, 9)
        levels.append((depth, tuple(ids[:size])))
        for node_id in ids[:size]:
            depths[slots.owners[node_id]] = depth
        ids = ids[size:]
    return levels, depths


def test_level_estimates_are_the_dict_they_stand_for() -> None:
    """Random levels; random reads and writes (of peers in a level, known peers in none, the overlay, new ids), a slot
    changing owner on the way, then every item: each answer, the length and the items' order are the plain dict's."""
    rng = random.Random(11)
    slots = Slots()
    for _ in range(400):
        levels, depths = random_levels(rng, slots)
        lazy = LevelEstimates(levels, depths, slots)
        plain = {node_id: depth for depth, ids in levels for node_id in ids}
        names = [*slots.owners, "new1", "new2", "p9999"]
        for _ in range(rng.randrange(0, 12)):
            node_id = rng.choice(names)
            op = rng.random()
            if op < 0.5:
                assert lazy.get(node_id, 0) == plain.get(node_id, 0)
                assert (node_id in lazy) == (node_id in plain)
            elif op < 0.8:
                value = rng.randrange(1, 300)
                lazy[node_id] = value
                plain[node_id] = value
            elif op < 0.9:
                slots.move(rng)  # the array no longer says whose depth is whose
            else:
                assert len(lazy) == len(plain)
        if rng.random() < 0.5:
            assert list(lazy.items()) == list(plain.items())
            node_id = rng.choice(names)
            lazy[node_id] = plain[node_id] = 7  # a write after the dict is built
        assert len(lazy) == len(plain)
        assert list(lazy.items()) == list(plain.items())
        assert lazy == plain and plain == lazy
        assert dict(lazy.items()) == plain and sorted(lazy) == sorted(plain)
        with pytest.raises(KeyError):
            lazy["absent"]


def test_level_estimates_read_by_slot_until_a_slot_changes_owner() -> None:
    """Reads come from the array while the slots keep their owners (the levels are not searched): a peer whose slot
    another took since is still read at its depth, the newcomer at none."""
    slots = Slots()
    slots.owners = {"a": 0, "b": 1, "c": 2}
    lazy = LevelEstimates([(9, ("a",)), (4, ("b",))], array("I", [9, 4, 0]), slots)
    assert (lazy.get("a"), lazy.get("b"), lazy.get("c")) == (9, 4, None)
    lazy._levels = []  # a read that searched the levels would now miss
    assert lazy.get("a") == 9
    lazy._levels = [(9, ("a",)), (4, ("b",))]
    slots.owners = {"newcomer": 0, "b": 1, "c": 2}
    slots.slot_epoch += 1
    assert (lazy.get("a"), lazy.get("newcomer"), lazy.get("b")) == (9, None, 4)


def spread_router(peers: int, holders: int | None, shared: int) -> tuple:
    """bench_forward's router over ``peers`` peers: ``holders`` of them (None: every one) cache each document to a
    random depth, and every one its first ``shared`` tokens."""
    bench = load_script("bench_forward")
    rng = random.Random(5)
    docs = [[rng.randrange(3, 500) for _ in range(1024)] for _ in range(4)]
    return bench, bench.build_router(peers, docs, rng, holders, shared), docs


@pytest.mark.parametrize(("holders", "shared"), [(4, 256), (None, 0), (4, 0)])
def test_the_router_decides_the_same_with_level_estimates(holders: int | None, shared: int) -> None:
    """At 200 peers (a prefix shared by all, or every peer at its own depth) the directory answers with a
    LevelEstimates, where 4 peers hold some with a dict of them; every decision and every Route's estimates are what
    they are with the plain dict (``LAZY_ESTIMATES_ABOVE`` past the mesh's size)."""
    from p2pnode.request import Request

    routes = {}
    for lazy_above in (LAZY_ESTIMATES_ABOVE, 10_000):
        with mock.patch.object(cluster_view, "LAZY_ESTIMATES_ABOVE", lazy_above):
            bench, router, docs = spread_router(200, holders, shared)
            chain = Request("x", docs[0], bench.SAMPLING).block_hashes(bench.BS)
            found, _ = router.directory.estimate_levels(chain)
            many = holders is None or shared > 0
            assert isinstance(found, LevelEstimates) == (lazy_above == LAZY_ESTIMATES_ABOVE and many)
            routes[lazy_above] = [router.route(Request(f"r{i}", docs[i % 4], bench.SAMPLING)) for i in range(300)]
    lazy, plain = routes[LAZY_ESTIMATES_ABOVE], routes[10_000]
    assert [r.decision for r in lazy] == [r.decision for r in plain]
    assert all(isinstance(r.estimates, LevelEstimates) == many for r in lazy)
    for a, b in zip(lazy, plain, strict=True):
        assert a.estimated_tokens(a.decision.target) == b.estimated_tokens(b.decision.target)
        assert list(a.estimates.items()) == list(b.estimates.items())  # the same dict, in the same order


def test_the_directory_keeps_levels_only_where_every_peer_samples_alike() -> None:
    """100 peers holding the same prefix: with one stride the estimates are a LevelEstimates of the dict's length,
    whose common prefix is the dict's; with two strides (merged levels) a plain dict -- a peer counted once."""
    from p2pnode.cache.block_hash import block_hashes
    from p2pnode.cache.summary import SUMMARY_META_KEY, SummaryMeta, encode_meta
    from p2pnode.cache.summary_log import SummaryWriter, summary_key
    from p2pnode.gossip import GossipConfig, SimClock
    from p2pnode.gossip.membership import Membership
    from p2pnode.gossip.state import ClusterState
    from p2pnode.routing.cluster_view import ClusterView
    from p2pnode.routing.router import common_match

    chain = block_hashes(list(range(3, 3 + 16 * 8)), 16)
    for strides in ((1,), (1, 2)):
        membership = Membership("self", GossipConfig(cluster_secret=b"s" * 32))
        view = ClusterView(ClusterState("self", 1), membership, SimClock(), block_size=16)
        for p in range(100):
            node, stride = f"p{p:03d}", strides[p % len(strides)]
            view.on_node_added(node, 1)
            membership.on_node(node, 1, 0.0)
            view.on_key_changed(node, SUMMARY_META_KEY, encode_meta(SummaryMeta(stride, 16)))
            published = [summary_key(chain[d - 1]) for d in range(stride, 5, stride)]  # 4 blocks each
            for key, value in SummaryWriter().update(published, []):
                view.on_key_changed(node, key, value)
        found, levels = view.estimate_levels(chain)
        plain = view.estimate_matches(chain)
        assert isinstance(found, LevelEstimates) == (strides == (1,))
        assert len(found) == len(plain) == 100 and found == plain
        for nodes in (150, 201, 300):  # 300: a majority the 100 holders are not (a doubled count made them one)
            assert common_match(found, 2, nodes, levels) == common_match(plain, 2, nodes)
        found, _ = view.estimate_levels(chain)
        view.on_node_removed("p007")
        view.on_node_added("newcomer", 1)  # takes p007's slot
        assert view.slot_of("newcomer") == view.slot_of("p008") - 1  # p007's
        assert found.get("p007") == plain["p007"] and "newcomer" not in found and found == plain
