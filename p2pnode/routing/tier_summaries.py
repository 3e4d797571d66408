"""What peers' summaries say their KV tiers hold: one medium's published block hashes, for every peer at once.

A node with a host (or disk) tier under its engine publishes that tier's cached blocks as a summary of its own
(``cache/summary.py``: ``SUMMARY_FAMILIES``), beside its engine's. ``TierSummaries`` reads one medium's summaries of
every peer, as ``ClusterView`` reads the engine's: per peer its live set of summary keys and stride; an inverted
index ``summary key -> bitmask of peers`` publishing it (a ``MaskTable``, ``mask_table.py``), so that ``estimate``
answers for every peer at once with two probes per sampled depth of the request. The estimate of a peer's tier for
a chain h_1..h_n is the deepest depth d, a multiple of that peer's stride s in this medium, whose key (h_d's) it
publishes, with h_{d-s}'s past the first stride (``deepest_published``): what it could load from that tier if its
engine held the prefix before it (the router takes the cumulative depth: ``routing/router.py``).

Invariants: ``inverted[h]`` has the bit of peer p iff p's summary of this medium publishes h; a peer whose meta says
another block size, or that is not usable (the caller's mask), is never matched. Peers are named by their slot bit
in the owning view, whose ``ids_of`` decodes a bitmask.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

from p2pnode.cache.summary import SummaryFamily, SummaryMeta, decode_meta
from p2pnode.cache.summary_log import SUMMARY_KEY_MASK, SummaryReader
from p2pnode.routing.mask_table import NATIVE_MASK_TABLE, MaskTable

__all__ = ["DECODE_AT_MOST", "TierSummaries", "deepest_published", "ids_at_slots"]

try:  # the same loops in C (cache/native/chain.c): at 1,000 peers that all match, 49.5 -> 22.8 us
    from p2pnode.cache._chain import deepest_in as _native_deepest
    from p2pnode.cache._chain import ids_of_mask as _native_ids_at_slots
except ImportError:  # pragma: no cover - a build without a C compiler
    _native_deepest = _native_ids_at_slots = None
#: The indexes deepest_in reads itself (a ``DictMaskTable`` is read by the definition's loop).
_NATIVE_INVERTED = (dict, MaskTable) if NATIVE_MASK_TABLE else (dict,)

#: The most peers of a level ``deepest_published`` decodes from the view's slots rather than look up or ask its
#: ``ids_of`` (which remembers them): a few ids cost less to decode in C than a Python call, and a level of a few
#: peers rarely recurs across prompts, while one that many peers share does (a system prompt cached mesh-wide).
DECODE_AT_MOST = 16


def ids_at_slots(mask: int, slot_ids: list[str | None]) -> tuple[str, ...]:
    """The node ids at the set bits of ``mask``, lowest bit first (bit i: ``slot_ids[i]``); a bit past the list
    raises IndexError, one at a slot that holds no id (None) TypeError, a negative mask ValueError. In C where
    built (``_chain.ids_of_mask``)."""
    if _native_ids_at_slots is not None:
        return _native_ids_at_slots(mask, slot_ids)
    if mask < 0:
        raise ValueError("a bitmask must not be negative")
    ids: list[str] = []
    while mask:
        low = mask & -mask
        node_id = slot_ids[low.bit_length() - 1]
        if not isinstance(node_id, str):
            raise TypeError(f"a bitmask sets slot {low.bit_length() - 1}, which holds no peer")
        ids.append(node_id)
        mask ^= low
    return tuple(ids)


def deepest_published(
    block_hashes: Sequence[int],
    groups: list[tuple[int, int]],
    inverted: dict[int, int] | MaskTable,
    ids_of: Callable[[int], tuple[str, ...]],
    levels: list[tuple[int, tuple[str, ...]]] | None = None,
    known: dict[int, tuple[str, ...]] | None = None,
    depths: array[int] | None = None,
    slot_ids: list[str | None] | None = None,
) -> dict[str, int]:
    """``{node id: deepest depth d of block_hashes whose summary key it publishes}`` for the peers of ``groups``
    (stride -> bitmask of peers sampled at that stride) that publish any, from ``inverted`` (summary key -> bitmask
    of the peers publishing it: a dict or a ``MaskTable``): two probes per sampled depth of each stride, whatever
    the number of peers.

    A peer takes depth d only where it also publishes the key of depth d - stride (d = stride: no such check): its
    published prefixes are whole from their first sampled depth, so this costs a true estimate nothing but a run of a
    single sampled depth in a tier's summary, and a 32-bit key that collides with the request's (``summary_log.py``,
    "Why 32 bits") can raise an estimate by one stride past a true match at most, where alone it could claim any
    depth. ``levels``, when given, receives the same answer grouped: one ``(depth, node ids)`` per depth found,
    deepest first within each stride, so that a caller can read the deepest peers without a pass over every one.
    ``known``: bitmasks whose ids ``ids_of`` remembers, read first (a call saved per depth found). ``slot_ids``: each
    peer slot's node id, which a level of at most ``DECODE_AT_MOST`` peers is decoded from (``ids_at_slots``) instead
    of ``known`` and ``ids_of`` -- the same ids where they agree, as a view's do. ``depths``: an
    ``array('I')`` with an item per peer slot (bit i of a bitmask: slot i), where each level's depth is written at its
    peers' slots instead of into the answer, which is then empty (a peer's estimate read by its slot,
    ``estimates.LevelEstimates``); a bit past its end raises ValueError."""
    # the same loop in C (exact types: a subclass's own lookups would be bypassed), its answer in a dict sized for it
    native = _native_deepest is not None and type(groups) is list and type(inverted) in _NATIVE_INVERTED
    if native and type(block_hashes) in (list, tuple):
        return _native_deepest(block_hashes, groups, inverted, ids_of, levels, known, depths, slot_ids)
    result: dict[str, int] = {}
    n = len(block_hashes)
    for stride, mask in groups:
        remaining = mask
        depth = n - n % stride
        bits = inverted.get(block_hashes[depth - 1] & SUMMARY_KEY_MASK, 0) if depth >= stride else 0
        while depth >= stride and remaining:
            # -1: every bit (the first stride has no depth before it)
            below = inverted.get(block_hashes[depth - stride - 1] & SUMMARY_KEY_MASK, 0) if depth > stride else -1
            hit = bits & below & remaining
            if hit:
                remaining ^= hit
                if depths is not None:
                    _write_slots(depths, hit, depth)
                if slot_ids is not None and hit.bit_count() <= DECODE_AT_MOST:
                    ids = ids_at_slots(hit, slot_ids)
                else:
                    ids = known.get(hit) if known is not None else None
                    if ids is None:
                        ids = ids_of(hit)
                if depths is None:
                    for node_id in ids:  # cheaper than update(dict.fromkeys(...)) at every size of hit
                        result[node_id] = depth
                if levels is not None:
                    levels.append((depth, ids))
            bits = below
            depth -= stride
    return result


def _write_slots(depths: array[int], mask: int, depth: int) -> None:
    """``depths[i] = depth`` for every set bit i of ``mask``."""
    if mask < 0:
        raise ValueError("a bitmask must not be negative")
    if mask.bit_length() > len(depths):
        raise ValueError(f"depths holds {len(depths)} slots, a bitmask sets slot {mask.bit_length() - 1}")
    while mask:
        low = mask & -mask
        depths[low.bit_length() - 1] = depth
        mask ^= low


class _PeerTier:
    """One peer's summary of one medium."""

    __slots__ = ("meta", "reader")

    def __init__(self, family: SummaryFamily) -> None:
        self.reader = SummaryReader(family.log)
        self.meta: SummaryMeta | None = None


