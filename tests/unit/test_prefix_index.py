"""PrefixIndex: events, the vLLM match cap, refcounts, bounds, the journal, and a model-based property."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheReset
from p2pnode.cache.prefix_index import (
    BYTES_PER_BLOCK,
    BYTES_PER_JOURNAL_ENTRY,
    DEFAULT_MAX_BLOCKS,
    DEFAULT_MAX_JOURNAL,
    IndexStats,
    PrefixIndex,
)

BS = 4
# Three distinct blocks and a prompt made of them.
A, B, C = (1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)
ABC = A + B + C
HA, HB, HC = block_hashes(ABC, BS)


def stored(engine_hashes: tuple[int, ...], tokens: tuple[int, ...], parent: int | None = None) -> BlockStored:
    return BlockStored(engine_hashes, parent, tokens, BS)


def index_with_abc(**kwargs: int) -> PrefixIndex:
    index = PrefixIndex(BS, **kwargs)
    index.apply(stored((101, 102, 103), ABC))
    return index


def vars_of(stats: IndexStats) -> dict[str, int]:
    return {name: getattr(stats, name) for name in IndexStats.__dataclass_fields__}


def assert_consistent(index: PrefixIndex) -> None:
    """The index's internal links agree (white-box: reads private fields).

    Every known engine hash maps to a present block that lists it, every block lists only engine hashes that
    map to it (at least one), extra copies exist only for known engine hashes, and depths follow parents.
    """
    nodes, engine, extra = index._nodes, index._engine, index._extra_copies
    for e, h in engine.items():
        owners = nodes[h][2]
        assert e in (owners if isinstance(owners, tuple) else (owners,))
    for h, (parent, depth, owners) in nodes.items():
        owner_list = owners if isinstance(owners, tuple) else (owners,)
        assert not isinstance(owners, tuple) or len(owners) >= 2
        assert len(set(owner_list)) == len(owner_list)
        assert all(engine[e] == h for e in owner_list)
        assert (parent is None) == (depth == 1)
        if parent in nodes:
            assert nodes[parent][1] == depth - 1
    assert set(extra) <= set(engine)
    assert all(n >= 1 for n in extra.values())


# ------------------------------------------------------------------------------------------ construction


def test_defaults() -> None:
    index = PrefixIndex(16)
    assert (index.block_size, index.max_blocks, index.max_journal) == (
        16,
        DEFAULT_MAX_BLOCKS,
        DEFAULT_MAX_JOURNAL,
    )
    assert len(index) == 0
    assert index.version == 0
    assert index.changes_since(0) == []
    assert index.match(list(range(100))) == 0
    assert index.match_blocks(block_hashes(list(range(100)), 16)) == 0
    assert set(vars_of(index.stats()).values()) == {0}


@pytest.mark.parametrize(
    "kwargs", [{"block_size": 0}, {"block_size": 4, "max_blocks": 0}, {"block_size": 4, "max_journal": -1}]
)
def test_rejects_bad_parameters(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        PrefixIndex(**kwargs)


def test_rejects_non_events() -> None:
    with pytest.raises(TypeError):
        PrefixIndex(BS).apply("BlockStored")  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------- storing


def test_store_indexes_the_chain() -> None:
    index = index_with_abc()
    assert len(index) == 3
    assert HA in index and HB in index and HC in index
    assert 101 not in index  # engine hashes are not p2pnode hashes
    assert list(index.iter_blocks()) == [(HA, 1), (HB, 2), (HC, 3)]
    assert index.match_blocks([HA, HB, HC]) == 3
    assert index.match_blocks([HA, HB, HC, 42]) == 3
    assert index.match_blocks([HA, 42, HC]) == 1
    assert index.match_blocks(block_hashes(B + C, BS)) == 0  # a hash names its whole prefix, not a block
    assert index.match_blocks([]) == 0
    assert index.match((*ABC, 99)) == 12
    assert index.match((*A, *B, 0, 0, 0, 0, 99)) == 8
    assert index.stats().stored_blocks_total == 3


def test_store_continuing_a_parent_chains_from_its_hash() -> None:
    index = PrefixIndex(BS)
    index.apply(stored((101,), A))
    index.apply(stored((102, 103), B + C, parent=101))
    assert list(index.iter_blocks()) == [(HA, 1), (HB, 2), (HC, 3)]
    assert index.match((*ABC, 0)) == 12


def test_branches_share_their_common_prefix() -> None:
    index = index_with_abc()
    index.apply(stored((201,), C, parent=101))  # A then C
    hac = block_hashes(A + C, BS)[1]
    assert len(index) == 4
    assert (hac, 2) in set(index.iter_blocks())
    assert index.match(A + C + (0,)) == 8
    assert index.match((*ABC, 0)) == 12


@pytest.mark.parametrize("length", range(0, 19))
def test_match_is_capped_below_the_last_token(length: int) -> None:
    """vLLM recomputes at least the last prompt token, and reuses whole blocks only."""
    index = index_with_abc()
    prompt = (*ABC, 13, 14, 15, 16, 17, 18)[:length]
    matched_blocks = min(3, length // BS)
    expected = min(matched_blocks, (length - 1) // BS) * BS if length else 0
    assert index.match(prompt) == expected
    assert index.match(list(prompt)) == expected
    assert index.match(np.array(prompt, dtype=np.int64)) == expected


def test_prompt_served_twice_matches_like_vllm() -> None:
    """After serving a prompt, vLLM has cached its full blocks; serving it again reuses them up to len - 1."""
    prompt = tuple(range(1, 11))  # 10 tokens: 2 full blocks
    index = PrefixIndex(BS)
    index.apply(stored((1, 2), prompt[:8]))
    assert index.match(prompt) == 8  # (10 - 1) // 4 * 4
    exact = prompt[:8]
    assert index.match(exact) == 4  # a block-aligned prompt recomputes its whole last block


def test_unknown_parent_is_orphaned() -> None:
    index = PrefixIndex(BS)
    index.apply(stored((102, 103), B + C, parent=101))
    assert len(index) == 0
    assert index.version == 0
    assert index.stats().orphaned_blocks == 2
    assert index.stats().stored_blocks_total == 0


def test_store_under_a_removed_parent_is_orphaned() -> None:
    index = index_with_abc()
    index.apply(BlockRemoved((103,)))
    index.apply(stored((104,), A, parent=103))
    assert len(index) == 2
    assert index.stats().orphaned_blocks == 1


@pytest.mark.parametrize(
    "event",
    [
        BlockStored((101,), None, A + A, 8),  # another block size
        BlockStored((101,), None, A[:3], 3),  # a partial block (vLLM's partial-hash mode)
        BlockStored((101, 102), None, A, BS),  # fewer tokens than blocks need
        BlockStored((101,), None, (1, 2, 3, -4), BS),  # token ids outside uint32
        BlockStored((101,), None, (1, 2, 3, 2**32), BS),
    ],
)
def test_unusable_stores_are_counted_not_raised(event: BlockStored) -> None:
    index = PrefixIndex(BS)
    index.apply(event)
    assert len(index) == 0
    assert index.version == 0
    assert index.stats().mismatched_blocks == len(event.engine_block_hashes)


def test_engine_hash_reused_for_other_tokens_keeps_its_first_meaning() -> None:
    index = PrefixIndex(BS)
    index.apply(stored((101,), A))
    index.apply(stored((101,), B))
    assert len(index) == 1 and HA in index
    assert index.stats().mismatched_blocks == 1
    index.apply(BlockRemoved((101,)))
    assert len(index) == 0


# ------------------------------------------------------------------------------------ copies, removal


def test_duplicate_store_is_refcounted() -> None:
    """vLLM may hold two physical copies of a block; the prefix stays until the last copy is removed."""
    index = index_with_abc()
    index.apply(stored((101, 102, 103), ABC))
    assert len(index) == 3
    assert index.version == 3  # a second copy changes nothing a peer could see
    index.apply(BlockRemoved((103,)))
    assert index.match((*ABC, 0)) == 12
    assert index.version == 3
    index.apply(BlockRemoved((103,)))
    assert index.match((*ABC, 0)) == 8
    assert HC not in index
    assert index.version == 4
    s = index.stats()
    assert (s.stored_blocks_total, s.removed_blocks_total, s.unknown_removals) == (6, 2, 0)


def test_same_tokens_under_distinct_engine_hashes_share_one_block() -> None:
    """E.g. two cache_salts: two engine hashes, one p2pnode prefix; it stays while either is cached."""
    index = PrefixIndex(BS)
    index.apply(stored((101,), A))
    index.apply(stored((201,), A))
    index.apply(stored((301,), A))
    assert len(index) == 1
    index.apply(BlockRemoved((201,)))
    index.apply(BlockRemoved((101,)))
    assert HA in index
    index.apply(stored((302,), B, parent=301))
    assert index.match(A + B + (0,)) == 8
    index.apply(BlockRemoved((301,)))
    assert HA not in index
    assert HB in index
    assert index.version == 3  # +A, +B, -A


def test_unknown_removal_is_counted() -> None:
    index = index_with_abc()
    index.apply(BlockRemoved((999,)))
    index.apply(BlockRemoved((101,)))
    index.apply(BlockRemoved((101,)))  # removed twice
    assert len(index) == 2
    s = index.stats()
    assert (s.removed_blocks_total, s.unknown_removals) == (1, 2)


def test_removing_a_block_keeps_its_descendants() -> None:
    index = index_with_abc()
    index.apply(BlockRemoved((102,)))
    assert len(index) == 2
    assert HC in index
    assert index.match((*ABC, 0)) == 4  # the walk stops at the missing block
    index.apply(stored((102,), B, parent=101))  # recomputed: the chain is whole again
    assert index.match((*ABC, 0)) == 12
    assert dict(index.iter_blocks())[HB] == 2


def test_removed_event_with_several_hashes() -> None:
    index = index_with_abc()
    index.apply(BlockRemoved((103, 102, 101)))
    assert len(index) == 0
    assert index.stats().removed_blocks_total == 3


@pytest.mark.parametrize("event", [AllBlocksCleared(), CacheReset("engine restarted")])
def test_clear_and_reset_drop_everything(event: AllBlocksCleared | CacheReset) -> None:
    index = index_with_abc()
    index.apply(stored((101,), A))  # an extra copy, forgotten too
    index.apply(event)
    assert len(index) == 0
    assert index.match((*ABC, 0)) == 0
    assert index.stats().resets == 1
    assert index.version == 4
    assert index.changes_since(3) is None  # a clear is not a delta: peers need a snapshot
    assert index.changes_since(4) == []
    index.apply(BlockRemoved((101,)))
    assert index.stats().unknown_removals == 1
    index.apply(stored((102,), B, parent=101))
    assert index.stats().orphaned_blocks == 1
    index.apply(stored((101, 102), A + B))
    assert index.match(ABC) == 8


# ------------------------------------------------------------------------------------------- overflow


def test_overflow_drops_oldest_inserted_blocks() -> None:
    index = PrefixIndex(BS, max_blocks=4)
    index.apply(stored((101, 102, 103), ABC))
    index.apply(stored((201, 202, 203), C + B + A))  # 6 blocks for 4 slots
    hashes_cba = block_hashes(C + B + A, BS)
    assert len(index) == 4
    assert [h for h, _ in index.iter_blocks()] == [HC, *hashes_cba]
    s = index.stats()
    assert s.overflow_evictions == 2
    assert s.blocks == 4
    # The evicted blocks' engine hashes are forgotten: removal is unknown, a child store is orphaned.
    index.apply(BlockRemoved((101,)))
    index.apply(stored((104,), A, parent=102))
    s = index.stats()
    assert (s.unknown_removals, s.orphaned_blocks) == (1, 1)
    # Removing the surviving copy of C still works.
    index.apply(BlockRemoved((103,)))
    assert HC not in index


def test_overflow_of_a_block_with_several_engine_hashes() -> None:
    index = PrefixIndex(BS, max_blocks=1)
    index.apply(stored((101,), A))
    index.apply(stored((201,), A))
    index.apply(stored((101,), A))
    index.apply(stored((301,), B))
    assert [h for h, _ in index.iter_blocks()] == [block_hashes(B, BS)[0]]
    index.apply(BlockRemoved((101, 201)))
    assert index.stats().unknown_removals == 2
    assert len(index) == 1


def test_overflow_after_removing_one_of_several_engine_hashes() -> None:
    index = PrefixIndex(BS, max_blocks=1)
    index.apply(stored((101,), A))
    index.apply(stored((201,), A))
    index.apply(stored((301,), A))
    index.apply(BlockRemoved((201,)))
    assert_consistent(index)
    index.apply(stored((401,), B))  # evicts A, forgetting 101 and 301
    assert_consistent(index)
    index.apply(BlockRemoved((101, 201, 301)))
    assert index.stats().unknown_removals == 3


def test_overflow_evicts_in_small_batches_when_large() -> None:
    """Large indexes evict max_blocks // 256 blocks per overflow, never exceeding max_blocks."""
    index = PrefixIndex(1, max_blocks=1024)
    tokens = list(range(1025))
    index.apply(BlockStored(tuple(range(1, 1026)), None, tuple(tokens), 1))
    assert len(index) == 1021
    assert index.stats().overflow_evictions == 4
    assert index.match(tokens) == 0  # the chain's first blocks went first
    assert min(depth for _, depth in index.iter_blocks()) == 5


