"""The per-block loops in C (p2pnode/native/block_loops.c) against their Python definitions (p2pnode/block_loops.py):
the same answers and the same changes to the dicts they walk, over random inputs; and a simulated cache that
gives the same state either way."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from p2pnode import block_loops
from p2pnode.block_loops import PYTHON

native = pytest.importorskip("p2pnode._block_loops")


def _refs(rng: random.Random, blocks: list[int]) -> dict[int, int]:
    """Pin counts of a random part of ``blocks`` (0: evictable), in a random insertion order."""
    held = [h for h in blocks if rng.random() < 0.6]
    rng.shuffle(held)
    return {h: rng.choice((0, 0, 1, 2, 5)) for h in held}


def _chain(rng: random.Random, n: int) -> list[int]:
    """Block hashes across the int sizes a chain holds (64-bit hashes, small ids)."""
    return [rng.choice((rng.getrandbits(64), rng.randrange(1000))) for _ in range(n)]


@pytest.mark.parametrize("seed", range(40))
def test_cache_walks_answer_and_change_the_counts_as_the_python(seed: int) -> None:
    rng = random.Random(seed)
    chain = _chain(rng, rng.randrange(0, 40))
    if rng.random() < 0.3 and chain:
        chain[rng.randrange(len(chain))] = chain[0]  # a hash twice in one chain
    refs = _refs(rng, chain)
    as_tuple = rng.random() < 0.3
    seq = tuple(chain) if as_tuple else chain

    cap = rng.randrange(0, len(chain) + 1)
    py_refs, c_refs = dict(refs), dict(refs)
    assert native.cached_prefix(c_refs, seq, cap) == PYTHON["cached_prefix"](py_refs, seq, cap)

    lo = rng.randrange(0, len(chain) + 1)
    hi = rng.randrange(lo, len(chain) + 1)
    assert native.store_scan(c_refs, seq, lo, hi) == PYTHON["store_scan"](py_refs, seq, lo, hi)
    assert list(c_refs.items()) == list(py_refs.items())  # the same counts, keys added in the same order

    pinned = [h for h in seq[: rng.randrange(0, len(chain) + 1)] if h in py_refs]
    native.pin(c_refs, pinned)
    PYTHON["pin"](py_refs, pinned)
    assert c_refs == py_refs

    # Unpin what is pinned: every block of a prefix whose counts stay >= 0
    n = 0
    left = dict(py_refs)
    while n < len(chain) and left.get(chain[n], 0) > 0:
        left[chain[n]] -= 1
        n += 1
    assert native.unpin(c_refs, seq, n) == PYTHON["unpin"](py_refs, seq, n)
    assert list(c_refs.items()) == list(py_refs.items())


def test_cache_walks_refuse_what_the_python_refuses() -> None:
    with pytest.raises(KeyError):
        native.pin({1: 0}, [1, 2])
    with pytest.raises(KeyError):
        native.unpin({1: 1}, [1, 2], 2)
    with pytest.raises(IndexError):
        native.cached_prefix({1: 0}, [1], 3)
    with pytest.raises(TypeError, match="refs must be a dict"):
        native.cached_prefix([], [1], 1)
    with pytest.raises(TypeError, match="chain must be a list or tuple"):
        native.store_scan({}, iter([1]), 0, 1)
    assert native.unpin({1: 1, 2: 1}, [1, 2], -1) == PYTHON["unpin"]({1: 1, 2: 1}, [1, 2], -1) == [1]


@pytest.mark.parametrize("seed", range(20))
def test_a_queue_changes_in_the_same_order(seed: int) -> None:
    rng = random.Random(seed)
    py_q: OrderedDict[int, None] = OrderedDict()
    c_q: OrderedDict[int, None] = OrderedDict()
    for _ in range(30):
        keys = _chain(rng, rng.randrange(0, 6))
        native.set_none(c_q, keys)
        PYTHON["set_none"](py_q, keys)
        gone = [k for k in py_q if rng.random() < 0.3]
        rng.shuffle(gone)
        native.delete_keys(c_q, gone)
        PYTHON["delete_keys"](py_q, gone)
        assert list(c_q) == list(py_q)
    with pytest.raises(KeyError):
        native.delete_keys(c_q, [-1])
    native.set_none(c_q, (k for k in (7, 8)))  # any iterable
    assert list(c_q)[-2:] == [7, 8]


@pytest.mark.parametrize("nodes", [1, 5, 63, 64, 65, 130])
def test_the_gossip_models_inverted_index_follows_as_the_python(nodes: int) -> None:
    rng = random.Random(nodes)
    ids = [f"n{k}" for k in range(nodes)]
    blocks = _chain(rng, 60)
    py_inv: dict[int, int] = {}
    c_inv: dict[int, int] = {}
    for _ in range(200):
        bit = 1 << rng.randrange(nodes)
        changes = [h if rng.random() < 0.6 else ~h for h in rng.sample(blocks, rng.randrange(0, 10))]
        native.apply_journal(c_inv, bit, changes)
        PYTHON["apply_journal"](py_inv, bit, changes)
        assert list(c_inv.items()) == list(py_inv.items())
        chain = blocks[: rng.randrange(0, 60)] if rng.random() < 0.5 else rng.sample(blocks, 10)
        expected = PYTHON["prefix_depths"](chain, py_inv, ids)
        got = block_loops.prefix_depths(chain, c_inv, ids)
        assert list(got.items()) == list(expected.items())  # the same estimates, in the same order
        if nodes > 64:
            assert native.prefix_depths(chain, c_inv, ids) is NotImplemented


def test_prefix_depths_leaves_masks_it_cannot_read_to_the_python() -> None:
    ids = ["a", "b"]
    assert native.prefix_depths([1], {1: 1 << 5}, ids) is NotImplemented  # a node past ids
    assert native.prefix_depths([1], {1: 1 << 70}, ids) is NotImplemented  # past 64 bits
    assert block_loops.prefix_depths([1, 2], {1: 0b11, 2: 0b01}, ids) == {"b": 1, "a": 2}


def test_a_simulated_run_is_the_same_with_the_python_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small mesh under KV pressure (evictions, concurrent stores, gossip rounds): every figure of its summary and
    every cache's state at the end the same with the C walks and with their Python definitions."""
    from p2pnode.cache.eviction import lru
    from p2pnode.engine.simulated import kvcache
    from p2pnode.sim import staleness
    from p2pnode.sim.cluster import Cluster, SimConfig
    from p2pnode.sim.workloads import Limit, get_workloads

    def run() -> tuple[dict, int, list]:
        workload = get_workloads("cacheroute-aggregate")[0]
        cluster = Cluster(SimConfig(nodes=4, block_size=workload.block_size, kv_capacity_tokens=60_000, seed=3))
        summary = cluster.run(workload.requests(20.0, 3, cluster.space, Limit(max_requests=400)))
        caches = [  # each cache's blocks and counts, its eviction order, its index's blocks and version
            (list(e.cache.refs.items()), list(e.cache.policy._free), list(e.cache.index.iter_blocks()),
             e.cache.index.version)
            for e in cluster.engines
        ]
        return summary, sum(engine.cache.evictions for engine in cluster.engines), caches

    with_c = run()
    assert with_c[1] > 0 and with_c[0]["kv_hit"] > 0  # blocks reused and evicted: every walk ran
    for module, names in (
        (kvcache, ("cached_prefix", "pin", "store_scan", "unpin")),
        (lru, ("delete_keys", "set_none")),
        (staleness, ("apply_journal", "prefix_depths")),
    ):
        for name in names:
            assert getattr(module, name) is not PYTHON[name]
            monkeypatch.setattr(module, name, PYTHON[name])
    assert run() == with_c
