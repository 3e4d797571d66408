"""Every peer's estimate of a request, kept as the directory found it until something reads them all.

The directory finds a request's estimates a depth at a time (``ClusterView.estimate_levels``: per depth, the peers
whose summaries reach it, a bitmask of their slots). A dict of them costs ~17 ns a peer to build -- ~16 us at 1,000
peers that each hold some of a prompt -- while a decision reads a handful of them (its candidates', the target's in
the ``Route``) and the depths (the deepest holders, the common prefix: from the levels). ``LevelEstimates`` keeps
them as the levels and an array of each peer slot's depth, which the directory's C writes from the levels' bitmasks
(~1 ns a peer); a read is the peer's slot and one array item, and the whole dict is built only when something reads
every estimate (iterating, ``items``, ``values``).

Invariants: a peer is in at most one level (only where every peer samples its summary at one stride, so levels are
never merged); a level's ids are a tuple that nothing changes; ``depths[slot]`` is the depth of the level holding the
slot's peer, 0 for none; the slots are the directory's as they were when the levels were found (``SlotOwners``:
once a slot changes owner the levels, not the array, answer); writes (the router's own match, the speculative
index's raises) go to an overlay read first, so the dict built later is the one a dict written the same way would
be, in the same order.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterator, MutableMapping
from typing import Any, Protocol

__all__ = [
    "CUT_REMEMBERED_ABOVE",
    "LAZY_ESTIMATES_ABOVE",
    "LevelCuts",
    "LevelEstimates",
    "SlotOwners",
    "levels_dict",
    "raised_levels",
]

#: Where more peers than this hold some of a request (and every peer samples at one stride), its estimates are a
#: ``LevelEstimates``; fewer: a dict of them costs less than the array's slower reads.
LAZY_ESTIMATES_ABOVE = 64


def levels_dict(levels: list[tuple[int, tuple[str, ...]]]) -> dict[str, int]:
    """``{node id: depth}`` of ``levels`` (``(depth, ids)``, each peer in one level), in the levels' order."""
    built: dict[str, int] = {}
    for depth, ids in levels:
        built.update(dict.fromkeys(ids, depth))
    return built


#: A level of more peers than this that a raised peer leaves or joins is moved through ``LevelCuts`` (remembered);
#: a smaller one at once.
CUT_REMEMBERED_ABOVE = 64


class LevelCuts:
    """A level's ids less a few and plus a few, made once per (level, ids left out, ids let in) while remembered: a
    prompt sent to the same peers again moves a mesh-wide level the same way, and the same tuple back keeps the
    readers' own memos of it (``PeerTable.sorted_alive``) answering. Keyed by the level tuple's identity, holding it
    (never reused while remembered); bounded by ``limit``, cleared when full."""

    __slots__ = ("_held", "limit")

    def __init__(self, limit: int = 256) -> None:
        self._held: dict[
            tuple[int, tuple[str, ...], tuple[str, ...]], tuple[tuple[str, ...], tuple[str, ...]]
        ] = {}
        self.limit = limit

    def moved(
        self, ids: tuple[str, ...], gone: tuple[str, ...], joined: tuple[str, ...]
    ) -> tuple[str, ...] | None:
        """``ids`` without ``gone``, in their order, then ``joined`` (each sorted: the key); None where ``ids`` lacks
        one of ``gone``."""
        key = (id(ids), gone, joined)
        held = self._held.get(key)
        if held is not None and held[0] is ids:
            return held[1]
        kept = [node_id for node_id in ids if node_id not in gone] if gone else ids
        if len(kept) != len(ids) - len(gone):
            return None
        if len(self._held) >= self.limit:
            self._held.clear()
        out = (*kept, *joined)
        self._held[key] = (ids, out)
        return out


try:  # the same in C (routing/native/raised_levels.h; tests/unit/test_routing_levels.py): ~5x faster
    from p2pnode.routing._p2p import raised_levels as _native_raised_levels
except ImportError:  # pragma: no cover - built by make bootstrap
    _native_raised_levels = None


def raised_levels(
    levels: list[tuple[int, tuple[str, ...]]],
    raised: dict[str, int],
    left: dict[int, list[str]],
    cuts: LevelCuts | None = None,
) -> list[tuple[int, tuple[str, ...]]] | None:
    """``levels`` with the ``raised`` peers at their new depths (``{node id: depth}``, each deeper than it was): out of
    the levels of the depths they ``left`` (``{depth: the raised ids it held}``; a large level moved through ``cuts``
    when given), into the level of their new depth, made where there is none -- still deepest first, one per depth, each
    peer in one. Only those levels are read, in a copy of the list, shallowest first (so an insertion or a removal
    moves none still to do). The speculative index raises a few peers' estimates at a busy ingress (a prompt just
    sent there); the readers of the levels (the deepest holders, the common prefix, the homes) then keep reading the
    few deepest levels instead of sorting every peer's estimate. None where a level lacks a peer ``left`` says it
    held, or there is no such level (levels and estimates that disagree): the caller then reads the estimates as a
    whole. This Python is the definition; the C answers the same on the common path."""
    if _native_raised_levels is not None:
        moved = _native_raised_levels(levels, raised, left, cuts, CUT_REMEMBERED_ABOVE)
        if moved is not NotImplemented:
            return moved  # type: ignore[no-any-return]
    return _raised_levels(levels, raised, left, cuts)


