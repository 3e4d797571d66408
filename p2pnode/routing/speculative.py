"""The ingress's speculative index: "I just sent this prefix to that peer", believed for a short TTL.

Gossip needs a round or more to report that a peer cached a new prefix. Without this index a burst of requests
sharing a new prefix scatters across the mesh during that delay; with it, the burst co-locates on the first
peer chosen (Dynamo's predicted-TTL index, llm-d's speculative indexing). Gossip confirms the entry (it then
comes from the real summary) or the TTL expires it.

Invariants: at most ``max_entries`` block hashes are held (least recently recorded dropped first); an entry is
never reported after its expiry; per peer, what is held is *prefix-closed* along any recorded chain: if the peer
holds ``h_d`` unexpired, it holds ``h_1..h_(d-1)`` unexpired too. Why it holds: a record covers a whole chain from
its first block, with one expiry, so a shallower block's expiry is never earlier than a deeper one's; and a chain is
recorded deepest block first, so its shallow blocks are the most recent and are evicted last. Lookups use it:
a binary search over the request's depth, O(log blocks) probes per peer believed to hold its first block.

``SpeculativeIndex`` is the same index in C (``routing/native/speculative.c``: an entry one 56-byte row, ~64 bytes
with its table slot, instead of an OrderedDict node, an object, a dict of peers and two floats, ~320; a 4,096-token
prompt's record ~6x faster, a lookup where several peers hold it at different depths ~10x), held to
``DictSpeculativeIndex`` below -- the definition, and the fallback where the extension is not built -- operation by
operation (tests/unit/test_speculative.py). Both take peers as str and block hashes as ints in [0, 2**64): ``record``
raises TypeError / OverflowError for anything else before it changes anything, and a lookup finds nothing for them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from p2pnode.config import DEFAULT_SPECULATIVE_MAX_ENTRIES, DEFAULT_SPECULATIVE_TTL_S

_HASH_LIMIT = 1 << 64


def _check_record(peer: object, block_hashes: Sequence[object]) -> None:
    """What the C index can hold (module docstring), checked before a record changes anything."""
    if type(peer) is not str:
        raise TypeError(f"peer must be a str, got {type(peer).__name__}")
    for i, h in enumerate(block_hashes):
        if not isinstance(h, int):
            raise TypeError(f"block_hashes[{i}] must be an int, got {type(h).__name__}")
        if not 0 <= h < _HASH_LIMIT:
            raise OverflowError(f"block_hashes[{i}] must be in [0, 2**64)")


@dataclass(slots=True)
class _Entry:
    expires_at: float
    peers: dict[str, float]  # peer -> expiry


class DictSpeculativeIndex:
    """Block hash -> peers believed to hold it (until their expiry): ``SpeculativeIndex``'s definition."""

    def __init__(
        self, ttl_s: float = DEFAULT_SPECULATIVE_TTL_S, max_entries: int = DEFAULT_SPECULATIVE_MAX_ENTRIES
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._latest = float("-inf")  # the latest expiry recorded
        self._in_expiry_order = True  # whether ``_entries``' order is their expiry order (``expire``)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def in_expiry_order(self) -> bool:
        """Whether the record order is the expiry order (``expire`` then reads only the front)."""
        return self._in_expiry_order

    @property
    def peers(self) -> int:
        """The peers some entry holds."""
        return len({peer for entry in self._entries.values() for peer in entry.peers})

    def entries(self) -> list[tuple[int, float, dict[str, float]]]:
        """``(hash, expires_at, {peer: expiry})`` per entry, in record order (least recently recorded first)."""
        return [(h, e.expires_at, dict(e.peers)) for h, e in self._entries.items()]

    def record(self, peer: str, block_hashes: Sequence[int], now: float) -> None:
        """``peer`` will hold every block of this chain once it serves the request."""
        _check_record(peer, block_hashes)
        expires = now + self.ttl_s
        entries = self._entries
        if expires < self._latest:
            self._in_expiry_order = False  # an earlier expiry than one recorded before: ``expire`` scans them all
        else:
            self._latest = expires
        get, to_end = entries.get, entries.move_to_end
        for h in reversed(block_hashes):  # deepest first: shallow blocks are evicted last (module invariant)
            entry = get(h)
            if entry is None:
                entries[h] = _Entry(expires, {peer: expires})
                continue
            to_end(h)
            entry.peers[peer] = expires
            if expires > entry.expires_at:
                entry.expires_at = expires
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def match_blocks(self, peer: str, block_hashes: Sequence[int], now: float) -> int:
        """Leading blocks of the chain that ``peer`` is believed to hold right now."""
        entry = self._entries.get(block_hashes[0]) if block_hashes else None
        if entry is None:
            return 0
        expiry = entry.peers.get(peer)
        return 0 if expiry is None or expiry <= now else self._depth(peer, block_hashes, now)

    def match_all(self, block_hashes: Sequence[int], now: float) -> dict[str, int]:
        """``{peer: match_blocks(peer, ...)}`` for every peer believed to hold at least the first block.

        The peers' searches run together: the whole chain first (a prompt sent again, as it was: one probe), then the
        binary searches of the others, where the peers that answered every probe alike share the next one -- so a
        prompt just sent to several peers costs one search's probes, not one per peer. Prefix-closed (module
        docstring), every order of probes finds the depth ``_depth`` finds."""
        entries = self._entries
        entry = entries.get(block_hashes[0]) if block_hashes else None
        if entry is None:
            return {}
        holders = [p for p, expiry in entry.peers.items() if expiry > now]
        if len(holders) <= 1:
            return {p: self._depth(p, block_hashes, now) for p in holders}
        n = len(block_hashes)
        entry = entries.get(block_hashes[-1])
        held = entry.peers if entry is not None else {}
        found = {p: n for p in holders if (expiry := held.get(p)) is not None and expiry > now}
        if len(found) == len(holders):
            return found
        # (held at lo, not known beyond lo up to hi, the peers there)
        searches = [(1, n - 1, [p for p in holders if p not in found] if found else holders)]
        while searches:
            lo, hi, peers = searches.pop()
            if lo >= hi:
                for p in peers:
                    found[p] = lo
                continue
            mid = (lo + hi + 1) // 2
            entry = entries.get(block_hashes[mid - 1])
            held = entry.peers if entry is not None else {}
            deeper = [p for p in peers if (expiry := held.get(p)) is not None and expiry > now]
            if deeper:
                searches.append((mid, hi, deeper))
            if len(deeper) < len(peers):
                if deeper:
                    moved = set(deeper)
                    peers = [p for p in peers if p not in moved]
                searches.append((lo, mid - 1, peers))
        return {p: found[p] for p in holders}

    def _depth(self, peer: str, block_hashes: Sequence[int], now: float) -> int:
        """Deepest d with ``block_hashes[d - 1]`` held by ``peer``, given that the first block is (prefix-closed)."""
        entries = self._entries
        lo, hi = 1, len(block_hashes)  # invariant: held at depth lo; not known beyond lo up to hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            entry = entries.get(block_hashes[mid - 1])
            expiry = entry.peers.get(peer) if entry is not None else None
            if expiry is not None and expiry > now:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def forget_peer(self, peer: str) -> None:
        """Drop everything believed about a peer (it died or restarted)."""
        for h in [h for h, e in self._entries.items() if e.peers.pop(peer, None) is not None and not e.peers]:
            del self._entries[h]

    def expire(self, now: float, front_only: bool = False) -> int:
        """Drop expired entries; returns how many (the router calls it before each record with ``front_only``, the
        simulator each gossip round). The entries are in the order they were last recorded, which is their expiry
        order while every record's expiry is the latest so far (a clock that never goes back, one TTL): then the
        expired ones are a run at the front, found without reading the others -- O(expired), not O(``max_entries``),
        so a call with nothing expired reads one entry. Out of that order (a clock stepped back), a call reads every
        entry and finds whether what is left is in order again; ``front_only`` then drops nothing (a send must not
        pay a pass over the index: the size bound and the next whole call take what is left)."""
        entries = self._entries
        if not self._in_expiry_order:
            if front_only:
                return 0
            dead = []
            latest = float("-inf")
            ordered = True
            for h, entry in entries.items():
                if entry.expires_at <= now:
                    dead.append(h)
                elif entry.expires_at >= latest:
                    latest = entry.expires_at
                else:
                    ordered = False
            for h in dead:
                del entries[h]
            if ordered:
                self._in_expiry_order, self._latest = True, latest
            return len(dead)
        dead = []
        for h, entry in entries.items():
            if entry.expires_at > now:
                break
            dead.append(h)
        for h in dead:
            del entries[h]
        return len(dead)


try:
    from p2pnode.routing._speculative import SpeculativeIndex as _NativeSpeculativeIndex
except ImportError:  # the extension is optional (pyproject.toml)
    _NativeSpeculativeIndex = None

#: Whether ``SpeculativeIndex`` is the C index.
NATIVE_SPECULATIVE_INDEX = _NativeSpeculativeIndex is not None

if _NativeSpeculativeIndex is not None:

    class SpeculativeIndex(_NativeSpeculativeIndex):
        """Block hash -> peers believed to hold it (until their expiry): the C index, with the config's defaults."""

        __slots__ = ()

        def __new__(
            cls, ttl_s: float = DEFAULT_SPECULATIVE_TTL_S, max_entries: int = DEFAULT_SPECULATIVE_MAX_ENTRIES
        ) -> SpeculativeIndex:
            return super().__new__(cls, ttl_s, max_entries)

else:
    SpeculativeIndex = DictSpeculativeIndex  # type: ignore[misc,assignment]
