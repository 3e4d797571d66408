"""The C extensions at the edges a review found them wrong at, each against its Python definition: a huge block size,
a buffer that is not bytes, a slot descriptor of another class, a NaN clock reading."""

from __future__ import annotations

import math

import pytest

from p2pnode.cache import block_hash

chain_c = pytest.importorskip("p2pnode.cache._chain").chain


@pytest.mark.parametrize("block_size", [2**62, 2**62 + 1, 2**63, 2**64])
def test_a_block_larger_than_any_prompt_holds_none(block_size: int) -> None:
    """block_size * 4 wrapped past 2**62: a division by zero killed the process (SIGFPE), or one-token blocks were
    hashed; past Py_ssize_t it was an OverflowError. The definition: no full block."""
    packed = b"\0" * 16
    assert chain_c(packed, block_size, 0) == block_hash._chain_bytes(packed, block_size, 0) == []
    assert chain_c([1, 2, 3, 4], block_size, 0) == []
    with pytest.raises(ValueError):
        chain_c([1, 2], -(2**70), 0)


def test_token_ids_read_from_any_buffer_are_those_of_its_bytes() -> None:
    """A buffer was read twice (count, then fill) in place: a bytearray changed between the passes overflowed the
    list counted for it. Any buffer but bytes is read from a copy."""
    wire = pytest.importorskip("p2pnode._token_wire")
    data = wire.pack(1, list(range(3, 23)))
    assert wire.unpack(bytearray(data), 1, True) == wire.unpack(data, 1, True)
    assert wire.unpack(memoryview(data), 1) == wire.unpack(data, 1)


def test_a_slot_descriptor_of_another_class_is_not_a_field() -> None:
    """Init took a field's offset from any member descriptor its name resolved to: another class's wrote past the
    instance (a heap overflow on every construction)."""
    frozen = pytest.importorskip("p2pnode._frozen")

    class Big:
        __slots__ = tuple(f"s{i}" for i in range(40))

    class Small:
        __slots__ = ()
        x = Big.__dict__["s39"]

    with pytest.raises(TypeError, match="not a slot"):
        frozen.Init(Small, ("x",), (0,), (0,), (None,), False)


def test_an_entry_whose_expiry_is_nan_expires_as_in_the_definition() -> None:
    """The C expiry kept what ``expires_at <= now`` did not drop: a NaN reading at the front stopped every later
    expiry."""
    from p2pnode.routing.speculative import DictSpeculativeIndex, SpeculativeIndex

    for cls in (DictSpeculativeIndex, SpeculativeIndex):
        index = cls(30.0, 100)
        index.record("a", [1, 2, 3], math.nan)
        assert index.expire(1e9) == 3 and len(index) == 0, cls
