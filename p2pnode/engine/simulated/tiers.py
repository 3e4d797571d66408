"""KV tiers below a simulated engine's paged cache: host memory, and a disk below it, run as vLLM's offloading does.

Model (vLLM 0.32's ``OffloadingConnector`` with its CPU manager, ``v1/kv_offload/cpu/manager.py``, and its tiering
manager for a disk, ``v1/kv_offload/tiering/manager.py``), at block granularity:

- **stores**: the blocks a request computed are offered to the host tier -- its prompt's when its prefill ends, its
  output's too when it finishes unless ``prompt_only`` (vLLM's ``offload_prompt_only``). vLLM offers every block from
  the start of the prompt, the engine's own prefix hit included, unless the request loaded blocks from a tier (then
  only the blocks after what it loaded: its ``CHUNK_LEVEL`` policy); a request that pulled its prefix from a peer
  loaded nothing from the tier (the pull connector serves it), so it offers from the start. An offered block already
  in the tier is a reuse; a new one is stored once it has been offered ``store_threshold`` times (vLLM's
  ``store_threshold``: 1 stores every block, 2 only blocks seen twice), evicting the tier's blocks in its eviction
  policy's order (``lru`` or ``arc``, the project's own policies in ``cache/eviction/`` run over the tier) -- never
  a block of the same offer. Stores are asynchronous in vLLM (their own CUDA stream, the request never waits): the
  model stores at once and charges no time, only counts the bytes;
- **disk**: every block stored to the host tier is written to the disk tier as well (vLLM's tiering manager cascades
  each store to every secondary tier), which evicts in its own order; a block the host tier evicted is still read
  from disk while the disk holds it. A block read from disk is promoted to the host tier first (staged), then loaded;
- **loads**: at admission, after the engine's own prefix hit, the blocks that follow it in the tiers are loaded
  (vLLM's lookup: the longest run of consecutive tier hits past the engine's hit, host first, a secondary tier for a
  block the host tier lacks); the engine never computes what a tier holds. The load's time is the caller's
  (``cost/tiers.py``, queued on the node's host link: ``batching.py``);
- **recency**: a block's recency is set when it is stored and renewed when a request loads it and when a request that
  offered or loaded it finishes, its chain tail first so that a chain's head is the most recent (vLLM's LRU renews
  every block a request touched, in that order, when it finishes); ``arc`` also counts a load or an offer of a held
  block as a second use.

Each tier keeps a journal of its changes (``changes_since``, the shape of ``PrefixIndex.changes_since``), which the
gossip model publishes as that tier's summary (``sim/staleness.py``).

Not modelled: blocks in flight (a block is readable the moment its store is issued; vLLM reads it once the copy
completes, milliseconds later) and salted blocks (a request under the approximate-segment salt offers nothing: its
blocks are never published either).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from p2pnode.cache.eviction import get_eviction
from p2pnode.cache.prefix_index import journal_changes
from p2pnode.cache.tiers import Medium

__all__ = ["TIER_EVICTIONS", "KvTier", "NodeTiers", "TierConfig"]

#: The eviction policies a tier runs (vLLM's CPU manager offers these two).
TIER_EVICTIONS = ("lru", "arc")
#: Least journal length of a tier (changes a gossip round can publish as a delta).
TIER_JOURNAL_MIN = 4096
#: Blocks whose offers are counted towards the store threshold at most (vLLM's ``max_tracker_size``): the least
#: recently offered is forgotten first.
STORE_TRACKER_SIZE = 64_000


@dataclass(frozen=True, slots=True)
class TierConfig:
    """The tiers of every simulated node: sizes in blocks (0: none) and the offloading knobs (module docstring)."""

    host_blocks: int = 0
    disk_blocks: int = 0
    store_threshold: int = 1
    prompt_only: bool = False
    eviction: str = "lru"

    def __post_init__(self) -> None:
        if self.host_blocks < 0 or self.disk_blocks < 0:
            raise ValueError(f"tier sizes must be >= 0 blocks, got host {self.host_blocks}, disk {self.disk_blocks}")
        if self.disk_blocks and not self.host_blocks:
            raise ValueError("a disk tier needs a host tier above it (its blocks are loaded through host memory)")
        if self.store_threshold < 1:
            raise ValueError(f"store_threshold must be >= 1, got {self.store_threshold}")
        if self.eviction not in TIER_EVICTIONS:
            raise ValueError(f"tier eviction must be one of {', '.join(TIER_EVICTIONS)}, got {self.eviction!r}")

    @property
    def enabled(self) -> bool:
        return self.host_blocks > 0


class KvTier:
    """One tier's blocks, its eviction order and its journal."""

    __slots__ = ("_journal", "blocks", "capacity", "evictions", "medium", "policy", "version")

    def __init__(self, medium: Medium, capacity: int, eviction: str) -> None:
        if capacity < 1:
            raise ValueError(f"a tier holds >= 1 block, got {capacity}")
        self.medium = medium
        self.capacity = capacity
        #: Held block hash -> 0 (no block is ever pinned: the policies read this as the pin counts).
        self.blocks: dict[int, int] = {}
        self.policy = get_eviction(eviction)(capacity, self.blocks)
        self.evictions = 0
        self.version = 0
        self._journal: deque[int] = deque(maxlen=max(TIER_JOURNAL_MIN, 2 * capacity))

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def insert(self, hs: Sequence[int]) -> list[int]:
        """Store the blocks ``hs`` (none held yet, chain order), evicting the least valuable; returns what it evicted.
        At most ``capacity`` of them (the chain's first) fit."""
        hs = hs[: self.capacity]
        blocks, policy = self.blocks, self.policy
        over = len(blocks) + len(hs) - self.capacity
        gone = [policy.victim() for _ in range(over)] if over > 0 else []
        for h in gone:
            del blocks[h]
            self._record(~h)
        self.evictions += len(gone)
        for h in hs:
            blocks[h] = 0
            self._record(h)
        policy.inserted(hs)
        policy.unpinned(hs)
        return gone

    def touch(self, hs: Sequence[int], reused: bool = False) -> None:
        """Renew the recency of the held blocks among ``hs`` (chain order: the head ends most recent); ``reused``:
        a request found them here (a second use, for ``arc``)."""
        blocks = self.blocks
        held = [h for h in hs if h in blocks]
        if not held:
            return
        policy = self.policy
        if reused:
            policy.accessed(held)
        policy.pinned(held)
        held.reverse()
        policy.unpinned(held)

    def _record(self, change: int) -> None:
        self.version += 1
        self._journal.append(change)

    def changes_since(self, version: int) -> list[tuple[int, bool, int]] | None:
        """Changes after ``version`` as ``(version, added, hash)``, oldest first; None when the journal does not reach
        back that far (``PrefixIndex.changes_since``)."""
        return journal_changes(self._journal, self.version, version)

    def iter_blocks(self) -> Iterator[tuple[int, int]]:
        """Every held block as ``(hash, 0)`` (the shape of ``PrefixIndex.iter_blocks``; depth is not kept)."""
        for h in self.blocks:
            yield h, 0


