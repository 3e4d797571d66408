"""Exact local index of the token-block prefixes the engine holds in its prefix cache.

The index is fed by the engine's KV-cache events (``p2pnode.cache.events``) and answers "how many tokens of
this prompt would the engine reuse?". Blocks are keyed by p2pnode's chained block hash (``block_hash.py``):
because each hash names its whole prefix, the prefix tree is a flat dict ``hash -> node`` with parent links,
and matching a prompt walks its hashes until the first miss, without following links.

Invariants:
- A p2pnode hash is present iff at least one engine copy of that block is live as far as the events told us.
  vLLM does not de-duplicate blocks (two requests may compute the same block concurrently; block_pool.py
  ``BlockHashToBlockMap``), and each physical copy emits its own ``BlockStored`` and later its own
  ``BlockRemoved``; so copies are counted per engine hash and a block stays matched until its last copy goes.
  This needs vLLM's default ``kv_cache_report_mode="incremental"``: "full" re-announces reused blocks with
  ``BlockStored`` events that no ``BlockRemoved`` balances, so their copies would never reach zero.
- Every engine hash the index knows maps to a present node, and every present node is kept alive by >= 1 known
  engine hash. A prompt's blocks are hashed in its cache namespace (its LoRA adapter and cache salt:
  ``namespace.py``), as the engine does, so blocks of another adapter or salt never answer its lookups.
- Exactness holds for a complete event stream. A missed removal makes the index over-report that block
  until a reset (the subscriber turns detected gaps into ``CacheReset``) or the overflow bound drops it; a
  missed store (orphaned chain, other block size) or an overflow eviction makes it under-report. Engine
  input never raises.
- Removing a block does not remove its descendants (vLLM evicts them on its own schedule); matching stops at
  the missing block anyway.
- ``version`` increases by exactly one per change of the set of present hashes (insert, remove, overflow
  eviction) and per clear; the journal holds the last ``max_journal`` such changes, so a peer that saw version
  ``v`` can catch up with ``changes_since(v)`` or learns (None) that it needs a full snapshot.

Not thread-safe: meant to be driven from one event loop (events and lookups interleave, never overlap).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from p2pnode.cache.block_hash import NATIVE, block_hashes, count_leading, iter_block_hashes
from p2pnode.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, CacheReset
from p2pnode.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from p2pnode.config import DEFAULT_MAX_BLOCKS, DEFAULT_MAX_JOURNAL

__all__ = [
    "BYTES_PER_BLOCK",
    "BYTES_PER_JOURNAL_ENTRY",
    "DEFAULT_MAX_BLOCKS",
    "DEFAULT_MAX_JOURNAL",
    "IndexStats",
    "PrefixIndex",
    "journal_changes",
    "journal_entries",
]

# On overflow, the oldest ``max_blocks // 256`` blocks (at least one) are dropped at once: the index then
# holds at most ``max_blocks`` and, right after an overflow, ~0.4% less.
_EVICTION_BATCH_DIVISOR = 256

# Memory per indexed block (node dict entry + node tuple + p2pnode hash int + engine dict entry + engine
# hash int), measured with tracemalloc by ``scripts/bench_index.py`` (CPython 3.11.7, x86-64, journal off,
# blocks in 64-block chains): 241 bytes at 50k-200k blocks, 196 at 20k, 216 at 262k (dict fill levels).
BYTES_PER_BLOCK = 241
# Memory per journal entry: an 8-byte deque slot plus a 40-byte int (an insertion shares its int with the
# block while it is present; a removal's ``~h`` is new). Measured (48) by the same script; an upper bound.
BYTES_PER_JOURNAL_ENTRY = 48


# One present block, the prefix ``depth`` blocks long whose hash is its key: ``(parent, depth, engine)``.
# - parent: p2pnode hash of the previous block (None: first block of a prompt); may name an absent block.
# - depth: blocks in the prefix, this one included (the first block of a prompt has depth 1).
# - engine: the engine hash keeping the block alive, or a tuple (of >= 2) when distinct engine hashes
#   share it.
# A plain tuple rather than a slots dataclass: tuples of ints are untracked by the cyclic GC after their
# first collection, while slots instances stay tracked; at 262k blocks a full collection took 26 ms with
# dataclass nodes vs 1.4 ms with tuples (memory within 5%), a pause every process holding an index would pay.
_Node = tuple[int | None, int, int | tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class IndexStats:
    """A snapshot of the index's size and event counters (counters only grow, except ``blocks``)."""

    blocks: int
    """Present p2pnode hashes (``len(index)``)."""
    approx_bytes: int
    """Estimated memory: ``blocks * BYTES_PER_BLOCK + journal entries * BYTES_PER_JOURNAL_ENTRY``."""
    stored_blocks_total: int
    """Block copies accepted from ``BlockStored`` (duplicates of a present block included)."""
    removed_blocks_total: int
    """Block copies released by ``BlockRemoved``."""
    orphaned_blocks: int
    """Stored blocks dropped because their parent's engine hash was unknown (events missed or overflow)."""
    mismatched_blocks: int
    """Stored blocks dropped as unusable: other block size, malformed token ids, or a reused engine hash."""
    unknown_removals: int
    """Removals of engine hashes the index did not know (never stored, dropped, or removed twice)."""
    overflow_evictions: int
    """Blocks dropped, oldest-inserted first, to stay within ``max_blocks``."""
    resets: int
    """``AllBlocksCleared`` and ``CacheReset`` events applied."""
    version: int
    """The index's version when the snapshot was taken."""