# -------------------------------------------------------------------------------------------- journal


def test_journal_lists_changes_in_order() -> None:
    index = index_with_abc()
    index.apply(BlockRemoved((102,)))
    assert index.version == 4
    assert index.changes_since(0) == [(1, True, HA), (2, True, HB), (3, True, HC), (4, False, HB)]
    assert index.changes_since(2) == [(3, True, HC), (4, False, HB)]
    assert index.changes_since(4) == []
    assert index.changes_since(5) is None  # the caller is ahead: this index restarted
    # The same as the journal's own entries (the simulator's gossip model): a hash added, ~hash removed.
    assert index.journal_since(0) == [HA, HB, HC, ~HB] and index.journal_since(2) == [HC, ~HB]
    assert index.journal_since(4) == [] and index.journal_since(5) is None


def test_journal_truncation_means_snapshot() -> None:
    index = index_with_abc(max_journal=3)
    index.apply(BlockRemoved((103,)))
    index.apply(BlockRemoved((102,)))
    assert index.version == 5
    assert index.changes_since(2) == [(3, True, HC), (4, False, HC), (5, False, HB)]
    assert index.changes_since(1) is None
    assert index.changes_since(-7) is None
    assert index.journal_since(2) == [HC, ~HC, ~HB] and index.journal_since(1) is None


