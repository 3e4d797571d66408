"""A KV tier below a peer's engine, as its gossip summary shows it: a summary of its own beside the engine's, each
estimated on its own (the tier's depth rounded down to its stride), never mixed with the engine's, gone with the peer
or its withdrawals; and published end to end through real gossip agents."""

from __future__ import annotations

import functools
import itertools
import operator
import random
from array import array
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.summary import SUMMARY_FAMILIES, SummaryMeta, SummaryPublisher, encode_meta
from p2pnode.cache.tiers import Medium
from p2pnode.gossip.membership import MemberState
from p2pnode.routing import tier_summaries
from p2pnode.routing.mask_table import NATIVE_MASK_TABLE, DictMaskTable, MaskTable
from p2pnode.routing.tier_summaries import deepest_published
from tests.unit.test_gossip_summary import BS, FakeEngine, Owner, make_view, prompt, refresh


def as_table(inverted: dict[int, int], kind: type = MaskTable) -> object:
    """The same index as a ``MaskTable`` (a view's) or its definition: each key's bits set slot by slot."""
    table = kind()
    for key, mask in inverted.items():
        for slot in range(mask.bit_length()):
            if mask >> slot & 1:
                table.set_bits([key], slot)
    return table


#: The indexes ``deepest_published`` reads: a dict (a tier's), the C table (a view's) and its definition.
INDEXES = [dict, as_table, functools.partial(as_table, kind=DictMaskTable)]


class TieredOwner(Owner):
    """An owner whose node also has a host tier, with its own index and summary."""

    def __init__(self, node_id: str, stride: int = 4, cap: int = 8192) -> None:
        super().__init__(node_id, stride, cap)
        self.host_index = PrefixIndex(block_size=BS)
        self.host = FakeEngine(self.host_index, seed=(hash(node_id) + 1) & 0xFFFF)
        self.host_publisher = SummaryPublisher(self.host_index, stride, cap, medium=Medium.HOST)

    def publish(self) -> None:
        super().publish()
        change = self.host_publisher.poll()
        if change is None:
            return
        family = SUMMARY_FAMILIES[Medium.HOST]
        self.state.set(family.meta_key, encode_meta(change.meta), 0.0)
        for key, value in self.host_publisher.log.update(change.added, change.removed):
            if value is None:
                self.state.delete(key, 0.0)
            else:
                self.state.set(key, value, 0.0)


def test_a_tier_is_estimated_apart_from_the_engine() -> None:
    rng = random.Random(3)
    owner = TieredOwner("a", stride=2)
    other = Owner("b", stride=2)  # no tier
    hot, cold = prompt(rng, 8), prompt(rng, 20)
    owner.engine.store(hot)  # in the engine's KV
    owner.host.store(cold)  # evicted there, held in its host tier
    other.engine.store(cold)
    owner.publish()
    other.publish()
    view, _ = make_view([owner, other])
    hot_chain, cold_chain = block_hashes(hot, BS), block_hashes(cold, BS)
    assert view.estimate_matches(hot_chain) == {"a": 8}
    assert view.estimate_tier_matches(hot_chain, Medium.HOST) == {}
    assert view.estimate_matches(cold_chain) == {"b": 20}  # a's tier is not its engine's
    assert view.estimate_tier_matches(cold_chain, Medium.HOST) == {"a": 20}
    assert view.estimate_tier_matches(cold_chain, Medium.DISK) == {}
    assert view.tier_hashes("a", Medium.HOST) == 10 and view.tier_hashes("b", Medium.HOST) == 0
    longer = block_hashes(cold[: 13 * BS] + prompt(rng, 4), BS)
    assert view.estimate_tier_matches(longer, Medium.HOST) == {"a": 12}  # rounded down to its stride


def test_a_tier_estimate_follows_withdrawals_liveness_and_removal() -> None:
    rng = random.Random(4)
    owner = TieredOwner("a", stride=1)
    doc = prompt(rng, 10)
    owner.host.store(doc)
    owner.publish()
    view, membership = make_view([owner])
    chain = block_hashes(doc, BS)
    assert view.tiers_published  # a router asks only then
    assert view.estimate_tier_matches(chain, Medium.HOST) == {"a": 10}
    before = dict(owner.state.self_node.items())
    for depth in range(10, 6, -1):  # the tier evicts the chain's tail
        owner.host.evict_block(doc, depth)
    owner.publish()
    refresh(view, owner, before)
    assert view.estimate_tier_matches(chain, Medium.HOST) == {"a": 6}
    membership.update(1000.0)  # no heartbeats: it is dead
    assert view.peer("a").state is MemberState.DEAD  # type: ignore[union-attr]
    view.on_liveness("a", MemberState.DEAD)
    assert view.estimate_tier_matches(chain, Medium.HOST) == {}
    view.on_node_removed("a")
    assert view.estimate_tier_matches(chain, Medium.HOST) == {}
    assert not view.tiers_published