class PrefixIndex:
    """Exact index of the engine's cached prefixes, keyed by p2pnode block hashes (see module docstring)."""

    def __init__(
        self,
        block_size: int,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        max_journal: int = DEFAULT_MAX_JOURNAL,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        if max_journal < 0:
            raise ValueError(f"max_journal must be >= 0, got {max_journal}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.max_journal = max_journal
        # p2pnode hash -> node; dict order is insertion order, which the overflow bound relies on.
        self._nodes: dict[int, _Node] = {}
        # engine hash -> p2pnode hash, one entry per engine hash with >= 1 live copy.
        self._engine: dict[int, int] = {}
        # engine hash -> live copies beyond the first; only duplicated blocks (rare) have an entry.
        self._extra_copies: dict[int, int] = {}
        # Changes, oldest first, the last one being ``_version``: ``h`` for an insertion, ``~h`` (< 0) for a
        # removal. One int per entry; the version of an entry follows from its position.
        self._journal: deque[int] = deque(maxlen=max_journal)
        self._version = 0
        self._stored = 0
        self._removed = 0
        self._orphaned = 0
        self._mismatched = 0
        self._unknown_removals = 0
        self._overflow_evictions = 0
        self._resets = 0

    # ----------------------------------------------------------------------------------------------- events

    def apply(self, event: CacheEvent) -> None:
        """Apply one engine event. Malformed or out-of-order input is counted in ``stats()``, never raised."""
        if isinstance(event, BlockStored):
            self._on_stored(event)
        elif isinstance(event, BlockRemoved):
            self._on_removed(event)
        elif isinstance(event, AllBlocksCleared | CacheReset):
            self._clear()
        else:
            raise TypeError(f"not a cache event: {event!r}")

    def _on_stored(self, event: BlockStored) -> None:
        engine_hashes = event.engine_block_hashes
        n = len(engine_hashes)
        bs = self.block_size
        if event.block_size != bs or len(event.token_ids) != n * bs:
            self._mismatched += n
            return
        start = self._chain_start(event.parent_engine_hash, n)
        if start is None:
            return
        parent, depth = start
        seed = event.namespace.root if parent is None else parent  # what the first block's hash chains from
        try:
            hashes = block_hashes(event.token_ids, bs, seed)
        except (ValueError, TypeError):
            self._mismatched += n
            return
        self._store_run(engine_hashes, hashes, parent, depth)

    def store_hashed(self, hashes: Sequence[int], parent: int | None) -> None:
        """Blocks stored by an engine that names them by their p2pnode hashes, after the block ``parent`` (None: a
        prompt's first): ``apply(BlockStored)`` with nothing to hash -- the same changes, counters and journal. The
        simulator's engine model (its chains are p2pnode's hashes of the blocks' tokens: ``sim/blocks.py``, tested
        against the tokens) stores through this, so a run does not make and hash every stored block's tokens again."""
        start = self._chain_start(parent, len(hashes))
        if start is None:
            return
        parent, depth = start
        nodes, engine, journal = self._nodes, self._engine, self._journal
        room = self.max_blocks - len(nodes)
        for i, h in enumerate(hashes):
            depth += 1
            if room <= 0 or h in engine or h in nodes:  # a copy, an overflow or another owner: the general path
                self._store_run(hashes[i:], hashes[i:], parent, depth - 1)
                return
            # ``_store_block`` of a new block, inlined: the simulator stores every block of every request this way
            self._stored += 1
            nodes[h] = (parent, depth, h)
            self._version += 1
            journal.append(h)
            engine[h] = h
            room -= 1
            parent = h

    def _chain_start(self, parent_engine_hash: int | None, n: int) -> tuple[int | None, int] | None:
        """Where a stored run of ``n`` blocks chains from: its parent's p2pnode hash and depth (None, 0 for a prompt's
        first block); None, the run counted as orphaned, where the parent's engine hash is unknown."""
        if parent_engine_hash is None:
            return None, 0
        parent = self._engine.get(parent_engine_hash)
        if parent is None:
            self._orphaned += n
            return None
        return parent, self._nodes[parent][1]

    def _store_run(self, engine_hashes: Sequence[int], hashes: Sequence[int], parent: int | None, depth: int) -> None:
        """The blocks of a run, each under its engine hash, chained from ``parent`` at ``depth``."""
        store = self._store_block
        for engine_hash, h in zip(engine_hashes, hashes, strict=True):
            depth += 1
            store(engine_hash, h, parent, depth)
            parent = h

    def _store_block(self, engine_hash: int, h: int, parent: int | None, depth: int) -> None:
        known = self._engine.get(engine_hash)
        if known is not None:
            if known == h:  # another physical copy of a present block
                self._extra_copies[engine_hash] = self._extra_copies.get(engine_hash, 0) + 1
                self._stored += 1
            else:  # one engine hash naming two prefixes: a collision or stale input; keep the first meaning
                self._mismatched += 1
            return
        self._stored += 1
        node = self._nodes.get(h)
        if node is None:
            if len(self._nodes) >= self.max_blocks:
                self._evict_oldest()
            self._nodes[h] = (parent, depth, engine_hash)
            self._record(h)
        else:  # the same tokens under another engine hash (LoRA, cache_salt, ...): one more owner
            old_parent, old_depth, engines = node
            engines = (*engines, engine_hash) if isinstance(engines, tuple) else (engines, engine_hash)
            self._nodes[h] = (old_parent, old_depth, engines)
        self._engine[engine_hash] = h

    def _on_removed(self, event: BlockRemoved) -> None:
        self.remove(event.engine_block_hashes)

    def remove(self, engine_hashes: Sequence[int]) -> None:
        """``apply(BlockRemoved(engine_hashes))``, for an engine model that owns its index (the simulator's caches:
        ``store_hashed``) and makes no event of its evictions."""
        extra_copies, nodes, engine, journal = self._extra_copies, self._nodes, self._engine, self._journal
        for engine_hash in engine_hashes:
            if extra_copies:
                extra = extra_copies.get(engine_hash)
                if extra is not None:
                    if extra == 1:
                        del extra_copies[engine_hash]
                    else:
                        extra_copies[engine_hash] = extra - 1
                    self._removed += 1
                    continue
            h = engine.pop(engine_hash, None)
            if h is None:
                self._unknown_removals += 1
                continue
            self._removed += 1
            parent, depth, engines = nodes[h]
            if isinstance(engines, tuple):
                rest = tuple(e for e in engines if e != engine_hash)
                nodes[h] = (parent, depth, rest[0] if len(rest) == 1 else rest)
            else:
                del nodes[h]
                self._version += 1  # ``_record(~h)``, inlined: every eviction of a simulated cache comes here
                journal.append(~h)

    def _evict_oldest(self) -> None:
        # A batch per overflow, not one block: finding a dict's first key scans the holes that deletions left
        # at its front: at 262k blocks, an overflowing insert cost 25 us per block one at a time, 2.6 us so.
        batch = max(1, self.max_blocks // _EVICTION_BATCH_DIVISOR)
        for h in list(itertools.islice(self._nodes, batch)):
            engines = self._nodes.pop(h)[2]
            for engine_hash in engines if isinstance(engines, tuple) else (engines,):
                del self._engine[engine_hash]
                self._extra_copies.pop(engine_hash, None)
            self._overflow_evictions += 1
            self._record(~h)

    def _clear(self) -> None:
        self._nodes.clear()
        self._engine.clear()
        self._extra_copies.clear()
        # A clear is not expressible as a bounded delta: empty the journal so older versions get None.
        self._journal.clear()
        self._version += 1
        self._resets += 1

    def _record(self, change: int) -> None:
        self._version += 1
        self._journal.append(change)

    # ---------------------------------------------------------------------------------------------- lookups

    def match_blocks(self, hashes: Sequence[int]) -> int:
        """Number of leading ``hashes`` present: the longest cached prefix, in blocks."""
        return count_leading(hashes, self._nodes)

    def match(self, token_ids: Sequence[int] | np.ndarray, namespace: CacheNamespace = DEFAULT_NAMESPACE) -> int:
        """Number of prompt tokens the engine would take from its prefix cache for ``token_ids`` (in ``namespace``:
        the request's adapter and cache salt).

        That is the matched full blocks times ``block_size``, capped at
        ``((len - 1) // block_size) * block_size``: vLLM must compute at least the last prompt token to get
        logits, so its lookup (``KVCacheManager.get_computed_blocks``:
        ``max_cache_hit_length = request.num_tokens - 1``) only takes whole blocks within the first
        ``len - 1`` tokens. So for a prompt the engine has served before (and not evicted since), ``match``
        equals the engine's reported ``num_cached_tokens``; a fully cached prompt whose length is a multiple
        of ``block_size`` recomputes its whole last block. (Not modelled: EAGLE/MTP speculative decoding,
        which drops one more block, and hybrid / sliding-window attention groups.)
        """
        max_blocks = (len(token_ids) - 1) // self.block_size if len(token_ids) else 0
        if max_blocks <= 0:
            return 0
        if NATIVE and type(token_ids) is list:  # every block hashed in C costs what the first one does lazily
            held = count_leading(block_hashes(token_ids, self.block_size, namespace.root), self._nodes)
            return min(held, max_blocks) * self.block_size
        hashes = iter_block_hashes(token_ids, self.block_size, namespace.root, max_blocks=max_blocks)
        return count_leading(hashes, self._nodes) * self.block_size

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, p2pnode_hash: object) -> bool:
        return p2pnode_hash in self._nodes

    def has_engine_block(self, engine_hash: int) -> bool:
        """Whether a block the engine names ``engine_hash`` is present: a stored block whose parent it is chains."""
        return engine_hash in self._engine

    # --------------------------------------------------------------------------------- gossip / observability

    @property
    def version(self) -> int:
        """Changes applied so far (see ``changes_since``); 0 for a new index."""
        return self._version

    def changes_since(self, version: int) -> list[tuple[int, bool, int]] | None:
        """Changes after ``version`` as ``(version, added, p2pnode hash)``, oldest first.

        None when the journal no longer reaches back to ``version`` (it was truncated, or a clear happened
        since) or ``version`` is ahead of this index (it restarted): the caller must resend a full snapshot
        (``iter_blocks`` read at ``self.version``).
        """
        return journal_changes(self._journal, self._version, version)

    def journal_since(self, version: int) -> list[int] | None:
        """``changes_since`` as journal entries: a hash added, ``~hash`` (< 0) removed (``journal_entries``)."""
        return journal_entries(self._journal, self._version, version)

    def iter_blocks(self) -> Iterator[tuple[int, int]]:
        """Yield ``(p2pnode hash, depth in blocks)`` for every present block, oldest-inserted first.

        A live view: consume it without applying events in between (e.g. without awaiting), and pair it with
        the ``version`` read just before, which is the version the snapshot reflects.
        """
        for h, node in self._nodes.items():
            yield h, node[1]

    def stats(self) -> IndexStats:
        """Counters and size estimate; cheap (no traversal)."""
        return IndexStats(
            blocks=len(self._nodes),
            approx_bytes=len(self._nodes) * BYTES_PER_BLOCK + len(self._journal) * BYTES_PER_JOURNAL_ENTRY,
            stored_blocks_total=self._stored,
            removed_blocks_total=self._removed,
            orphaned_blocks=self._orphaned,
            mismatched_blocks=self._mismatched,
            unknown_removals=self._unknown_removals,
            overflow_evictions=self._overflow_evictions,
            resets=self._resets,
            version=self._version,
        )


def journal_changes(journal: deque[int], current: int, version: int) -> list[tuple[int, bool, int]] | None:
    """The changes after ``version`` of a journal whose last entry is change ``current``, as ``(version, added,
    hash)``, oldest first; an entry is a hash added, or ``~hash`` removed. None when the journal does not reach back
    to ``version`` or ``version`` is ahead of ``current`` (``PrefixIndex.changes_since``)."""
    recent = journal_entries(journal, current, version)
    if recent is None:
        return None
    first = version + 1
    return [(first + i, change >= 0, change if change >= 0 else ~change) for i, change in enumerate(recent)]


def journal_entries(journal: deque[int], current: int, version: int) -> list[int] | None:
    """``journal_changes`` as the journal's own entries, oldest first: a hash added, ``~hash`` removed (no tuple
    made per change: the simulator's gossip model reads every node's journal every round)."""
    behind = current - version
    if behind == 0:
        return []
    if behind < 0 or behind > len(journal):
        return None
    # Walk from the newest end: O(changes), not O(journal) (a deque indexes its middle slowly).
    recent = list(itertools.islice(reversed(journal), behind))
    recent.reverse()
    return recent