class TierSummaries:
    """Every peer's summary of one medium (module docstring)."""

    def __init__(self, family: SummaryFamily, block_size: int | None) -> None:
        self.family = family
        self.block_size = block_size
        self._peers: dict[int, _PeerTier] = {}  # peer bit -> its summary
        self._inverted = MaskTable()  # summary key -> bitmask of the peers publishing it
        # stride -> bitmask of peers with a summary of that stride; rebuilt after a change
        self._groups: list[tuple[int, int]] | None = None

    def owns(self, key: str) -> bool:
        return key == self.family.meta_key or self.family.log.owns(key)

    def hashes(self, bit: int) -> int:
        """How many hashes the peer of ``bit`` publishes in this medium."""
        peer = self._peers.get(bit)
        return len(peer.reader.hashes) if peer is not None else 0

    def stride(self, bit: int) -> int | None:
        peer = self._peers.get(bit)
        meta = peer.meta if peer is not None else None
        if meta is None or (self.block_size is not None and meta.block_size != self.block_size):
            return None
        return meta.stride

    def apply(self, bit: int, key: str, value: bytes | None) -> None:
        """A gossiped change of the peer of ``bit`` to one of this medium's keys (``owns``)."""
        peer = self._peers.get(bit)
        if peer is None:
            peer = self._peers[bit] = _PeerTier(self.family)
        if key == self.family.meta_key:
            peer.meta = decode_meta(value) if value is not None else None
            self._groups = None
            return
        had = bool(peer.reader.hashes)
        change = peer.reader.apply(key, value)
        if change is None:
            return
        added, removed = change
        slot = bit.bit_length() - 1
        if removed:
            self._inverted.clear_bits(removed, slot)
        if added:
            self._inverted.set_bits(added, slot)
        if had != bool(peer.reader.hashes):
            self._groups = None

    def drop(self, bit: int) -> None:
        """The peer of ``bit`` is gone from the view (its slot may be reused)."""
        peer = self._peers.pop(bit, None)
        if peer is None:
            return
        self._inverted.clear_bits(peer.reader.hashes, bit.bit_length() - 1)
        self._groups = None

    @property
    def published(self) -> bool:
        """Whether any peer publishes a summary of this medium."""
        return bool(self._inverted)

    def changed(self) -> None:
        """Liveness moved: the groups are rebuilt at the next estimate."""
        self._groups = None

    def estimate(
        self, block_hashes: Sequence[int], usable: int, ids_of: Callable[[int], tuple[str, ...]]
    ) -> dict[str, int]:
        """``{node id: deepest depth of block_hashes its summary of this medium publishes}`` for the peers of the
        ``usable`` bitmask whose estimate is not 0."""
        if not self._inverted:
            return {}
        groups = self._groups if self._groups is not None else self._rebuild_groups()
        usable_groups = [(stride, mask & usable) for stride, mask in groups]
        return deepest_published(block_hashes, usable_groups, self._inverted, ids_of)

    def _rebuild_groups(self) -> list[tuple[int, int]]:
        masks: dict[int, int] = {}
        for bit, peer in self._peers.items():
            stride = self.stride(bit)
            if stride is not None and peer.reader.hashes:
                masks[stride] = masks.get(stride, 0) | bit
        self._groups = sorted(masks.items())
        return self._groups