def test_a_tier_of_another_block_size_is_never_matched() -> None:
    rng = random.Random(5)
    owner = TieredOwner("a", stride=1)
    doc = prompt(rng, 6)
    owner.host.store(doc)
    owner.publish()
    view, _ = make_view([owner])
    chain = block_hashes(doc, BS)
    assert view.estimate_tier_matches(chain, Medium.HOST) == {"a": 6}
    before = dict(owner.state.self_node.items())
    owner.state.set(SUMMARY_FAMILIES[Medium.HOST].meta_key, encode_meta(SummaryMeta(1, BS * 2)), 0.0)
    refresh(view, owner, before)  # its tier's blocks are other prefixes than this node's hashes name
    assert view.estimate_tier_matches(chain, Medium.HOST) == {}


async def test_a_tier_is_published_through_gossip_beside_the_engines_summary() -> None:
    """``peering.peer`` with a host tier: every peer's view learns the tier's blocks under the tier, the engine's
    under the engine, from the agents' own rounds."""
    from p2pnode.peering import peer
    from tests.unit.test_gossip_cluster import Engine, Mesh

    mesh = Mesh()
    agents = await mesh.add_many(4)
    gpu, host = PrefixIndex(block_size=16), PrefixIndex(block_size=16)
    peer(agents[2], gpu, tiers={Medium.HOST: host})
    mesh.run_until(mesh.converged, limit=20.0)
    rng = random.Random(7)
    in_gpu = [rng.randrange(50_000) for _ in range(16 * 8)]  # whole multiples of the default stride
    in_host = [rng.randrange(50_000) for _ in range(16 * 12)]
    Engine(gpu, seed=1).store(in_gpu)
    Engine(host, seed=2).store(in_host)
    gpu_chain, host_chain = block_hashes(in_gpu, 16), block_hashes(in_host, 16)
    others = [a for a in agents if a is not agents[2]]

    def known() -> bool:
        return all(
            mesh.view(a).estimate_tier_matches(host_chain, Medium.HOST) == {"n2": 12}
            and mesh.view(a).estimate_match_blocks("n2", gpu_chain) == 8
            for a in others
        )

    mesh.run_until(known, limit=10.0)
    for a in others:
        view = mesh.view(a)
        assert view.estimate_match_blocks("n2", host_chain) == 0  # the tier's blocks are not the engine's
        assert view.estimate_tier_matches(gpu_chain, Medium.HOST) == {}


@given(
    # a block hash is looked up by its low 32 bits (its summary key): the high bits must not matter
    chain=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3)).map(lambda t: t[0] | t[1] << 40), max_size=48),
    published=st.lists(st.tuples(st.integers(0, 40), st.integers(0, (1 << 70) - 1)), max_size=30),
    groups=st.lists(st.tuples(st.integers(1, 6), st.integers(0, (1 << 70) - 1)), max_size=4),
    grouped=st.booleans(),
    remembered=st.booleans(),
    slots=st.sampled_from([None, 70, 200]),
    named=st.booleans(),
    index=st.sampled_from(INDEXES),
)
def test_the_c_summary_match_is_the_definition(
    chain: list[int],
    published: list[tuple[int, int]],
    groups: list[tuple[int, int]],
    grouped: bool,
    remembered: bool,
    slots: int | None,
    named: bool,
    index: object,
) -> None:
    """``deepest_published`` in C (``_chain.deepest_in``) gives the Python definition's estimates, in its order, and
    its levels; masks past 64 peers (big ints), several strides, ids read from ``known`` or asked of ``ids_of``; with
    ``depths``, an empty answer and each level's depth at its peers' slots instead (where strides do not share a
    peer: the estimate of each peer, as the answer without ``depths`` gives it); with ``slot_ids`` (named here apart
    from ``ids_of``'s, so that the ids show which way a level was named), a level of at most ``DECODE_AT_MOST`` peers
    decoded from them in both; read from a dict, from the C ``MaskTable`` (C against the definition reading it by
    ``get``) and from its definition ``DictMaskTable``."""
    assert NATIVE_MASK_TABLE, "p2pnode.cache._chain was not built: run scripts/bootstrap.sh"
    inverted = index(dict(published))

    def ids_of(mask: int) -> tuple[str, ...]:
        return tuple(f"p{bit}" for bit in range(mask.bit_length()) if mask >> bit & 1)

    known = {mask: ids_of(mask) for _, mask in published[::2]} if remembered else None
    levels_c: list | None = [] if grouped else None
    levels_py: list | None = [] if grouped else None
    assert tier_summaries._native_deepest is not None, "p2pnode.cache._chain was not built: run scripts/bootstrap.sh"
    depths_c, depths_py = (array("I", [0]) * slots, array("I", [0]) * slots) if slots else (None, None)
    slot_ids: list[str | None] | None = [f"s{i}" for i in range(70)] if named else None
    got = deepest_published(chain, groups, inverted, ids_of, levels_c, known, depths_c, slot_ids)
    with mock.patch.object(tier_summaries, "_native_deepest", None):  # the Python loop: the definition
        expected = deepest_published(chain, groups, inverted, ids_of, levels_py, known, depths_py, slot_ids)
    assert list(got.items()) == list(expected.items())
    assert levels_c == levels_py
    assert depths_c == depths_py
    disjoint = sum(m.bit_count() for _, m in groups) == functools.reduce(operator.or_, (m for _, m in groups), 0)
    if depths_c is not None:
        assert got == {}
        if disjoint and not named:  # every estimate, read by its peer's slot
            plain = deepest_published(chain, groups, inverted, ids_of)
            assert {f"p{slot}": d for slot, d in enumerate(depths_c) if d} == plain


