"""p2pnode block hashes: the chain definition, its wire-format pin, input handling and errors."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import xxhash
from hypothesis import assume, given
from hypothesis import strategies as st

from p2pnode.cache.block_hash import (
    ROOT_SEED,
    block_hashes,
    block_hashes_packed,
    count_leading,
    iter_block_hashes,
    token_buffer,
)

# Wire-format pins: every node in a mesh must compute these exact values. If one of these fails, the hash
# definition changed and nodes of different versions no longer understand each other's gossip.
PINNED_ROOT_SEED = 0x7032706E6F646531  # b"p2pnode1"
PINNED_HASH_0_TO_31 = 9665488868988747356  # block_hashes(list(range(32)), 32)[0]

tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=80)
small_tokens_st = st.lists(st.integers(0, 5), max_size=40)


def spec_hashes(tokens: list[int], block_size: int, parent: int | None = None) -> list[int]:
    """The definition, written out independently of the implementation."""
    out = []
    h = ROOT_SEED if parent is None else parent
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        h = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *block), seed=h)
        out.append(h)
    return out


def test_root_seed_is_pinned() -> None:
    assert ROOT_SEED == PINNED_ROOT_SEED


def test_golden_value_is_pinned() -> None:
    assert block_hashes(list(range(32)), 32) == [PINNED_HASH_0_TO_31]
    assert spec_hashes(list(range(32)), 32) == [PINNED_HASH_0_TO_31]


def test_second_block_is_seeded_by_first() -> None:
    tokens = list(range(64))
    h0, h1 = block_hashes(tokens, 32)
    assert h0 == PINNED_HASH_0_TO_31
    assert h1 == xxhash.xxh3_64_intdigest(struct.pack("<32I", *range(32, 64)), seed=h0)


@given(tokens=tokens_st, block_size=st.integers(1, 9))
def test_matches_the_spec(tokens: list[int], block_size: int) -> None:
    assert block_hashes(tokens, block_size) == spec_hashes(tokens, block_size)


@given(tokens=small_tokens_st, block_size=st.integers(1, 6), cut=st.integers(0, 40))
def test_prefix_of_tokens_gives_prefix_of_hashes(tokens: list[int], block_size: int, cut: int) -> None:
    full = block_hashes(tokens, block_size)
    k = min(cut, len(tokens) // block_size)
    assert block_hashes(tokens[: k * block_size], block_size) == full[:k]
    assert block_hashes(tokens[:cut], block_size) == full[: min(cut, len(tokens)) // block_size]


@given(head=small_tokens_st, tail=small_tokens_st, block_size=st.integers(1, 6))
def test_parent_continues_the_chain(head: list[int], tail: list[int], block_size: int) -> None:
    head = head[: len(head) - len(head) % block_size]
    assume(head)
    parent = block_hashes(head, block_size)[-1]
    assert (
        block_hashes(tail, block_size, parent=parent)
        == block_hashes(head + tail, block_size)[len(head) // block_size :]
    )


def test_partial_block_is_ignored() -> None:
    tokens = list(range(100))
    assert len(block_hashes(tokens, 32)) == 3
    assert block_hashes(tokens, 32) == block_hashes(tokens[:96], 32)
    assert block_hashes(tokens[:31], 32) == []
    assert block_hashes([], 32) == []


def test_hash_names_the_whole_prefix() -> None:
    tokens = list(range(96))
    base = block_hashes(tokens, 32)
    changed_first = block_hashes([7, *tokens[1:]], 32)
    assert all(a != b for a, b in zip(base, changed_first, strict=True))  # block 0 changes every later hash
    changed_last = block_hashes([*tokens[:-1], 7], 32)
    assert changed_last[:2] == base[:2]
    assert changed_last[2] != base[2]


def test_different_parent_gives_different_hashes() -> None:
    tokens = list(range(64))
    root = block_hashes(tokens, 32)
    under_a = block_hashes(tokens, 32, parent=1)
    under_b = block_hashes(tokens, 32, parent=2)
    assert len({root[0], under_a[0], under_b[0]}) == 3
    assert len({root[1], under_a[1], under_b[1]}) == 3


def test_block_size_changes_the_hashes() -> None:
    tokens = list(range(64))
    assert block_hashes(tokens, 32)[0] != block_hashes(tokens, 16)[1]


@pytest.mark.parametrize(
    "convert",
    [
        list,
        tuple,
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=">u4"),  # big-endian input still hashes as little-endian uint32
        lambda t: np.array(t, dtype=np.uint16),
        lambda t: np.repeat(np.array(t, dtype=np.uint32), 2)[::2],  # non-contiguous view
    ],
)
def test_input_types_agree(convert: Callable[[list[int]], Sequence[int] | np.ndarray]) -> None:
    tokens = [0, 1, 65535, 3, 2, 1, 0, 9] * 4
    assert block_hashes(convert(tokens), 8) == spec_hashes(tokens, 8)


def test_uint32_bounds_are_accepted() -> None:
    tokens = [0, 2**32 - 1] * 2
    assert block_hashes(tokens, 2) == spec_hashes(tokens, 2)
    assert block_hashes(np.array(tokens, dtype=np.int64), 2) == spec_hashes(tokens, 2)


def test_token_buffer_is_little_endian_uint32() -> None:
    assert bytes(token_buffer([1, 0x01020304])) == struct.pack("<2I", 1, 0x01020304)
    assert bytes(token_buffer(np.array([1, 0x01020304], dtype=">u4"))) == struct.pack("<2I", 1, 0x01020304)


def test_fixed_across_processes_and_hash_seeds() -> None:
    code = "from p2pnode.cache.block_hash import block_hashes; print(block_hashes(list(range(100)), 16))"
    expected = str(block_hashes(list(range(100)), 16))
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == expected


@pytest.mark.parametrize("block_size", [0, -1])
def test_rejects_bad_block_size(block_size: int) -> None:
    with pytest.raises(ValueError):
        block_hashes([1, 2, 3], block_size)
    with pytest.raises(ValueError):
        iter_block_hashes([1, 2, 3], block_size)


@pytest.mark.parametrize("bad", [-1, 2**32, 2**64])
def test_rejects_tokens_outside_uint32(bad: int) -> None:
    with pytest.raises(ValueError):
        block_hashes([1, bad, 3, 4], 2)
    with pytest.raises(ValueError):
        iter_block_hashes([1, bad, 3, 4], 2)  # validated eagerly, not at the first next()


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_rejects_numpy_tokens_outside_uint32(bad: int) -> None:
    with pytest.raises(ValueError):
        block_hashes(np.array([1, bad, 3, 4], dtype=np.int64), 2)


def test_rejects_non_integer_and_non_flat_tokens() -> None:
    with pytest.raises(TypeError):
        block_hashes([1.0, 2.0], 1)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        block_hashes(np.array([1.0, 2.0]), 1)
    with pytest.raises(ValueError):
        block_hashes(np.zeros((2, 2), dtype=np.uint32), 1)


@pytest.mark.parametrize("parent", [-1, 2**64])
def test_rejects_parent_outside_uint64(parent: int) -> None:
    with pytest.raises(ValueError):
        block_hashes([1, 2], 1, parent=parent)


@given(tokens=small_tokens_st, block_size=st.integers(1, 6), limit=st.none() | st.integers(-1, 10))
def test_iter_block_hashes_matches_block_hashes(
    tokens: list[int],
    block_size: int,
    limit: int | None,
) -> None:
    full = block_hashes(tokens, block_size, parent=5)
    lazy = list(iter_block_hashes(tokens, block_size, parent=5, max_blocks=limit))
    assert lazy == (full if limit is None else full[: max(0, limit)])


def test_the_c_chain_is_built() -> None:
    """``pip install -e .`` (scripts/bootstrap.sh) compiles native/chain.c; without it routing is ~3x slower."""
    from p2pnode.cache import block_hash

    assert block_hash._native_chain is not None, "p2pnode.cache._chain was not built: run scripts/bootstrap.sh"


@given(tokens=tokens_st, block_size=st.integers(1, 9), parent=st.none() | st.integers(0, 2**64 - 1))
def test_c_chain_and_python_agree(tokens: list[int], block_size: int, parent: int | None) -> None:
    # Lists take the C loop; tuples the Python one.
    assert block_hashes(tokens, block_size, parent) == block_hashes(tuple(tokens), block_size, parent)


@given(tokens=tokens_st, block_size=st.integers(1, 9), parent=st.none() | st.integers(0, 2**64 - 1))
def test_packed_tokens_hash_as_their_list_does(tokens: list[int], block_size: int, parent: int | None) -> None:
    """A prompt kept in the hash's byte form (``token_buffer``'s) gives the same chain, in C and in Python."""
    from p2pnode.cache import block_hash

    packed = bytes(token_buffer(tokens))
    expected = spec_hashes(tokens, block_size, parent)
    assert block_hashes_packed(packed, block_size, parent) == expected
    assert block_hash._chain_bytes(packed, block_size, ROOT_SEED if parent is None else parent) == expected


def test_packed_tokens_must_be_whole_uint32_bytes() -> None:
    with pytest.raises(ValueError, match="whole uint32s"):
        block_hashes_packed(b"\x01\x00\x00", 1)
    with pytest.raises(TypeError, match="bytes"):
        block_hashes_packed(bytearray(8), 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        block_hashes_packed(bytes(8), 0)


@given(
    hashes=st.lists(st.integers(0, 12), max_size=20), held=st.sets(st.integers(0, 12)),
    kind=st.sampled_from([dict.fromkeys, set, frozenset]),
)
def test_the_c_prefix_match_counts_the_leading_held_hashes(hashes: list[int], held: set[int], kind: Callable) -> None:
    """A list or a tuple against a dict or a set takes the C loop; an iterator the Python one: all count up to the
    first miss."""
    present = kind(held)
    expected = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
    assert count_leading(hashes, present) == count_leading(tuple(hashes), present) == expected
    assert count_leading(iter(hashes), present) == expected


def test_the_c_prefix_match_survives_an_item_that_empties_the_list() -> None:
    """An item whose comparison changes the list mid-walk (arbitrary objects: not tokens' hashes) is counted safely."""
    hashes: list[object] = []

    class Shrinking:
        def __hash__(self) -> int:
            return 1

        def __eq__(self, other: object) -> bool:
            hashes.clear()
            return True

    hashes += [Shrinking(), Shrinking(), 3]
    assert count_leading(hashes, {1: None}) == 1  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 2**32, "7", None])
