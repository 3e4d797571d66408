"""The peers' summaries as one C table (``routing/mask_table.py``): the same mapping as its definition under any
sequence of peers publishing and withdrawing keys, the same errors for bad keys and slots, and a table that gives
its memory back when its keys go."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.routing.mask_table import MAX_SLOTS, NATIVE_MASK_TABLE, DictMaskTable, MaskTable

pytestmark = pytest.mark.skipif(not NATIVE_MASK_TABLE, reason="p2pnode.cache._chain was not built")

# a few keys that share a home in any small table (the low bits alike) beside spread ones: runs of probes, and
# removals from their middle, in every test
KEYS = st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1), st.integers(0, 7).map(lambda k: k << 28))
OPS = st.lists(
    st.tuples(
        st.booleans(), st.lists(KEYS, min_size=1, max_size=12), st.sampled_from([0, 1, 5, 63, 64, 65, 200, 1023])
    ),
    max_size=120,
)


@settings(max_examples=150)
@given(ops=OPS)
def test_the_c_table_is_its_definition_under_any_publishing_and_withdrawing(ops: list) -> None:
    """Every key's bitmask, the count, membership and the width after each step, as the definition holds them: keys
    whose last peer withdraws leave; clearing what was never set changes nothing."""
    table, definition = MaskTable(), DictMaskTable()
    seen: set[int] = set()
    for publish, keys, slot in ops:
        for t in (table, definition):
            (t.set_bits if publish else t.clear_bits)(keys, slot)
        seen.update(keys)
        assert len(table) == len(definition)
        assert table.width == definition.width
    assert sorted(table.items()) == sorted(definition.items())
    for key in seen | {12345}:
        assert table.get(key) == definition.get(key) and (key in table) == (key in definition)
        if key in definition:
            assert table[key] == definition[key] != 0


def test_keys_withdrawn_from_runs_that_wrap_past_the_tables_end_are_still_found() -> None:
    """A full small table (8 keys in 16 rows: runs of probes, some wrapping from the last row to the first), its keys
    withdrawn in a random order: every key left is found after each withdrawal (the rows after a removed one are
    shifted back only where their home allows, across the wrap too)."""
    rng = random.Random(7)
    for _ in range(3000):
        table, keys = MaskTable(), rng.sample(range(2**32), 8)
        table.set_bits(keys, 0)
        rng.shuffle(keys)
        for i, key in enumerate(keys):
            table.clear_bits([key], 0)
            assert key not in table and all(table.get(k) == 1 for k in keys[i + 1 :])


def test_many_keys_in_and_out_keep_every_mask_and_give_the_memory_back() -> None:
    """100,000 keys published by two peers, then withdrawn by one and by the other: every mask right at each stage,
    and the emptied table back near its first size (it shrinks as keys leave)."""
    keys = [(k * 2654435761) % 2**32 for k in range(100_000)]
    table = MaskTable()
    empty = table.nbytes
    table.set_bits(keys, 3)
    table.set_bits(keys[::2], 70)
    assert len(table) == len(keys) and table.width == 2
    assert all(table[k] == (1 << 3 | 1 << 70 if i % 2 == 0 else 1 << 3) for i, k in enumerate(keys))
    table.clear_bits(keys, 3)
    assert len(table) == len(keys) // 2
    assert all(table.get(k) == (1 << 70 if i % 2 == 0 else 0) for i, k in enumerate(keys))
    grown = table.nbytes
    table.clear_bits(keys, 70)
    assert len(table) == 0 and table.items() == []
    assert table.nbytes <= 2 * empty * table.width < grown


def test_bad_keys_and_slots_are_refused_naming_them_and_the_keys_before_stay() -> None:
    for t in (MaskTable(), DictMaskTable()):
        with pytest.raises(OverflowError, match="summary key"):
            t.set_bits([1, 2**32], 0)
        assert t.get(1) == 1 and len(t) == 1  # the key before the bad one was applied
        with pytest.raises(OverflowError, match="summary key"):
            t.clear_bits([-1], 0)
        with pytest.raises(TypeError, match="summary key must be an int"):
            t.set_bits(["7"], 0)
        for slot in (-1, MAX_SLOTS, 1.5):
            with pytest.raises(ValueError, match="slot"):
                t.set_bits([1], slot)
        with pytest.raises(TypeError):
            t.set_bits(7, 0)  # not an iterable of keys
        assert t.get(2**40) == 0 and t.get(-3, None) is None and t.get(9, "none") == "none"
        assert 2**40 not in t and "x" not in t and 1 in t
        with pytest.raises(KeyError):
            t[9]
    with pytest.raises(TypeError, match="no arguments"):
        MaskTable(4)
