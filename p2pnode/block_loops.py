"""The per-block loops of a simulated KV cache and of the simulator's gossip model: the Python definitions, and their
C twins where the extension is built (``p2pnode/native/block_loops.c``).

A simulated request walks its chain of block hashes a few times -- its cached prefix when it is admitted
(``cached_prefix``, ``pin``), its computed blocks when they are stored (``store_scan``), its release (``unpin``) --
and the eviction policy and the gossip model walk the same blocks again (``set_none``, ``delete_keys``,
``apply_journal``, ``prefix_depths``). Each walk is a dict read and write per block: as Python loops ~20% of a
simulated request. Every name below is the C function when ``NATIVE``, else the Python of the same name in
``PYTHON``; tests/unit/test_block_loops.py holds the C to the Python over random inputs, and a simulated run gives
the same results either way.

Their contract is the simulator's, narrower than the Python's: keys are ints (block hashes: a key whose ``__hash__``
or ``__eq__`` runs Python code could change the list the C walks under it), counts plain ints below 2**63, plain
dicts (no ``__missing__``), and ``n`` / ``lo`` non-negative ints.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

__all__ = [
    "NATIVE",
    "PYTHON",
    "apply_journal",
    "cached_prefix",
    "delete_keys",
    "pin",
    "prefix_depths",
    "prefix_depths_by",
    "set_none",
    "store_scan",
    "unpin",
]


def cached_prefix(refs: dict[int, int], chain: Sequence[int], cap: int) -> tuple[int, list[int]]:
    """How many leading blocks of ``chain[:cap]`` are cached (keys of ``refs``, block -> pin count), and those of
    them that were evictable (a count of 0), in chain order."""
    m = 0
    fresh = []
    while m < cap:
        c = refs.get(chain[m])
        if c is None:
            break
        if c == 0:
            fresh.append(chain[m])
        m += 1
    return m, fresh


def pin(refs: dict[int, int], hashes: Sequence[int]) -> None:
    """One more pin on each of ``hashes`` (all cached)."""
    for h in hashes:
        refs[h] += 1


def unpin(refs: dict[int, int], chain: Sequence[int], n: int) -> list[int]:
    """One pin less on each of ``chain[:n]``, last first (eviction order); the blocks no request pins any more, in
    that order."""
    freed = []
    for h in reversed(chain[:n]):
        c = refs[h] - 1
        refs[h] = c
        if not c:
            freed.append(h)
    return freed


def store_scan(
    refs: dict[int, int], chain: Sequence[int], lo: int, hi: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Blocks ``lo..hi-1`` of ``chain`` computed by one request: each new one cached with one pin, each cached one
    (computed concurrently by another request) pinned once more. Returns the new blocks, the cached ones, those of
    the cached ones that were evictable, and the runs of new blocks as ``[start, end, start, end, ...]`` (the
    half-open ranges of ``chain`` a stored event names)."""
    new: list[int] = []
    dups: list[int] = []
    fresh: list[int] = []
    runs: list[int] = []
    run_start = -1
    for i in range(lo, hi):
        h = chain[i]
        c = refs.get(h)
        if c is None:
            refs[h] = 1
            new.append(h)
            if run_start < 0:
                run_start = i
            continue
        refs[h] = c + 1
        dups.append(h)
        if c == 0:
            fresh.append(h)
        if run_start >= 0:
            runs += (run_start, i)
            run_start = -1
    if run_start >= 0:
        runs += (run_start, hi)
    return new, dups, fresh, runs


def set_none(mapping: MutableMapping[Any, None], keys: Sequence[Any]) -> None:
    """``mapping[k] = None`` for each key, in order (an ``OrderedDict`` used as a queue: ``cache/eviction/lru.py``)."""
    for k in keys:
        mapping[k] = None


def delete_keys(mapping: MutableMapping[Any, Any], keys: Sequence[Any]) -> None:
    """``del mapping[k]`` for each key, in order."""
    for k in keys:
        del mapping[k]


def apply_journal(inverted: dict[int, int], bit: int, changes: Sequence[int]) -> None:
    """One node's summary changes (journal entries: a hash added, ``~hash`` removed) into an inverted index of node
    bitmasks: ``bit`` set in an added hash's mask, cleared in a removed one's (the key dropped once its mask is 0)."""
    get = inverted.get
    clear = ~bit
    for h in changes:
        if h >= 0:
            inverted[h] = get(h, 0) | bit
        else:
            h = ~h
            m = get(h, 0) & clear
            if m:
                inverted[h] = m
            else:
                inverted.pop(h, None)


def prefix_depths_by(hashes: Sequence[int], mask_of: Callable[[int, int], int], ids: Sequence[str]) -> dict[str, int]:
    """``{node id: how many leading hashes of the chain it holds}`` for the nodes holding at least one, where
    ``mask_of(h, 0)`` is the bitmask of the nodes (bit k: ``ids[k]``) holding ``h``: one pass, stopping once none
    holds the chain any further."""
    alive = (1 << len(ids)) - 1
    out: dict[str, int] = {}
    i = 0
    for h in hashes:
        m = mask_of(h, 0)
        lost = alive & ~m
        if lost:
            if i:
                while lost:
                    b = lost & -lost
                    out[ids[b.bit_length() - 1]] = i
                    lost ^= b
            alive &= m
            if not alive:
                return out
        i += 1
    if i:
        while alive:
            b = alive & -alive
            out[ids[b.bit_length() - 1]] = i
            alive ^= b
    return out


def prefix_depths(hashes: Sequence[int], inverted: dict[int, int], ids: Sequence[str]) -> dict[str, int]:
    """``prefix_depths_by`` with the masks of the inverted index ``inverted`` (block hash -> node bitmask)."""
    return prefix_depths_by(hashes, inverted.get, ids)


#: The Python definitions, by name (what the tests hold the C to).
PYTHON: dict[str, Callable[..., Any]] = {
    fn.__name__: fn
    for fn in (cached_prefix, pin, unpin, store_scan, set_none, delete_keys, apply_journal, prefix_depths)
}

try:
    from p2pnode import _block_loops as _native
except ImportError:  # no C compiler at install: the Python above
    NATIVE = False
else:
    NATIVE = True
    cached_prefix = _native.cached_prefix
    pin = _native.pin
    unpin = _native.unpin
    store_scan = _native.store_scan
    set_none = _native.set_none
    delete_keys = _native.delete_keys
    apply_journal = _native.apply_journal

    def prefix_depths(hashes: Sequence[int], inverted: dict[int, int], ids: Sequence[str]) -> dict[str, int]:
        """``prefix_depths_by`` over ``inverted``'s masks: in C up to 64 nodes, else the Python."""
        out = _native.prefix_depths(hashes, inverted, ids)
        if out is NotImplemented:
            return prefix_depths_by(hashes, inverted.get, ids)
        return out