def test_depths_take_only_int_bitmasks_within_their_slots() -> None:
    """A bitmask that sets a slot past ``depths`` raises (in C and in the definition) rather than lose an estimate;
    the C takes only an ``array('I')``."""

    def ids_of(mask: int) -> tuple[str, ...]:
        return tuple(f"p{bit}" for bit in range(mask.bit_length()) if mask >> bit & 1)

    for mask in (1 << 5, 1 << 100, 1 << 100 | 1):  # the 64-bit path and the general one
        for native, index in itertools.product((tier_summaries._native_deepest, None), INDEXES):
            depths = array("I", [0]) * 4
            with mock.patch.object(tier_summaries, "_native_deepest", native), pytest.raises(ValueError, match="slot"):
                deepest_published([7], [(1, mask)], index({7: mask}), ids_of, [], None, depths)
            assert not any(depths)  # nothing of the hit written
    with pytest.raises(TypeError, match="array"):
        deepest_published([7], [(1, 2)], {7: 2}, ids_of, [], None, array("H", [0]) * 4)
    wide = array("I", [0]) * 65
    deepest_published([7], [(1, 2**64 + 6)], {7: 2**64 + 6}, ids_of, [], None, wide)
    assert [slot for slot, d in enumerate(wide) if d] == [1, 2, 64]
    depths = array("I", [0]) * 8
    deepest_published([7, 8], [(1, 0b110)], {7: 0b110, 8: 0b100}, ids_of, [], None, depths)
    assert list(depths) == [0, 1, 2, 0, 0, 0, 0, 0]


def test_depths_where_the_c_reads_a_group_twice_or_a_hit_runs_past_them() -> None:
    """A bitmask of another type than int sends a group of up to 64 peers from the machine-word path back to the
    general one: the slots it wrote are put back as they were (an array holding values, a peer of an earlier group),
    none written past the array; a hit past the array raises naming its highest slot, with nothing of it written --
    as the definition. Before, the C zeroed the group's every slot and named the lowest slot past the end."""

    class Int(int):
        pass

    def ids_of(mask: int) -> tuple[str, ...]:
        return tuple(f"p{bit}" for bit in range(mask.bit_length()) if mask >> bit & 1)

    cases = [
        ([0x11, 0x22, 0x33], [(1, 0b111)], {0x33: 1, 0x22: 1, 0x11: Int(1)}, [9, 9, 9, 9]),
        ([0x11, 0x22], [(1, 0b10), (2, 0b11)], {0x11: 0b10, 0x22: Int(0b01)}, [0, 0, 0]),
        ([0x11], [(1, 0b1001)], {0x11: True}, [0, 0]),
        ([0x11], [(1, 0b1100011)], {0x11: 0b1100011}, [0, 0, 0, 0]),
    ]
    for chain, groups, inverted, start in cases:
        seen = []
        for native in (tier_summaries._native_deepest, None):
            depths = array("I", start)
            with mock.patch.object(tier_summaries, "_native_deepest", native):
                try:
                    found: object = deepest_published(chain, groups, inverted, ids_of, [], None, depths)
                except ValueError as e:
                    found = str(e)
            seen.append((found, list(depths)))
        assert seen[0] == seen[1], (groups, seen)