def test_a_bad_token_in_the_partial_block_is_still_rejected(bad: object) -> None:
    for tokens in ([1, 2, 3, 4, bad], (1, 2, 3, 4, bad)):
        with pytest.raises((ValueError, TypeError)):
            block_hashes(tokens, 2)  # type: ignore[arg-type]


def test_c_chain_reads_every_kind_of_token_as_the_definition_does() -> None:
    """The C loop reads a block of small plain ints in one pass and any other block token by token: zeros, bools,
    ids past 2**30 and a mix of them in one block all hash as the definition says."""
    zero = int("0")
    blocks = [
        [0] * 8,
        [zero, 1, 0, 2**30 - 1, 7, 0, 3, zero],
        [True, False, 5, 6, 7, 8, 9, 10],
        [2**30, 2**31, 2**32 - 1, 1, 2, 3, 4, 5],
        [1, 2, 3, 4, 5, 6, 7, 2**30],
    ]
    tokens = [t for block in blocks for t in block]
    assert block_hashes(tokens, 8) == spec_hashes([int(t) for t in tokens], 8)
    for block_size in (1, 3, 8):
        assert block_hashes(tokens, block_size) == block_hashes(tuple(tokens), block_size)


@pytest.mark.parametrize("bad", [-1, -(2**40), 2**32, 2**64, "7", None, 1.0])
def test_a_bad_token_in_a_full_block_is_rejected(bad: object) -> None:
    for tokens in ([1, 2, 3, bad], [bad, 2, 3, 4]):
        with pytest.raises((ValueError, TypeError)):
            block_hashes(tokens, 4)  # type: ignore[arg-type]


@given(st.one_of(st.integers(0, 2**64 - 1), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 2**64, -1, True])))
def test_the_c_mix64_is_the_definition(h: int) -> None:
    """``mix64`` in C (``_chain.mix64``) gives the Python's value for any int, taken modulo 2**64 as the Python's
    masks take it (a negative one, one past 64 bits, a bool)."""
    from p2pnode.cache import block_hash

    assert block_hash._native_mix64 is not None, "p2pnode.cache._chain was not built: run scripts/bootstrap.sh"
    assert block_hash.mix64 is block_hash._native_mix64
    assert block_hash._native_mix64(h) == block_hash._mix64(h)
    with pytest.raises(TypeError, match="int"):
        block_hash._native_mix64(1.0)  # type: ignore[arg-type]
