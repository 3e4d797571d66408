"""A node's indexes per medium (``cache/tier_index.py``): events routed by medium, depths as vLLM would reuse them,
and a salted prefix in a tier never a hit for another namespace."""

from __future__ import annotations

import pytest

from p2pnode.cache import tier_index
from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheReset
from p2pnode.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.tier_index import TierIndexes
from p2pnode.cache.tiers import Medium, TierDepths

BS = 4
PROMPT = tuple(range(1, 6 * BS + 2))  # six full blocks and one more token


def stored(engine: tuple[int, ...], first: int, medium: Medium = Medium.GPU, parent: int | None = None,
           namespace: CacheNamespace = DEFAULT_NAMESPACE) -> BlockStored:
    """Blocks ``first..`` of PROMPT under engine hashes ``engine``."""
    tokens = PROMPT[first * BS : (first + len(engine)) * BS]
    return BlockStored(engine, parent, tokens, BS, namespace, medium)


def indexes(disk: bool = False) -> TierIndexes:
    return TierIndexes.for_engine(PrefixIndex(BS), host_tier=True, disk_tier=disk)


def test_events_reach_the_index_of_their_medium() -> None:
    tiers = indexes()
    tiers.apply(stored((10, 11), 0))
    tiers.apply(stored((10, 11, 12, 13), 0, Medium.HOST))
    tiers.apply(stored((99,), 0, Medium.DISK))  # no disk tier here: ignored
    assert (len(tiers.gpu), len(tiers.host)) == (2, 4)  # type: ignore[arg-type]
    tiers.apply(BlockRemoved((10,)))
    assert (len(tiers.gpu), len(tiers.host)) == (1, 4)  # type: ignore[arg-type]
    tiers.apply(AllBlocksCleared())  # the engine's own cache only
    assert (len(tiers.gpu), len(tiers.host)) == (0, 4)  # type: ignore[arg-type]
    tiers.apply(CacheReset("engine restart"))  # everything
    assert len(tiers.host) == 0  # type: ignore[arg-type]


def test_depths_follow_vllms_loads() -> None:
    tiers = indexes(disk=True)
    tiers.apply(stored((10, 11), 0))  # the engine holds blocks 0-1
    tiers.apply(stored((10,), 0, Medium.HOST))  # the host tier 0-3, a block per event as vLLM's offloading sends them
    tiers.apply(stored((11, 12, 13), 1, Medium.HOST, parent=10))
    assert tiers.match_tiers(PROMPT) == TierDepths(2, 4, 4)
    tiers.apply(stored((10, 11, 12, 13), 0, Medium.DISK))
    tiers.apply(stored((14, 15), 4, Medium.DISK, parent=13))
    assert tiers.match_tiers(PROMPT) == TierDepths(2, 4, 6)
    assert tiers.match_tiers(PROMPT[: 3 * BS]) == TierDepths(2, 2, 2)  # capped: the last token is always computed
    # an engine block past a gap is not loaded: vLLM loads one run, every block from the tier
    gap = indexes()
    gap.apply(stored((10, 11, 12, 13), 0))
    gap.apply(BlockRemoved((11, 12)))  # the engine keeps blocks 0 and 3
    gap.apply(stored((10, 11, 12), 0, Medium.HOST))  # its tier 0-2
    assert gap.match_tiers(PROMPT) == TierDepths(1, 3, 3)
    assert gap.depths(list(block_hashes(PROMPT, BS)), gpu=0) == TierDepths(0, 3, 3)  # the router's question


def test_a_salted_prefix_in_a_tier_is_no_hit_for_another_salt() -> None:
    tiers = indexes()
    tenant = CacheNamespace("", "tenant")
    tiers.apply(stored((20, 21, 22), 0, Medium.HOST, namespace=tenant))
    assert tiers.match_tiers(PROMPT, tenant) == TierDepths(0, 3, 3)
    assert tiers.match_tiers(PROMPT) == TierDepths(0, 0, 0)
    assert tiers.match_tiers(PROMPT, CacheNamespace("", "other")) == TierDepths(0, 0, 0)
    assert tiers.match_tiers(PROMPT, CacheNamespace("adapter", "tenant")) == TierDepths(0, 0, 0)


