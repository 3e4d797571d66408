"""The peers' summaries as one table: summary key -> bitmask of the peer slots publishing it.

Every routing decision probes this index about twice per sampled depth of its request (``deepest_published``). As a
dict of int keys and int bitmasks each probe reads the dict's index, its entry, the key object and the bitmask object:
three or four cache misses once a mesh's many prompts outgrow the CPU's caches, which is what a decision over a
working set of hundreds of prompts paid. ``MaskTable`` is the same mapping in C (``cache/native/mask_table.h``): each
entry its 32-bit key beside its bitmask's machine words, found by linear probing, so a probe that finds its key reads
one entry. ``DictMaskTable`` below is the definition, and the fallback where the extension is not built.

Invariants (both): a key is in the table iff some slot publishes it (a key whose last bit is cleared leaves); keys are
summary keys, ints in [0, 2**32) (OverflowError otherwise); slots are ints in [0, MAX_SLOTS) (ValueError otherwise);
``set_bits`` / ``clear_bits`` apply the keys before a bad one. The C table's size: its rows (``nbytes``) are
``8 * (1 + width)`` bytes each, at most twice as many rows as keys, ``width`` the 64-bit words of the highest slot
ever set (1 up to 64 peers; 16 at the 1,024-member cap).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

__all__ = ["MAX_SLOTS", "NATIVE_MASK_TABLE", "DictMaskTable", "MaskTable"]

#: The most slots a bitmask may name (the C's MASK_TABLE_MAX_SLOTS): far past the gossip's member cap (1,024).
MAX_SLOTS = 1 << 16

_KEY_LIMIT = 1 << 32


def _check_key(key: object) -> int:
    if not isinstance(key, int):
        raise TypeError(f"a summary key must be an int, got {type(key).__name__}")
    if not 0 <= key < _KEY_LIMIT:
        raise OverflowError("a summary key must be in [0, 2**32)")
    return key


def _check_slot(slot: object) -> int:
    if not isinstance(slot, int) or not 0 <= slot < MAX_SLOTS:
        raise ValueError(f"a slot must be an int in [0, {MAX_SLOTS})")
    return slot


class DictMaskTable:
    """``MaskTable``'s definition: a dict of summary key -> non-zero int bitmask (bit i: slot i)."""

    __slots__ = ("_highest", "_masks")

    def __init__(self) -> None:
        self._masks: dict[int, int] = {}
        self._highest = 0  # the highest slot ever set (width)

    # only summary keys are ever stored: any other int is simply absent, and anything else too (as the C answers it)
    def get(self, key: object, default: object = 0) -> object:
        return self._masks.get(key, default) if isinstance(key, int) else default

    def __getitem__(self, key: object) -> int:
        if key in self:
            return self._masks[key]  # type: ignore[index]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and key in self._masks

    def __len__(self) -> int:
        return len(self._masks)

    def set_bits(self, keys: Iterable[int], slot: int) -> None:
        bit = 1 << _check_slot(slot)
        self._highest = max(self._highest, slot)
        masks = self._masks
        for key in keys:
            _check_key(key)
            masks[key] = masks.get(key, 0) | bit

    def clear_bits(self, keys: Iterable[int], slot: int) -> None:
        clear = ~(1 << _check_slot(slot))
        masks = self._masks
        for key in keys:
            _check_key(key)
            mask = masks.get(key, 0) & clear
            if mask:
                masks[key] = mask
            else:
                masks.pop(key, None)

    def items(self) -> list[tuple[int, int]]:
        return list(self._masks.items())

    @property
    def width(self) -> int:
        """64-bit words per bitmask, as the C table sizes its rows (the highest slot ever set)."""
        width = 1
        while width * 64 <= self._highest:
            width *= 2
        return width

    @property
    def nbytes(self) -> int:
        return sys.getsizeof(self._masks) + sum(sys.getsizeof(k) + sys.getsizeof(m) for k, m in self._masks.items())


try:
    from p2pnode.cache._chain import MaskTable as _NativeMaskTable
except ImportError:  # the extension is optional (pyproject.toml)
    _NativeMaskTable = None

#: Whether ``MaskTable`` is the C table (``deepest_published`` reads it without a Python call per probe).
NATIVE_MASK_TABLE = _NativeMaskTable is not None
MaskTable: type = _NativeMaskTable if _NativeMaskTable is not None else DictMaskTable
