"""How a cache summary travels in gossip keys: an append log of key batches, withdrawals as bitmaps on them.

The summary is a set of 32-bit *summary keys*, each the low half of a published 64-bit block hash (``summary_key``;
``summary.py`` says which blocks). A set that changes by ~50 keys a second per node must cost its peers little more
than the keys themselves, and stay exact at every age. Here:

- **batches**: each round's new keys are one gossip key ``"gb/<seq>"`` (seq in lowercase hex, never reused in a
  life) whose value is the summary keys, 4 bytes each, big-endian, in the order written: ~4 B per added key;
- **withdrawals**: a key is withdrawn by its position in its batch: ``"gd/<seq>"`` holds the batch's bitmap of
  withdrawn positions (bit i of byte i // 8 for position i), rewritten when more of the batch goes: a few bytes a
  round for all the batch's withdrawals; a batch that is all withdrawn is deleted with its bitmap (two small
  tombstones) -- the usual end of a batch, since engines evict what they stored together;
- **compaction**: when fewer than 1 / ``COMPACT_LIVE_FRACTION`` of a batch's keys are live, the live ones are
  written again in the round's new batch and the old batch is deleted. So every batch a peer holds is at least
  that fraction live, and a peer that must fetch the whole summary (a reset: it is new, or fell behind the
  tombstones' grace) receives at most ``COMPACT_LIVE_FRACTION`` x 4 B per published key.

**Why 32 bits.** A summary key only steers routing: a peer reads a request's match on a node as the deepest sampled
depth whose key the node publishes. Under churn the keys are most of the bytes every node receives (1,000 members:
each node hears every member's ~30 new keys a second), and the full 64-bit hash bought nothing a 32-bit key does not:
a key of another prefix equal to a request's (probability |set| / 2**32 per node and depth, ~2e-6 at the 8,192-key
cap) could only raise an estimate, never change an output, and the match rule (``routing/tier_summaries.py``) takes a
depth only where the node also publishes the sampled depth before it, so such a collision can raise an estimate by
one stride past a real match (or claim the first stride), never more without a second independent collision.
The 64-bit log (``hb/``, ``hd/``: 8 B per hash) cost 95 KB/s per node under the gossip benchmark's churn at 200
members where this one costs 69 (``scripts/bench_gossip.py --sizes 200``). The prefixes changed with the width, so a
node of the earlier version and a node of this one ignore each other's summaries (they route to each other by load
only, never wrongly) until every node runs this one.

Order within a round: new batches, then bitmaps, then deletions, so a key moved by compaction is never absent on a
peer that applied only part of the round (a withdrawal may show a moment late; a late key costs a cache miss,
never a wrong answer). Readers are exact for an owner's entries in version order, as gossip delivers them (a batch
written again, a bitmap before its batch included); entries in another order never raise, but an older batch applied
after a newer one holding the same key can drop that key until it is published again. They check everything: a
malformed value is ignored, never raised.

Invariant (the unit tests check it on random changes): a ``SummaryReader`` fed the writer's entries holds exactly
the writer's live set, after every ``update``.

A node publishes one summary per medium it caches in (the engine's KV, a host tier: ``summary.py``), each a log of
its own keys (``SummaryKeys``); the engine's keeps the prefixes above.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "BATCH_PREFIX",
    "COMPACT_LIVE_FRACTION",
    "DEAD_PREFIX",
    "GPU_KEYS",
    "MAX_BATCH_HASHES",
    "SummaryKeys",
    "SummaryReader",
    "SummaryWriter",
    "batch_key",
    "dead_key",
    "parse_seq",
    "summary_key",
]

#: Key of a batch of published summary keys: ``BATCH_PREFIX + hex(seq)``.
BATCH_PREFIX = "gb/"
#: Key of a batch's bitmap of withdrawn positions: ``DEAD_PREFIX + hex(seq)``.
DEAD_PREFIX = "gd/"
#: Most keys in one batch (256 B of value: inside the smallest message budget allowed, 1 KiB): a round with more
#: writes several batches.
MAX_BATCH_HASHES = 64
#: A batch with fewer than 1/this of its keys live is compacted: its live keys move to a new batch.
COMPACT_LIVE_FRACTION = 3
#: Bits of a summary key: the low half of a 64-bit block hash (module docstring, "Why 32 bits").
SUMMARY_KEY_BITS = 32
SUMMARY_KEY_MASK = (1 << SUMMARY_KEY_BITS) - 1
_HASH_BYTES = SUMMARY_KEY_BITS // 8
#: Longest hex sequence number accepted (64-bit).
_MAX_SEQ_CHARS = 16


@dataclass(frozen=True, slots=True)
class SummaryKeys:
    """The key prefixes of one summary log: its batches and their withdrawal bitmaps (each unique among every key a
    node gossips)."""

    batch: str
    dead: str

    def batch_key(self, seq: int) -> str:
        return f"{self.batch}{seq:x}"

    def dead_key(self, seq: int) -> str:
        return f"{self.dead}{seq:x}"

    def owns(self, key: str) -> bool:
        return key.startswith((self.batch, self.dead))


#: The engine's own summary (the GPU's KV).
GPU_KEYS = SummaryKeys(BATCH_PREFIX, DEAD_PREFIX)


def batch_key(seq: int) -> str:
    return GPU_KEYS.batch_key(seq)


def dead_key(seq: int) -> str:
    return GPU_KEYS.dead_key(seq)


def parse_seq(key: str, prefix: str) -> int | None:
    """The sequence number of a batch or bitmap key, or None when ``key`` is not one (only the canonical spelling)."""
    body = key[len(prefix) :]
    if not key.startswith(prefix) or not 0 < len(body) <= _MAX_SEQ_CHARS:
        return None
    try:
        seq = int(body, 16)
    except ValueError:
        return None
    return seq if f"{seq:x}" == body else None


def summary_key(block_hash: int) -> int:
    """The 32-bit key under which a summary publishes ``block_hash`` (its low half): what a peer looks a request's
    hashes up by."""
    return block_hash & SUMMARY_KEY_MASK


def encode_batch(hashes: list[int]) -> bytes:
    return b"".join(h.to_bytes(_HASH_BYTES, "big") for h in hashes)


def decode_batch(value: bytes) -> list[int] | None:
    n, rest = divmod(len(value), _HASH_BYTES)
    if rest or not 0 < n <= MAX_BATCH_HASHES:
        return None
    return [int.from_bytes(value[i : i + _HASH_BYTES], "big") for i in range(0, len(value), _HASH_BYTES)]


def encode_dead(mask: int, size: int) -> bytes:
    return mask.to_bytes((size + 7) // 8, "little")


def decode_dead(value: bytes) -> int | None:
    if not 0 < len(value) <= (MAX_BATCH_HASHES + 7) // 8:
        return None
    return int.from_bytes(value, "little")


@dataclass(slots=True)
class _Batch:
    hashes: list[int]
    dead: int = 0  # bit i: position i withdrawn
    live: int = 0
    dead_published: bool = False


Entry = tuple[str, "bytes | None"]


class SummaryWriter:
    """The owner's side: turns each round's (added, removed) hashes into the key writes of the log.

    Invariant: every published hash is in exactly one batch, at one position, live there.
    """

    def __init__(self, keys: SummaryKeys = GPU_KEYS) -> None:
        self.keys = keys
        self._batches: dict[int, _Batch] = {}
        self._where: dict[int, tuple[int, int]] = {}  # hash -> (seq, position)
        self._next_seq = 0

    def __len__(self) -> int:
        """Published (live) hashes."""
        return len(self._where)

    @property
    def batches(self) -> int:
        return len(self._batches)

    def update(self, added: Iterable[int], removed: Iterable[int]) -> list[Entry]:
        """The entries to publish (value None: delete the key) so that readers hold the set changed by ``added`` and
        ``removed`` (hashes already published are not added twice; unknown ones are not removed)."""
        added = list(added)
        if any(h >> SUMMARY_KEY_BITS or h < 0 for h in added):
            raise ValueError("a summary log publishes 32-bit summary keys (summary_key(block_hash)), not block hashes")
        touched: set[int] = set()
        for h in removed:
            where = self._where.pop(h, None)
            if where is None:
                continue
            seq, pos = where
            batch = self._batches[seq]
            batch.dead |= 1 << pos
            batch.live -= 1
            touched.add(seq)
        fresh = [h for h in dict.fromkeys(added) if h not in self._where]
        bitmaps: list[Entry] = []
        deletions: list[Entry] = []
        for seq in sorted(touched):
            batch = self._batches[seq]
            if batch.live * COMPACT_LIVE_FRACTION < len(batch.hashes):
                moved = [h for i, h in enumerate(batch.hashes) if not batch.dead >> i & 1]
                for h in moved:
                    del self._where[h]
                fresh.extend(moved)
                del self._batches[seq]
                deletions.append((self.keys.batch_key(seq), None))
                if batch.dead_published:
                    deletions.append((self.keys.dead_key(seq), None))
            else:
                batch.dead_published = True
                bitmaps.append((self.keys.dead_key(seq), encode_dead(batch.dead, len(batch.hashes))))
        writes: list[Entry] = []
        for start in range(0, len(fresh), MAX_BATCH_HASHES):
            chunk = fresh[start : start + MAX_BATCH_HASHES]
            seq = self._next_seq
            self._next_seq += 1
            self._batches[seq] = _Batch(chunk, live=len(chunk))
            for pos, h in enumerate(chunk):
                self._where[h] = (seq, pos)
            writes.append((self.keys.batch_key(seq), encode_batch(chunk)))
        return writes + bitmaps + deletions


#: Most live keys a reader holds of one peer's summary (8x the writers' default bound).
MAX_READER_KEYS = 65_536
#: Most keys a reader holds in one peer's batches, live or not: a writer compacts a batch once under 1/3 of it is
#: live, so an honest log holds under ``COMPACT_LIVE_FRACTION`` x its live keys (plus a batch being filled).
MAX_READER_POSITIONS = COMPACT_LIVE_FRACTION * MAX_READER_KEYS


class SummaryReader:
    """A peer's side: holds the owner's published set from the log's entries (in version order: module docstring).

    ``hashes`` maps each live hash to the batch that holds it (a hash moved by compaction lives in its newest batch).
    Bounded: a batch that would take the set past ``MAX_READER_KEYS``, or the batches' keys live or not past
    ``MAX_READER_POSITIONS``, is ignored (an honest summary holds at most its writer's ``max_hashes``, 8,192 by
    default; without the first a peer's 16 MiB of batches made ~4M keys, ~550 MB here, and without the second the same
    64 keys repeated in every batch held ~4M positions, ~160 MB).
    """

    __slots__ = ("_batches", "_dead", "_positions", "hashes", "keys")

    def __init__(self, keys: SummaryKeys = GPU_KEYS) -> None:
        self.keys = keys
        self.hashes: dict[int, int] = {}
        self._batches: dict[int, list[int]] = {}
        self._dead: dict[int, int] = {}
        self._positions = 0  # the keys of every batch held

    def apply(self, key: str, value: bytes | None) -> tuple[list[int], list[int]] | None:
        """Apply one entry; the hashes that became live and those that stopped being live, or None when ``key`` is
        not a summary-log key (malformed values change nothing and give ``([], [])``)."""
        keys = self.keys
        if key.startswith(keys.batch):
            seq = parse_seq(key, keys.batch)
            if seq is None:
                return None
            return self._batch(seq, value)
        if key.startswith(keys.dead):
            seq = parse_seq(key, keys.dead)
            if seq is None:
                return None
            return self._bitmap(seq, value)
        return None

    def _batch(self, seq: int, value: bytes | None) -> tuple[list[int], list[int]]:
        removed = self._drop(seq, ~0)
        old = self._batches.pop(seq, None)
        if old is not None:
            self._positions -= len(old)
        if value is None:
            self._dead.pop(seq, None)
            return [], removed
        hashes = decode_batch(value)
        if (
            hashes is None
            or len(self.hashes) + len(hashes) > MAX_READER_KEYS
            or self._positions + len(hashes) > MAX_READER_POSITIONS
        ):
            return [], removed
        self._batches[seq] = hashes
        self._positions += len(hashes)
        dead = self._dead.get(seq, 0)
        added = []
        for pos, h in enumerate(hashes):
            if not dead >> pos & 1:
                if h not in self.hashes:
                    added.append(h)
                self.hashes[h] = seq
        return added, [h for h in removed if h not in self.hashes]

    def _bitmap(self, seq: int, value: bytes | None) -> tuple[list[int], list[int]]:
        if value is None:
            self._dead.pop(seq, None)
            return [], []
        mask = decode_dead(value)
        if mask is None:
            return [], []
        newly = mask & ~self._dead.get(seq, 0)
        self._dead[seq] = mask
        return [], self._drop(seq, newly)

    def _drop(self, seq: int, mask: int) -> list[int]:
        """Withdraw the positions of ``mask`` of batch ``seq`` (only hashes whose live copy is that batch's)."""
        batch = self._batches.get(seq)
        if batch is None or not mask:
            return []
        removed = []
        for pos, h in enumerate(batch):
            if mask >> pos & 1 and self.hashes.get(h) == seq:
                del self.hashes[h]
                removed.append(h)
        return removed
