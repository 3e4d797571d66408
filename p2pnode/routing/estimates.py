"""Every peer's estimate of a request, kept as the directory found it until something reads them all.

The directory finds a request's estimates a depth at a time (``ClusterView.estimate_levels``: per depth, the peers
whose summaries reach it). A dict of them costs ~20 ns a peer to build -- ~20 us at 1,000 peers when a prefix is
cached mesh-wide -- while a decision reads a handful of them (its candidates', the target's in the ``Route``) and
the depths (the deepest holders, the common prefix: from the levels). ``LevelEstimates`` keeps the peers of a large
level (more than ``LAZY_LEVEL_ABOVE``: a prefix many peers cache) as that level, searched through its set (remembered
per level by a ``LevelMemo``, as the peer table remembers a level's sorted alive peers), the rest in
a dict, and builds the whole dict only when something reads every estimate (iterating, ``items``, ``values``).

Invariants: a peer is in at most one level; a level's ids are a tuple that nothing changes (the directory's
cached decoding of a peer bitmask; only where every peer samples its summary at one stride, so levels are never
merged into new tuples); ``small`` holds exactly the peers of the levels of at most ``LAZY_LEVEL_ABOVE``; writes
(the router's own match, the speculative index's raises) go to an overlay read first, so the dict built later is
the one a dict written the same way would be, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, Generic, TypeVar

__all__ = ["LAZY_LEVEL_ABOVE", "MAX_LEVEL_SETS", "LevelEstimates", "LevelMemo"]

V = TypeVar("V")

#: A level of more peers than this is kept as the level (its peers read through a set, ``LevelMemo``), not
#: written into the estimates' dict: 64 dict writes cost about what the set probes of a decision's reads do.
LAZY_LEVEL_ABOVE = 64

#: How many levels' sets the directory's ``LevelMemo`` keeps (cleared when full): a set of 1,000 ids takes ~40 KB, so
#: ~5 MB at most; the levels that recur (a prefix cached by the same peers) are far fewer.
MAX_LEVEL_SETS = 128


class LevelMemo(Generic[V]):
    """A value made once per level's ids (a tuple the directory hands out again: it remembers the ids of each peer
    bitmask), so a read of a mesh-wide level costs a lookup, not a pass over its peers: its set here, its sorted
    alive peers in the peer table. Keyed by the tuple's identity, holding the tuple (so the key is never reused while
    remembered). Bounded by ``limit``: cleared when full."""

    __slots__ = ("_held", "limit")

    def __init__(self, limit: int) -> None:
        self._held: dict[int, tuple[tuple[str, ...], V]] = {}
        self.limit = limit

    def get(self, ids: tuple[str, ...], make: Callable[[tuple[str, ...]], V]) -> V:
        """``make(ids)``, made once while remembered."""
        held = self._held.get(id(ids))
        if held is not None and held[0] is ids:
            return held[1]
        if len(self._held) >= self.limit:
            self._held.clear()
        made = make(ids)
        self._held[id(ids)] = (ids, made)
        return made

    def clear(self) -> None:
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)


class LevelEstimates(MutableMapping[str, int]):
    """``{node id: estimated match in blocks}``: ``small``, the peers of the small levels, and the large ones read
    from ``levels`` (``(depth, ids)``, each peer in one level, ``small``'s included), the whole dict built only when
    every item is read (module docstring)."""

    __slots__ = ("_count", "_dict", "_large", "_levels", "_overlay", "_sets", "_small")

    def __init__(
        self, levels: list[tuple[int, tuple[str, ...]]], small: dict[str, int], sets: LevelMemo[frozenset[str]]
    ) -> None:
        self._levels = levels
        self._small = small
        self._large = [(depth, ids) for depth, ids in levels if len(ids) > LAZY_LEVEL_ABOVE]
        self._sets = sets
        self._count = len(small) + sum(len(ids) for _, ids in self._large)
        self._overlay: dict[str, int] = {}
        self._dict: dict[str, int] | None = None

    def _found(self, node_id: str) -> int | None:
        depth = self._small.get(node_id)
        if depth is None:
            for at, ids in self._large:
                if node_id in self._sets.get(ids, frozenset):
                    return at
        return depth

    def materialize(self) -> dict[str, int]:
        """The estimates as a dict, in the levels' order (built once; every later read and write goes to it)."""
        if self._dict is None:
            built: dict[str, int] = {}
            for depth, ids in self._levels:
                built.update(dict.fromkeys(ids, depth))
            built.update(self._overlay)
            self._dict = built
        return self._dict

    def get(self, node_id: str, default: Any = None) -> Any:
        if self._dict is not None:
            return self._dict.get(node_id, default)
        held = self._overlay.get(node_id)
        if held is None:
            held = self._found(node_id)
        return default if held is None else held

    def __getitem__(self, node_id: str) -> int:
        value = self.get(node_id)
        if value is None:
            raise KeyError(node_id)
        return value

    def __contains__(self, node_id: object) -> bool:
        return self.get(node_id) is not None  # type: ignore[arg-type]

    def __setitem__(self, node_id: str, blocks: int) -> None:
        if self._dict is not None:
            self._dict[node_id] = blocks
            return
        if node_id not in self._overlay and self._found(node_id) is None:
            self._count += 1
        self._overlay[node_id] = blocks

    def __delitem__(self, node_id: str) -> None:
        del self.materialize()[node_id]

    def popitem(self) -> tuple[str, int]:
        return self.materialize().popitem()  # the last, as a dict's

    def copy(self) -> dict[str, int]:
        """A dict of the estimates (a copy shares nothing with this mapping)."""
        return dict(self.materialize())

    __copy__ = copy

    def __len__(self) -> int:
        return len(self._dict) if self._dict is not None else self._count

    def __iter__(self) -> Iterator[str]:
        return iter(self.materialize())

    def keys(self):  # type: ignore[override]  # the dict's views: a mesh-wide level is read at C speed
        return self.materialize().keys()

    def items(self):  # type: ignore[override]
        return self.materialize().items()

    def values(self):  # type: ignore[override]
        return self.materialize().values()

    def __eq__(self, other: object) -> bool:
        return self.materialize() == (other.materialize() if isinstance(other, LevelEstimates) else other)

    __hash__ = None  # type: ignore[assignment]  # a mapping, as a dict

    def __repr__(self) -> str:
        return f"LevelEstimates({self.materialize()!r})"
