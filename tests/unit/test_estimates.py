"""A request's estimates kept by level (``routing/estimates.py``) read, write and iterate as the dict they stand for,
in its order; the directory hands them out where a level is large, and the router decides and routes the same with
them as with the dict."""

from __future__ import annotations

import random
from unittest import mock

import pytest

from p2pnode.routing import cluster_view
from p2pnode.routing.estimates import LAZY_LEVEL_ABOVE, LevelEstimates, LevelMemo
from tests.scripts import load_script


def random_levels(rng: random.Random) -> list[tuple[int, tuple[str, ...]]]:
    ids = [f"p{i:04d}" for i in range(rng.choice([0, 5, 80, 300]))]
    rng.shuffle(ids)
    levels, depth = [], 200
    while ids:
        size = rng.choice([1, 3, LAZY_LEVEL_ABOVE, LAZY_LEVEL_ABOVE + 1, 150])
        depth -= rng.randrange(1, 9)
        levels.append((depth, tuple(ids[:size])))
        ids = ids[size:]
    return levels


def test_level_estimates_are_the_dict_they_stand_for() -> None:
    """Random levels, some larger than ``LAZY_LEVEL_ABOVE``; random reads and writes (of peers in a level, in the
    overlay or new), then every item: each answer, the length and the items' order are the plain dict's."""
    rng = random.Random(11)
    sets: LevelMemo[frozenset[str]] = LevelMemo(limit=4)  # small: the sets are dropped and rebuilt on the way
    for _ in range(400):
        levels = random_levels(rng)
        small = {node_id: depth for depth, ids in levels if len(ids) <= LAZY_LEVEL_ABOVE for node_id in ids}
        lazy = LevelEstimates(levels, small, sets)
        plain = {node_id: depth for depth, ids in levels for node_id in ids}
        names = [*plain, "new1", "new2", "p9999"]
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


def test_level_memos_are_bounded_and_never_answer_for_another_tuple() -> None:
    sets: LevelMemo[frozenset[str]] = LevelMemo(limit=3)
    held = [tuple(f"n{i}-{j}" for j in range(40)) for i in range(10)]
    for ids in held:
        assert sets.get(ids, frozenset) == frozenset(ids)
        assert len(sets) <= 3
    twin = tuple(held[9])  # equal, another object: its own set
    assert sets.get(twin, frozenset) == frozenset(held[9])


def shared_prefix_router(peers: int, lazy_above: int) -> tuple:
    """bench_forward's router over ``peers`` peers that all cache a quarter of each document, four holders deeper."""
    bench = load_script("bench_forward")
    rng = random.Random(5)
    docs = [[rng.randrange(3, 500) for _ in range(1024)] for _ in range(4)]
    with mock.patch.object(cluster_view, "LAZY_LEVEL_ABOVE", lazy_above):
        router = bench.build_router(peers, docs, rng, 4, 256)
    return bench, router, docs


def test_the_router_decides_the_same_with_level_estimates() -> None:
    """At 200 peers sharing a prefix the directory answers with a LevelEstimates; every decision and every Route's
    estimates are what they are with the plain dict (``LAZY_LEVEL_ABOVE`` past the mesh's size)."""
    from p2pnode.request import Request

    routes = {}
    for lazy_above in (LAZY_LEVEL_ABOVE, 10_000):
        bench, router, docs = shared_prefix_router(200, lazy_above)
        with mock.patch.object(cluster_view, "LAZY_LEVEL_ABOVE", lazy_above):
            chain = Request("x", docs[0], bench.SAMPLING).block_hashes(bench.BS)
            found, _ = router.directory.estimate_levels(chain)
            assert isinstance(found, LevelEstimates) == (lazy_above == LAZY_LEVEL_ABOVE)
            routes[lazy_above] = [router.route(Request(f"r{i}", docs[i % 4], bench.SAMPLING)) for i in range(300)]
    lazy, plain = routes[LAZY_LEVEL_ABOVE], routes[10_000]
    assert [r.decision for r in lazy] == [r.decision for r in plain]
    assert all(isinstance(r.estimates, LevelEstimates) for r in lazy)
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