def _raised_levels(
    levels: list[tuple[int, tuple[str, ...]]],
    raised: dict[str, int],
    left: dict[int, list[str]],
    cuts: LevelCuts | None = None,
) -> list[tuple[int, tuple[str, ...]]] | None:
    """``raised_levels``' definition."""
    joining: dict[int, list[str]] = {}
    for node_id, depth in raised.items():
        joining.setdefault(depth, []).append(node_id)
    out = levels.copy()
    at = {level[0]: i for i, level in enumerate(levels)}
    for depth in sorted({*joining, *left}):  # shallowest first: the end of the list first
        i = at.get(depth)
        if i is None:
            i = bisect_left(out, -depth, key=_minus_depth)
        if i < len(out) and out[i][0] == depth:
            ids = out[i][1]
            gone = left.get(depth, ())
            new = joining.get(depth, ())
            if cuts is not None and len(ids) > CUT_REMEMBERED_ABOVE:
                moved = cuts.moved(ids, tuple(sorted(gone)), tuple(sorted(new)))
                if moved is None:
                    return None  # not where its estimate says: the caller reads the estimates instead
                ids = moved
            else:
                if gone:
                    kept = list(ids)
                    try:
                        for node_id in gone:
                            kept.remove(node_id)  # a scan at C speed per raised peer (a few), not a pass in Python
                    except ValueError:
                        return None  # not where its estimate says: the caller reads the estimates instead
                    ids = tuple(kept)
                if new:
                    ids = (*ids, *new)
            if ids:
                out[i] = (depth, ids)
            else:
                del out[i]
        elif depth in left:
            return None  # no level where a raised peer's estimate says it was: the caller reads the estimates instead
        else:
            out.insert(i, (depth, tuple(joining[depth])))  # (a depth none held: only joiners)
    return out


def _minus_depth(level: tuple[int, tuple[str, ...]]) -> int:
    return -level[0]


class SlotOwners(Protocol):
    """The directory's peer slots (bit i of a peer bitmask: slot i)."""

    #: Moves whenever a slot changes owner (a peer added or removed).
    slot_epoch: int

    def slot_of(self, node_id: str) -> int | None: ...


class LevelEstimates(MutableMapping[str, int]):
    """``{node id: estimated match in blocks}`` read from ``depths`` (a depth per peer slot, 0 for none) while the
    directory's ``slots`` keep their owners, else from ``levels`` (``(depth, ids)``, each peer in one level); the whole
    dict built only when every item is read (module docstring)."""

    __slots__ = ("_count", "_depths", "_dict", "_epoch", "_levels", "_overlay", "_slots")

    def __init__(
        self, levels: list[tuple[int, tuple[str, ...]]], depths: array[int], slots: SlotOwners, count: int | None = None
    ) -> None:
        self._levels = levels
        self._depths = depths
        self._slots = slots
        self._epoch = slots.slot_epoch
        #: The levels' ids (given where the caller counted them already), then the overlay's new ones.
        self._count = sum([len(ids) for _, ids in levels]) if count is None else count
        self._overlay: dict[str, int] = {}
        self._dict: dict[str, int] | None = None

    def _current(self) -> dict[str, int] | None:
        """The dict, where it is built -- and built now where a slot changed owner since the levels were found (the
        array no longer says whose depth is whose; the levels do)."""
        if self._dict is None and self._slots.slot_epoch != self._epoch:
            self.materialize()
        return self._dict

    def _found(self, node_id: str) -> int | None:
        slot = self._slots.slot_of(node_id)
        if slot is None or slot >= len(self._depths):
            return None
        return self._depths[slot] or None

    def materialize(self) -> dict[str, int]:
        """The estimates as a dict, in the levels' order (built once; every later read and write goes to it)."""
        if self._dict is None:
            built = levels_dict(self._levels)
            built.update(self._overlay)
            self._dict = built
        return self._dict

    def get(self, node_id: str, default: Any = None) -> Any:
        built = self._current()
        if built is not None:
            return built.get(node_id, default)
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
        built = self._current()
        if built is not None:
            built[node_id] = blocks
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