def test_journal_disabled() -> None:
    index = index_with_abc(max_journal=0)
    assert index.version == 3
    assert index.changes_since(3) == []
    assert index.changes_since(2) is None


def test_journal_records_overflow_evictions() -> None:
    index = PrefixIndex(BS, max_blocks=2)
    index.apply(stored((101, 102, 103), ABC))
    assert index.changes_since(0) == [(1, True, HA), (2, True, HB), (3, False, HA), (4, True, HC)]


# ---------------------------------------------------------------------------------------------- stats


def test_stats_counters_and_size() -> None:
    index = index_with_abc(max_journal=4)
    index.apply(stored((101,), A))
    index.apply(stored((301,), B, parent=999))
    index.apply(BlockStored((401,), None, A + A, 2 * BS))
    index.apply(BlockRemoved((101, 101, 103, 555)))
    s = index.stats()
    assert s == IndexStats(
        blocks=1,  # B, whose parent A is gone
        approx_bytes=BYTES_PER_BLOCK + 4 * BYTES_PER_JOURNAL_ENTRY,
        stored_blocks_total=4,
        removed_blocks_total=3,
        orphaned_blocks=1,
        mismatched_blocks=1,
        unknown_removals=1,
        overflow_evictions=0,
        resets=0,
        version=5,
    )
    index.apply(AllBlocksCleared())
    assert index.stats().approx_bytes == 0
    with pytest.raises(AttributeError):
        s.blocks = 3  # type: ignore[misc]