class NodeTiers:
    """A node's host tier and optional disk tier, with the store counters and the bytes moved."""

    __slots__ = (
        "bytes_per_block",
        "config",
        "counts",
        "disk",
        "disk_load_blocks",
        "disk_store_blocks",
        "host",
        "host_load_blocks",
        "host_store_blocks",
        "stores_skipped",
    )

    def __init__(self, config: TierConfig, bytes_per_block: int) -> None:
        if not config.enabled:
            raise ValueError("NodeTiers needs a host tier")
        self.config = config
        self.bytes_per_block = bytes_per_block
        self.host = KvTier(Medium.HOST, config.host_blocks, config.eviction)
        self.disk = KvTier(Medium.DISK, config.disk_blocks, config.eviction) if config.disk_blocks else None
        #: Offers of each block not yet stored, when stores need more than one (vLLM's ``counts`` tracker).
        self.counts: OrderedDict[int, int] | None = OrderedDict() if config.store_threshold > 1 else None
        # blocks moved (x bytes_per_block for bytes)
        self.host_store_blocks = 0
        self.disk_store_blocks = 0
        self.host_load_blocks = 0  # every loaded block crosses the host link, disk ones after their promotion
        self.disk_load_blocks = 0
        self.stores_skipped = 0  # offers of new blocks refused by the store threshold

    def tiers(self) -> tuple[KvTier, ...]:
        return (self.host,) if self.disk is None else (self.host, self.disk)

    # --- reading ---------------------------------------------------------------------------------------------------

    def depths(self, chain: Sequence[int], gpu: int, limit: int) -> tuple[int, int]:
        """(host, disk): the cumulative depths of ``chain[:limit]`` past the engine's hit of ``gpu`` blocks -- the
        consecutive blocks the host tier holds, then those the host or the disk tier holds (vLLM's lookup)."""
        held = self.host.blocks
        h = gpu
        while h < limit and chain[h] in held:
            h += 1
        disk = self.disk
        if disk is None:
            return h, h
        on_disk = disk.blocks
        d = h
        while d < limit and (chain[d] in held or chain[d] in on_disk):
            d += 1
        return h, d

    def load(self, chain: Sequence[int], gpu: int, host: int, disk: int) -> int:
        """A request loads ``chain[gpu:disk]`` (``depths``'s answer): blocks only on disk are promoted to the host
        tier first; returns how many came from disk. Renews the loaded blocks' recency (they are in use)."""
        held = self.host.blocks
        from_disk = [h for h in chain[host:disk] if h not in held]
        if from_disk:
            assert self.disk is not None
            self.disk.touch(from_disk, reused=True)
            self.host.touch(chain[gpu:disk], reused=True)  # not evicted by their own promotion
            self.host.insert(from_disk)
            self.disk_load_blocks += len(from_disk)
        else:
            self.host.touch(chain[gpu:disk], reused=True)
        self.host_load_blocks += disk - gpu
        return len(from_disk)

    # --- writing ---------------------------------------------------------------------------------------------------

    def offer(self, chain: Sequence[int], lo: int, hi: int) -> None:
        """A request computed (or reused) ``chain[lo:hi]``: store what is new and admitted (module docstring)."""
        if hi <= lo:
            return
        offered = chain[lo:hi]
        host = self.host
        held = host.blocks
        new = [h for h in offered if h not in held]
        if len(new) < len(offered):
            host.touch(offered, reused=True)  # before evicting: the offer's held blocks are protected
        counts = self.counts
        if counts is not None and new:
            threshold = self.config.store_threshold
            admitted = []
            for h in new:
                c = counts.pop(h, 0) + 1
                if c >= threshold:
                    admitted.append(h)
                    continue
                counts[h] = c
                if len(counts) > STORE_TRACKER_SIZE:
                    counts.popitem(last=False)
            self.stores_skipped += len(new) - len(admitted)
            new = admitted
        if not new:
            return
        host.insert(new)
        self.host_store_blocks += min(len(new), host.capacity)
        disk = self.disk
        if disk is not None:
            written = [h for h in new if h not in disk.blocks]
            if written:
                disk.insert(written)
                self.disk_store_blocks += min(len(written), disk.capacity)

    def finish(self, chain: Sequence[int], n: int) -> None:
        """A request that used ``chain[:n]`` finished: the host tier renews what it holds of it (module docstring)."""
        self.host.touch(chain[:n])

    # --- accounting ------------------------------------------------------------------------------------------------

    def bytes_moved(self) -> dict[str, int]:
        """Bytes stored to and loaded from each tier so far."""
        b = self.bytes_per_block
        return {
            "host_store": self.host_store_blocks * b,
            "host_load": self.host_load_blocks * b,
            "disk_store": self.disk_store_blocks * b,
            "disk_load": self.disk_load_blocks * b,
        }