def test_a_tier_index_must_share_the_engines_block_size() -> None:
    with pytest.raises(ValueError):
        TierIndexes(PrefixIndex(BS), PrefixIndex(2 * BS))
    assert not TierIndexes.for_engine(PrefixIndex(BS), host_tier=False).has_tiers


def test_a_tiers_blocks_arriving_before_their_parents_wait_for_them() -> None:
    """vLLM's offloading connector announces each stored chunk on its own, in no order (seen on a real engine: the
    chain's first block after five of its successors)."""
    tiers = indexes()
    for block in (3, 1, 5, 2, 4):  # every block of the chain but the first, out of order
        tiers.apply(stored((10 + block,), block, Medium.HOST, parent=10 + block - 1))
    assert tiers.match_tiers(PROMPT) == TierDepths(0, 0, 0) and tiers.waiting_blocks(Medium.HOST) == 5
    tiers.apply(stored((10,), 0, Medium.HOST))
    assert tiers.match_tiers(PROMPT) == TierDepths(0, 6, 6) and tiers.waiting_blocks(Medium.HOST) == 0
    assert tiers.host.stats().orphaned_blocks == 0  # type: ignore[union-attr]


def test_a_waiting_block_the_tier_dropped_never_enters_its_index() -> None:
    tiers = indexes()
    tiers.apply(stored((12,), 2, Medium.HOST, parent=11))
    tiers.apply(stored((11,), 1, Medium.HOST, parent=10))
    tiers.apply(BlockRemoved((12,), Medium.HOST))
    assert tiers.waiting_blocks(Medium.HOST) == 1
    tiers.apply(stored((10,), 0, Medium.HOST))
    assert tiers.match_tiers(PROMPT) == TierDepths(0, 2, 2)
    tiers.apply(stored((22,), 2, Medium.HOST, parent=21))
    tiers.apply(CacheReset("engine restart"))
    assert tiers.waiting_blocks(Medium.HOST) == 0


def test_waiting_is_bounded_and_the_oldest_applied_as_an_orphan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tier_index, "MAX_WAITING_BLOCKS", 2)
    tiers = indexes()
    for parent in (90, 91, 92):  # parents that never come
        tiers.apply(stored((parent + 100,), 1, Medium.HOST, parent=parent))
    assert tiers.waiting_blocks(Medium.HOST) == 2
    assert tiers.host.stats().orphaned_blocks == 1  # type: ignore[union-attr]


def test_a_removal_drops_only_the_waiting_event_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """A removal reads the waiting lists it touches (it scanned every waiting event: ~5 ms a removal at the bound):
    the event holding the removed block is dropped, the others still wait and enter when their parents come, and a
    block that stopped waiting (applied, or pushed out as an orphan) is removed from the index as any other."""
    monkeypatch.setattr(tier_index, "MAX_WAITING_BLOCKS", 3)
    tiers = indexes()
    tiers.apply(stored((12,), 2, Medium.HOST, parent=11))
    tiers.apply(stored((13,), 3, Medium.HOST, parent=12))
    tiers.apply(stored((11,), 1, Medium.HOST, parent=10))
    tiers.apply(BlockRemoved((13, 99), Medium.HOST))  # 13 waits; 99 is nowhere
    assert tiers.waiting_blocks(Medium.HOST) == 2
    tiers.apply(stored((10,), 0, Medium.HOST))
    assert tiers.match_tiers(PROMPT) == TierDepths(0, 3, 3) and tiers.waiting_blocks(Medium.HOST) == 0
    tiers.apply(BlockRemoved((12,), Medium.HOST))  # applied meanwhile: the index drops it
    assert tiers.match_tiers(PROMPT) == TierDepths(0, 2, 2)
    for parent in (90, 91, 92, 93):  # parents that never come: the first is pushed out as an orphan
        tiers.apply(stored((parent + 100,), 1, Medium.HOST, parent=parent))
    assert tiers.waiting_blocks(Medium.HOST) == 3 and tiers.host.stats().orphaned_blocks == 1  # type: ignore[union-attr]
    tiers.apply(BlockRemoved((190,), Medium.HOST))  # no longer waiting: the waiting lists are untouched
    assert tiers.waiting_blocks(Medium.HOST) == 3
    tiers.apply(BlockRemoved((191,), Medium.HOST))
    assert tiers.waiting_blocks(Medium.HOST) == 2