# ------------------------------------------------------------------------------------ model-based test

MODEL_BS = 2
SMALL_MAX_BLOCKS = 6
block_st = st.tuples(st.integers(0, 2), st.integers(0, 2))  # a tiny alphabet: many shared prefixes
blocks_st = st.lists(block_st, min_size=1, max_size=3)


class IndexMachine(RuleBasedStateMachine):
    """Random stores (roots, branches off live blocks, duplicates, salted twins), removals, clears.

    Reference model: a multiset of live engine-hash copies, each engine hash naming a (salt, prefix tokens)
    pair as vLLM's hashes do. The index must match the longest fully-present chain of any probe, hold exactly
    the distinct present prefixes, and let a gossip follower reconstruct its block set from the journal. A
    second index bounded to SMALL_MAX_BLOCKS gets the same events and must never claim an absent block.
    """

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(MODEL_BS, max_journal=16)
        self.small = PrefixIndex(MODEL_BS, max_blocks=SMALL_MAX_BLOCKS, max_journal=4)
        self.copies: Counter[int] = Counter()  # engine hash -> live copies
        self.key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # engine hash -> (salt, prefix)
        self.engine_ids: dict[tuple[int, tuple[int, ...]], int] = {}
        self.expected = Counter[str]()
        self.followers = {id(self.index): (0, set[int]()), id(self.small): (0, set[int]())}

    # -- helpers

    def engine_hash(self, salt: int, prefix: tuple[int, ...]) -> int:
        key = (salt, prefix)
        if key not in self.engine_ids:
            self.engine_ids[key] = 2**63 + len(self.engine_ids)  # vLLM-like: a function of salt and prefix
            self.key_of[self.engine_ids[key]] = key
        return self.engine_ids[key]

    def live(self) -> list[int]:
        return sorted(e for e, n in self.copies.items() if n > 0)

    def present_prefixes(self) -> set[tuple[int, ...]]:
        return {self.key_of[e][1] for e in self.live()}

    def apply(self, event: BlockStored | BlockRemoved | AllBlocksCleared | CacheReset) -> None:
        self.index.apply(event)
        self.small.apply(event)

    def reference_match(self, tokens: tuple[int, ...]) -> int:
        present = self.present_prefixes()
        n = 0
        while (n + 1) * MODEL_BS <= len(tokens) and tokens[: (n + 1) * MODEL_BS] in present:
            n += 1
        return n

    # -- rules

    @rule(salt=st.integers(0, 1), parent_pick=st.none() | st.integers(0, 10**6), blocks=blocks_st)
    def store(self, salt: int, parent_pick: int | None, blocks: list[tuple[int, ...]]) -> None:
        live = self.live()
        parent = None if parent_pick is None or not live else live[parent_pick % len(live)]
        if parent is not None:
            salt, prefix = self.key_of[parent]
        else:
            prefix = ()
        engine_hashes = []
        for block in blocks:
            prefix += block
            engine_hashes.append(self.engine_hash(salt, prefix))
        tokens = tuple(t for block in blocks for t in block)
        self.apply(BlockStored(tuple(engine_hashes), parent, tokens, MODEL_BS))
        self.copies.update(engine_hashes)
        self.expected["stored"] += len(blocks)

    @rule(parent_pick=st.integers(0, 10**6), blocks=blocks_st)
    def store_orphan(self, parent_pick: int, blocks: list[tuple[int, ...]]) -> None:
        """A store whose parent the engine no longer has as far as we know (missed events)."""
        dead = [*sorted(e for e in self.key_of if self.copies[e] == 0), 12345]
        parent = dead[parent_pick % len(dead)]
        salt, prefix = self.key_of.get(parent, (0, (7, 7)))
        engine_hashes = []
        for block in blocks:
            prefix += block
            engine_hashes.append(self.engine_hash(salt, prefix))
        tokens = tuple(t for block in blocks for t in block)
        self.apply(BlockStored(tuple(engine_hashes), parent, tokens, MODEL_BS))
        self.expected["orphaned"] += len(blocks)

    @rule(blocks=blocks_st)
    def store_other_block_size(self, blocks: list[tuple[int, ...]]) -> None:
        tokens = tuple(t for block in blocks for t in block)
        self.apply(BlockStored((99,), None, (*tokens, 0), len(tokens) + 1))  # never MODEL_BS
        self.expected["mismatched"] += 1

    @precondition(lambda self: any(n > 0 for n in self.copies.values()))
    @rule(picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=3))
    def remove(self, picks: list[int]) -> None:
        removed = []
        for pick in picks:
            live = self.live()
            if not live:
                break
            e = live[pick % len(live)]
            self.copies[e] -= 1
            removed.append(e)
        self.apply(BlockRemoved(tuple(removed)))
        self.expected["removed"] += len(removed)

    @rule(pick=st.integers(0, 10**6))
    def remove_unknown(self, pick: int) -> None:
        dead = [*sorted(e for e in self.key_of if self.copies[e] == 0), 54321]
        self.apply(BlockRemoved((dead[pick % len(dead)],)))
        self.expected["unknown"] += 1

    @rule(reset=st.booleans())
    def clear(self, reset: bool) -> None:
        self.apply(CacheReset("test") if reset else AllBlocksCleared())
        self.copies.clear()
        self.expected["resets"] += 1

    @rule(probe=st.lists(block_st, max_size=5), tail=st.lists(st.integers(0, 2), max_size=2))
    def probe_matches_reference(self, probe: list[tuple[int, ...]], tail: list[int]) -> None:
        tokens = tuple(t for block in probe for t in block) + tuple(tail)
        expected = self.reference_match(tokens)
        hashes = block_hashes(tokens, MODEL_BS)
        assert self.index.match_blocks(hashes) == expected
        capped = min(expected, (len(tokens) - 1) // MODEL_BS) if tokens else 0
        assert self.index.match(tokens) == capped * MODEL_BS
        assert self.small.match_blocks(hashes) <= expected

    # -- invariants

    @invariant()
    def holds_exactly_the_present_prefixes(self) -> None:
        present = self.present_prefixes()
        expected = {block_hashes(p, MODEL_BS)[-1]: len(p) // MODEL_BS for p in present}
        assert len(self.index) == len(present)
        assert dict(self.index.iter_blocks()) == expected
        for prefix in present:  # every present prefix, and one step past it, matches like the reference
            for tokens in (prefix, (*prefix, 0, 0)):
                assert self.index.match_blocks(block_hashes(tokens, MODEL_BS)) == self.reference_match(tokens)

    @invariant()
    def internal_links_are_consistent(self) -> None:
        assert_consistent(self.index)
        assert_consistent(self.small)

    @invariant()
    def bounded_index_never_claims_absent_blocks(self) -> None:
        assert len(self.small) <= SMALL_MAX_BLOCKS
        assert {h for h, _ in self.small.iter_blocks()} <= {h for h, _ in self.index.iter_blocks()}

    @invariant()
    def followers_catch_up_from_the_journal(self) -> None:
        for index in (self.index, self.small):
            version, blocks = self.followers[id(index)]
            changes = index.changes_since(version)
            if changes is None:
                version, blocks = index.version, {h for h, _ in index.iter_blocks()}
            else:
                for v, added, h in changes:
                    assert v == version + 1
                    version = v
                    assert (h not in blocks) if added else (h in blocks)
                    (blocks.add if added else blocks.discard)(h)
            assert version == index.version
            assert blocks == {h for h, _ in index.iter_blocks()}
            self.followers[id(index)] = (version, blocks)

    @invariant()
    def counters_match(self) -> None:
        s = self.index.stats()
        assert s.stored_blocks_total == self.expected["stored"]
        assert s.removed_blocks_total == self.expected["removed"]
        assert s.orphaned_blocks == self.expected["orphaned"]
        assert s.mismatched_blocks == self.expected["mismatched"]
        assert s.unknown_removals == self.expected["unknown"]
        assert s.resets == self.expected["resets"]
        assert s.overflow_evictions == 0


IndexMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestIndexMachine = IndexMachine.TestCase
