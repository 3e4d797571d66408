"""The ingress's speculative index (``routing/speculative.py``): the C index is its definition under any sequence of
records, lookups, expiries and forgotten peers -- the same answers, the same entries in the same order --, refuses
what it cannot hold without changing anything, and gives its memory back as its entries go. Both are checked against
the plain walk the binary searches replace, and expiry against what expired."""

from __future__ import annotations

import random

import pytest

from p2pnode.cache.block_hash import block_hashes
from p2pnode.config import RoutingConfig
from p2pnode.routing.speculative import NATIVE_SPECULATIVE_INDEX, DictSpeculativeIndex, SpeculativeIndex

BS = 16
IMPLEMENTATIONS = [pytest.param(DictSpeculativeIndex, id="definition")]
if NATIVE_SPECULATIVE_INDEX:
    IMPLEMENTATIONS.append(pytest.param(SpeculativeIndex, id="c"))
native_only = pytest.mark.skipif(not NATIVE_SPECULATIVE_INDEX, reason="p2pnode.routing._speculative was not built")


def chains_of(rng: random.Random, count: int, longest: int) -> list[list[int]]:
    """Chains of 1..``longest`` blocks, some sharing prefixes (one extended by another's blocks)."""
    chains = [block_hashes([rng.randrange(500) for _ in range(rng.randrange(1, longest) * BS)], BS)
              for _ in range(count)]
    chains += [block_hashes(list(range(64)) + [rng.randrange(500) for _ in range(k * BS)], BS)
               for k in range(count // 3)]
    return chains


def walk(index: object, peer: str, chain: list[int], now: float) -> int:
    """The leading blocks ``peer`` holds unexpired, block by block."""
    held = {h: peers for h, _, peers in index.entries()}  # type: ignore[attr-defined]
    n = 0
    for h in chain:
        expiry = held.get(h, {}).get(peer)
        if expiry is None or expiry <= now:
            break
        n += 1
    return n


def test_the_c_index_was_built() -> None:
    """The router's index is the C one wherever the project is installed as its README says."""
    assert NATIVE_SPECULATIVE_INDEX, "p2pnode.routing._speculative was not built: run scripts/bootstrap.sh"


@native_only
@pytest.mark.parametrize("seed", range(6))
def test_the_c_index_is_its_definition_under_any_sequence_of_operations(seed: int) -> None:
    """Records by up to 90 peers (a prefix sent to many: holders past the inline two and the 64 kept on the stack),
    partial chains, a clock that sometimes steps back, expiries whole and a send's, forgotten peers, lookups of chains
    held, partly held and never seen, and a size bound small enough to evict: after every step each answer and the
    whole state (entries in record order, each with its expiry and its peers in order) are the definition's."""
    rng = random.Random(seed)
    bound = rng.choice([50, 300, 2000])
    c, d = SpeculativeIndex(ttl_s=3.0, max_entries=bound), DictSpeculativeIndex(ttl_s=3.0, max_entries=bound)
    chains = chains_of(rng, 30, 40)
    peers = [f"n{i}" for i in range(rng.choice([3, 12, 90]))]
    now = 0.0
    for step in range(1500):
        now += rng.random() * 0.1
        if rng.random() < 0.02:
            now -= rng.random() * 2.0  # a clock stepping back: expiries out of record order
        op = rng.random()
        if op < 0.55:
            chain = rng.choice(chains)
            peer = rng.choice(peers)
            cut = rng.randrange(0, len(chain) + 1)
            for index in (c, d):
                index.record(peer, chain[:cut], now)
        elif op < 0.65:
            at, front_only = now + rng.random() * 2.0, rng.random() < 0.5
            assert c.expire(at, front_only=front_only) == d.expire(at, front_only=front_only)
        elif op < 0.68:
            peer = rng.choice([*peers, "never-seen"])
            c.forget_peer(peer)
            d.forget_peer(peer)
        else:
            probe = rng.choice([*chains, [rng.getrandbits(64) for _ in range(5)], []])
            probe = probe[: rng.randrange(0, len(probe) + 1)] if rng.random() < 0.3 else probe
            assert c.match_all(probe, now) == d.match_all(probe, now)
            assert list(c.match_all(probe, now)) == list(d.match_all(probe, now))  # the holders' order too
            for peer in rng.sample(peers, min(3, len(peers))):
                assert c.match_blocks(peer, probe, now) == d.match_blocks(peer, probe, now)
        if step % 5 == 0 or 0.55 <= op < 0.68:  # the whole state: after every expiry and forget
            assert c.entries() == d.entries()
            assert (len(c), c.in_expiry_order, c.peers) == (len(d), d.in_expiry_order, d.peers)
    assert len(d) > 0 and d.peers > 1


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_binary_searches_find_what_the_walk_finds(implementation: type) -> None:
    """``match_blocks`` and ``match_all`` against the block-by-block walk, through evictions by size and by age."""
    rng = random.Random(9)
    index = implementation(ttl_s=60.0, max_entries=300)
    chains = chains_of(rng, 30, 40)
    peers = ["a", "b", "c"]
    now, evicted = 0.0, 0
    for _ in range(600):
        now += rng.random() * 0.5
        chain = rng.choice(chains)
        index.record(rng.choice(peers), chain[: rng.randrange(1, len(chain) + 1)], now)
        if rng.random() < 0.02:
            index.expire(now)
        evicted += len(index) == index.max_entries
        probe = rng.choice(chains)
        together = index.match_all(probe, now)
        for peer in peers:
            expected = walk(index, peer, probe, now)
            assert index.match_blocks(peer, probe, now) == expected
            assert together.get(peer, 0) == expected
    assert evicted > 100  # the size bound was exercised


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("clock_goes_back", [False, True])
def test_expiry_drops_exactly_the_expired_entries(implementation: type, clock_goes_back: bool) -> None:
    """``expire`` reads only the front run of expired entries while records come in expiry order; whatever the clock,
    a whole call drops every entry whose expiry has passed and nothing else, and a ``front_only`` one (a send's) drops
    only expired entries, all of them while the order holds -- none while it does not, until a whole call finds it
    again."""
    rng = random.Random(11)
    index = implementation(ttl_s=2.0, max_entries=400)
    chains = [block_hashes([rng.randrange(500) for _ in range(rng.randrange(1, 20) * BS)], BS) for _ in range(40)]
    now, dropped_total, out_of_order = 0.0, 0, 0
    for step in range(800):
        now += rng.random() * 0.2
        if clock_goes_back and step % 50 == 25:
            now -= 1.5  # an injected clock stepping back: expiries out of record order
        index.record(rng.choice("abc"), rng.choice(chains), now)
        if rng.random() < 0.1:
            at = now + rng.random() * 3.0
            front_only = rng.random() < 0.5
            in_order = index.in_expiry_order
            out_of_order += not in_order
            before = {h: t for h, t, _ in index.entries()}
            dropped = index.expire(at, front_only=front_only)
            after = {h: t for h, t, _ in index.entries()}
            assert dropped == len(before) - len(after)
            if front_only and not in_order:
                assert after == before
            else:
                assert after == {h: t for h, t in before.items() if t > at}
            dropped_total += dropped
    assert dropped_total > 100
    assert out_of_order > 0 if clock_goes_back else out_of_order == 0
    index.expire(now + 10.0)  # everything expired: in order again, and a send's call drops what expires
    index.record("a", chains[0], now + 20.0)
    assert index.in_expiry_order and index.expire(now + 30.0, front_only=True) == len(chains[0])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_what_cannot_be_held_is_refused_before_anything_changes(implementation: type) -> None:
    """A peer that is not a str, a hash that is not an int or lies outside [0, 2**64): refused naming what, the index
    as it was; lookups of such values find nothing."""
    index = implementation(ttl_s=5.0, max_entries=100)
    index.record("a", [1, 2, 3], 0.0)
    before = index.entries()
    for peer, chain, error, words in [
        (7, [4], TypeError, "peer"),
        ("b", [4, "5"], TypeError, "block_hashes[1]"),
        ("b", [4, 5, -1], OverflowError, "block_hashes[2]"),
        ("b", [4, 1 << 64], OverflowError, "block_hashes[1]"),
    ]:
        with pytest.raises(error, match=words.replace("[", r"\[")):
            index.record(peer, chain, 0.0)
        assert index.entries() == before
    assert index.match_all([-1, 2], 0.0) == {} and index.match_all(["x"], 0.0) == {}
    assert index.match_blocks("a", [1 << 70], 0.0) == 0 and index.match_blocks("zz", [1, 2], 0.0) == 0
    assert index.match_all([1, 2, 3, 1 << 65], 1.0) == {"a": 3}


@native_only
def test_memory_follows_what_is_held() -> None:
    """Filled to its bound then expired: the C index's rows and table shrink back to their floor, and a peer no entry
    holds is no longer known (its slot released for reuse: a mesh that churns through node ids holds only those some
    entry names)."""
    index = SpeculativeIndex(ttl_s=1.0, max_entries=20_000)
    rng = random.Random(3)
    for i in range(400):
        index.record(f"peer-{i}", [rng.getrandbits(64) for _ in range(64)], float(i) / 1000)
    assert len(index) == 20_000 and index.peers < 400
    full = index.nbytes
    assert full > 20_000 * 56
    assert index.expire(10.0) == 20_000
    assert (len(index), index.peers) == (0, 0)
    assert index.nbytes < full / 50  # rows and table at their floor; the peer slots' arrays (24 bytes a slot) stay
    index.record("again", [1, 2], 11.0)
    index.forget_peer("again")
    assert (len(index), index.peers, index.entries()) == (0, 0, [])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_prompt_sent_to_many_peers_is_found_at_each_ones_depth(implementation: type) -> None:
    """A system prompt sent to 200 peers, each with its own continuation of some depth: every peer found at its own
    depth, in the order they were first sent it; a forgotten peer no more."""
    index = implementation(ttl_s=5.0, max_entries=100_000)
    rng = random.Random(5)
    system = [rng.randrange(500) for _ in range(8 * BS)]
    prompt = system + [rng.randrange(500) for _ in range(24 * BS)]
    chain = block_hashes(prompt, BS)
    depths = {f"p{i:03d}": rng.randrange(8, len(chain) + 1) for i in range(200)}
    order = list(depths)
    rng.shuffle(order)
    for peer in order:
        index.record(peer, chain[: depths[peer]], 0.0)
    found = index.match_all(chain, 1.0)
    assert found == depths and list(found) == order
    index.forget_peer(order[0])
    assert index.match_all(chain, 1.0) == {p: depths[p] for p in order[1:]}
    assert index.match_all(chain, 5.0) == {}  # expired at 0 + TTL


@pytest.mark.parametrize("ttl", [float("inf"), float("nan")])
def test_a_ttl_the_index_cannot_hold_is_refused_with_the_configuration(ttl: float) -> None:
    """A node or a simulation configured with an endless TTL fails at its configuration, naming the field, not inside
    the router it builds."""
    with pytest.raises(ValueError, match="speculative_ttl_s"):
        RoutingConfig(speculative_ttl_s=ttl)
    RoutingConfig(speculative_ttl_s=0.0)  # off