def test_the_c_summary_match_passes_on_an_error_of_ids_of() -> None:
    def ids_of(mask: int) -> tuple[str, ...]:
        raise RuntimeError("boom")

    for index in INDEXES:  # the 64-bit path and (past 64 peers) the general one, on each index
        with pytest.raises(RuntimeError, match="boom"):
            deepest_published([1, 2, 3, 4], [(2, 0b11)], index({2: 0b1, 4: 0b1}), ids_of)
        with pytest.raises(RuntimeError, match="boom"):
            deepest_published([1, 2, 3, 4], [(2, 1 << 100 | 1)], index({2: 1 << 100, 4: 1 << 100}), ids_of)
    with pytest.raises(ValueError, match="stride"):
        deepest_published([1, 2], [(0, 1)], {}, ids_of)
    # a bitmask of another type: the 64-bit path (a mask below 2**64) reads it as the general one does
    assert deepest_published([0x11, 0x22], [(1, 1)], {0x22: "junk"}, ids_of, []) == deepest_published(
        [0x11, 0x22], [(1, 2**64 + 1)], {0x22: "junk"}, ids_of, []
    )


def test_a_views_bitmasks_decode_to_their_peers_as_peers_come_and_go() -> None:
    """``ClusterView._ids_of`` decodes a peer bitmask to its node ids in C (``tier_summaries.ids_at_slots``): the
    same ids, lowest slot first, as the Python definition, while peers join, leave and a newcomer takes a freed slot;
    a bit at a free slot or past every slot raises in both."""
    view, _ = make_view([])
    rng = random.Random(5)
    names = [f"n{i}" for i in range(150)]
    present: list[str] = []
    for step in range(400):
        if present and rng.random() < 0.4:
            view.on_node_removed(present.pop(rng.randrange(len(present))))
        else:
            name = rng.choice([n for n in names if n not in present])
            view.on_node_added(name, 1)
            present.append(name)
        slots = [view.slot_of(n) for n in present]
        mask = sum(1 << s for s in rng.sample(slots, rng.randrange(len(slots) + 1)))  # type: ignore[misc]
        got = view._ids_of(mask)
        with mock.patch.object(tier_summaries, "_native_ids_at_slots", None):
            assert view._ids_of(mask) == got, step
        assert got == tuple(n for _, n in sorted((view.slot_of(n), n) for n in present if mask >> view.slot_of(n) & 1))
    free = next(s for s in range(len(view._by_slot) + 1) if s not in {view.slot_of(n) for n in present})
    for native in (tier_summaries._native_ids_at_slots, None):
        with mock.patch.object(tier_summaries, "_native_ids_at_slots", native):
            for mask in (1 << free, 1 << (len(view._by_slot) + 3)):
                with pytest.raises((TypeError, AttributeError, IndexError)):
                    view._ids_of(mask)
    for native in (tier_summaries._native_ids_at_slots, None):
        with mock.patch.object(tier_summaries, "_native_ids_at_slots", native), pytest.raises(ValueError):
            tier_summaries.ids_at_slots(-1, [])


def test_a_level_of_a_few_peers_is_named_from_the_slots_and_a_large_one_by_ids_of() -> None:
    """With ``slot_ids``, a level of up to ``DECODE_AT_MOST`` peers is decoded from them, a larger one is looked up
    in ``known`` or asked of ``ids_of`` (which a view remembers: a level many peers share recurs) -- in C and in the
    definition, in the 64-bit path and past it; a slot that holds no peer raises in both."""

    def ids_of(mask: int) -> tuple[str, ...]:
        return tuple(f"p{bit}" for bit in range(mask.bit_length()) if mask >> bit & 1)

    slot_ids: list[str | None] = [f"s{i}" for i in range(140)]
    at = tier_summaries.DECODE_AT_MOST
    for offset in (0, 100):  # bits 0..: the machine-word path; bits past 64: the general one
        for size, prefix in ((at, "s"), (at + 1, "p")):
            mask = sum(1 << (offset + 2 * i) for i in range(size))
            for native, index in itertools.product((tier_summaries._native_deepest, None), INDEXES):
                with mock.patch.object(tier_summaries, "_native_deepest", native):
                    got = deepest_published([7], [(1, mask)], index({7: mask}), ids_of, None, None, None, slot_ids)
                assert got == {f"{prefix}{offset + 2 * i}": 1 for i in range(size)}, (offset, size, native, index)
    slot_ids[4] = None
    for native, index in itertools.product((tier_summaries._native_deepest, None), INDEXES):
        with mock.patch.object(tier_summaries, "_native_deepest", native), pytest.raises(TypeError, match="slot 4"):
            deepest_published([7], [(1, 0b10000)], index({7: 0b10000}), ids_of, None, None, None, slot_ids)
