"""A node's paged KV cache with prefix caching, at block granularity, mirrored into the node's real PrefixIndex.

Model (vLLM v1's block pool, reduced to counts): ``num_blocks`` physical blocks, each either
- free (no content),
- cached: holds a full block named by its p2pnode hash, with a pin count (running requests using it); unpinned
  cached blocks are evictable, in the order the eviction policy chooses,
- anonymous: held by a running request but carrying no reusable content (the partial last block, decode space,
  blocks not yet computed).
A request is admitted with its whole lifetime's blocks reserved (prompt + output, so no preemption is modelled):
its longest cached prefix (never its last prompt token: vLLM's ``num_tokens - 1`` cap) is pinned, the rest is
allocated from free blocks, evicting unpinned cached ones as needed; blocks pulled from a peer for it
(``SimRequest.pull_lo/pull_hi``, the simulator's ``sim/pulls.py``) that continue that prefix are loaded into its
blocks at once, cached from then on, and count as cached for it. When its prefill completes, its prompt's full
blocks become cached (``store``); when it finishes, the full blocks of prompt + output do, and everything is
unpinned tail-first (``release``).

Invariants (checked by the tests):
- ``free + len(refs) + sum(anonymous blocks of running requests) == num_blocks``;
- the set of cached hashes equals the PrefixIndex's set (every change is sent as a ``BlockStored`` /
  ``BlockRemoved`` event, with the blocks' tokens from ``token_source``; a cache that owns its index, as the
  simulator's do, stores by hash and removes without an event instead: ``PrefixIndex.store_hashed``, ``remove``),
  so routing on the index sees exactly what the cache holds;
- a stored run's parent is cached at that moment (it is pinned by the storing request), so the index never
  orphans a block.
With ``adaptive`` eviction, each admitted request is also offered to the policy's selector (``observe``), which
replays it through its shadow caches and may switch the policy that picks victims (``cache/eviction/adaptive.py``).
A block two requests computed concurrently is kept once: the second request pins the existing copy and frees its
own (vLLM keeps both copies until eviction; the difference is one block for the length of a request).
With KV tiers below it (``tiers``: a host tier and maybe a disk tier, ``tiers.py``), a request that pulls nothing
loads at admission the blocks that follow its cached prefix in the tiers, into its reserved blocks like pulled ones
(cached from then on, counted as cached for it: ``tier_host_tokens`` / ``tier_disk_tokens``; the engine delays its
prefill by the load, ``batching.py``); its computed blocks are offered to the host tier when its prefill ends (the
prompt's) and when it finishes (the output's, unless the tiers store prompts only).
Blocks of a request under the approximate-segment cache salt (``SegmentedPrompt.salted``: their hashes are of
another namespace, ``engine/simulated/segments.py``) are cached like any but never reported to the index, as a node's
salted blocks never reach it (``engine/kv_events.py``); the invariant above holds for the others (``hidden``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from p2pnode.block_loops import cached_prefix, pin, store_scan, unpin
from p2pnode.cache.block_hash import count_leading
from p2pnode.cache.events import BlockRemoved, BlockStored, CacheEvent
from p2pnode.cache.eviction import PolicyFactory, get_eviction
from p2pnode.cache.namespace import DEFAULT_NAMESPACE
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.engine.simulated.tiers import NodeTiers

__all__ = ["JOURNAL_MIN", "PagedPrefixCache", "TokenSource"]

#: ``source(r, lo, hi)``: the token ids of blocks ``lo..hi-1`` of ``r``'s chain, flat (what ``BlockStored`` carries;
#: the PrefixIndex re-hashes them, so they must hash to ``r.chain[lo:hi]``).
TokenSource = Callable[[SimRequest, int, int], Sequence[int]]

#: Least index journal length (changes a gossip round can publish as a delta).
JOURNAL_MIN = 4096


class PagedPrefixCache:
    """Cached blocks with pin counts, an eviction policy, and the node's PrefixIndex kept in step."""

    __slots__ = (
        "block_size",
        "emit",
        "evictions",
        "free",
        "hidden",
        "index",
        "n_pinned",
        "num_blocks",
        "observe",
        "owns_index",
        "policy",
        "refs",
        "tiers",
        "token_source",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        eviction: str | PolicyFactory,
        token_source: TokenSource,
        index: PrefixIndex | None = None,
        emit: Callable[[CacheEvent], None] | None = None,
        tiers: NodeTiers | None = None,
    ) -> None:
        """Events go to ``emit`` when given (a node's engine: its KV-event sink), else into ``index`` (the
        simulator reads it; one is built when None). ``eviction``: a policy name or factory. ``tiers``: the KV tiers
        below this cache (None: none)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.token_source = token_source
        self.block_size = block_size
        self.refs: dict[int, int] = {}  # cached block hash -> pin count
        self.n_pinned = 0  # cached blocks with a pin count > 0
        self.free = num_blocks
        factory = get_eviction(eviction) if isinstance(eviction, str) else eviction
        self.policy = factory(num_blocks, self.refs)
        #: Called with each admitted request's blocks, lookup limit and prompt length in blocks: ``adaptive``'s
        #: selector (the node feeds its own selector the same way from its served requests).
        self.observe: Callable[[Sequence[int], int, float], None] | None = getattr(self.policy, "observe", None)
        # The gossip model publishes the index's journal (``changes_since``) every round; it must hold a round's
        # churn (typically tens to hundreds of blocks per node), or the round falls back to a full snapshot.
        if index is None and emit is None:
            index = PrefixIndex(
                block_size, max_blocks=2 * num_blocks + 1024, max_journal=max(JOURNAL_MIN, 2 * num_blocks)
            )
        self.index = index
        self.emit: Callable[[CacheEvent], None] = emit if emit is not None else index.apply  # type: ignore[union-attr]
        #: Whether stores and evictions go straight into ``index`` (``PrefixIndex.store_hashed``, ``remove``): when no
        #: ``emit`` was given, as the simulator builds it (a node's engine sends events, with the blocks' tokens).
        self.owns_index = emit is None
        self.evictions = 0
        #: Cached hashes of salted blocks: cached, never reported (module docstring).
        self.hidden: set[int] = set()
        #: The host (and disk) tier below this cache, None without.
        self.tiers = tiers

    # ----------------------------------------------------------------------------------------------- queries

    def match_blocks(self, chain: list[int], limit: int) -> int:
        """Leading blocks of ``chain[:limit]`` that are cached."""
        return count_leading(chain[:limit], self.refs) if limit > 0 else 0

    def tier_match(self, r: SimRequest, gpu: int, limit: int) -> int:
        """Blocks of ``r``'s chain (at most ``limit``) it would reuse here with the tiers' continuation of its ``gpu``
        cached blocks: what admission would load (``gpu`` itself without tiers, or for a salted request)."""
        tiers = self.tiers
        if tiers is None or (r.segments is not None and r.segments.salted):
            return gpu
        return tiers.depths(r.chain, gpu, limit)[1]

    @property
    def evictable(self) -> int:
        return len(self.refs) - self.n_pinned

    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests (pinned cached + anonymous): vLLM's KV usage numerator."""
        return self.num_blocks - self.free - self.evictable

    # ----------------------------------------------------------------------------------------------- request life

    def _prefix(self, r: SimRequest) -> tuple[int, list[int], int, int]:
        """``r``'s cached prefix in blocks, the evictable ones among them, the blocks it needs besides, and the most
        it may reuse (``cap``: never its last prompt token; within its chain: a preempted trace request's prompt grew
        past it)."""
        bs = self.block_size
        cap = min((r.prompt_tokens - 1) // bs, len(r.chain))
        m, fresh = cached_prefix(self.refs, r.chain, cap)  # fresh: those that were evictable
        return m, fresh, -(-(r.prompt_tokens + r.output_tokens) // bs) - m, cap

    def fits(self, r: SimRequest) -> bool:
        """Whether ``admit(r)`` would succeed now (nothing changed)."""
        _, fresh, need, _ = self._prefix(r)
        return need <= self.free + len(self.refs) - self.n_pinned - len(fresh)

    def admit(self, r: SimRequest) -> bool:
        """Pin ``r``'s cached prefix and reserve the rest of its blocks; False (nothing changed) if they don't fit."""
        bs = self.block_size
        refs = self.refs
        chain = r.chain
        m, fresh, need, cap = self._prefix(r)
        if need > self.free + len(refs) - self.n_pinned - len(fresh):
            return False
        hi = r.pull_hi  # blocks pulled from a peer (sim/pulls.py) continue the cached prefix: loaded, not computed
        pulled = hi - m if hi > m and r.pull_lo <= m else 0
        if m:
            matched = chain[:m]
            pin(refs, matched)
            self.n_pinned += len(fresh)
            policy = self.policy
            policy.accessed(matched)
            if fresh:
                policy.pinned(fresh)
        if need > self.free:
            self._evict(need - self.free)
        self.free -= need
        r.anon_blocks = need
        if pulled:  # loaded into blocks reserved for it, and cached from now on like computed ones
            self.store(r, m, hi)
            m = hi
            r.pulled_tokens = pulled * bs
        elif self.tiers is not None and (r.segments is None or not r.segments.salted):
            m = self._load_from_tiers(r, m, cap)
        r.cached_tokens = m * bs
        if self.observe is not None:
            self.observe(chain[: r.n_blocks], cap, r.prompt_tokens / bs)
        return True

    def _load_from_tiers(self, r: SimRequest, m: int, cap: int) -> int:
        """The tiers' continuation of ``r``'s ``m`` cached blocks, loaded into its reserved blocks (cached from now on
        like computed ones); returns its cached prefix then."""
        tiers = self.tiers
        assert tiers is not None
        host, disk = tiers.depths(r.chain, m, cap)
        if disk <= m:
            return m
        from_disk = tiers.load(r.chain, m, host, disk)
        self.store(r, m, disk)
        bs = self.block_size
        r.tier_disk_tokens = from_disk * bs
        r.tier_host_tokens = (disk - m - from_disk) * bs
        r.tier_offer_from = disk
        return disk

    def _evict(self, n: int) -> None:
        refs = self.refs
        victim = self.policy.victim
        gone = [victim() for _ in range(n)]
        for h in gone:
            del refs[h]
        self.free += n
        self.evictions += n
        hidden = self.hidden
        if hidden:
            shown = [h for h in gone if h not in hidden]
            hidden.difference_update(gone)
            if not shown:
                return
            gone = shown
        if self.owns_index:
            self.index.remove(gone)  # type: ignore[union-attr]
        else:
            self.emit(BlockRemoved(tuple(gone)))

    def store(self, r: SimRequest, lo: int, hi: int) -> None:
        """Blocks ``lo..hi-1`` of ``r``'s chain were computed: cache them (pinned by ``r``)."""
        # A block cached already was computed concurrently by another request: pin that copy, free ours (dups).
        new, dups, fresh, runs = store_scan(self.refs, r.chain, lo, hi)
        seg = r.segments
        shown = seg is None or not seg.salted
        if shown:
            for i in range(0, len(runs), 2):  # each run of new blocks, stored in chain order
                self._emit(r, runs[i], runs[i + 1])
        elif new:
            self.hidden.update(new)
        policy = self.policy
        if new:
            self.n_pinned += len(new)
            policy.inserted(new)
        if dups:
            self.free += len(dups)
            self.n_pinned += len(fresh)
            policy.accessed(dups)
            if fresh:
                policy.pinned(fresh)
        r.anon_blocks -= hi - lo

    def _emit(self, r: SimRequest, lo: int, hi: int) -> None:
        chain = r.chain
        if self.owns_index:  # the simulator's: its chains are the blocks' p2pnode hashes, nothing to hash again
            self.index.store_hashed(chain[lo:hi], chain[lo - 1] if lo else None)  # type: ignore[union-attr]
            return
        self.emit(
            BlockStored(
                engine_block_hashes=tuple(chain[lo:hi]),
                parent_engine_hash=chain[lo - 1] if lo else None,
                token_ids=self.token_source(r, lo, hi),  # type: ignore[arg-type]
                block_size=self.block_size,
                namespace=getattr(r, "namespace", DEFAULT_NAMESPACE),  # the serving engine's requests carry one
            )
        )

    def store_prompt(self, r: SimRequest) -> None:
        """Prefill done: the prompt's full blocks past the reused prefix are now cached (and offered to the host
        tier, from the start unless it loaded some from a tier: ``tiers.py``)."""
        m = r.cached_tokens // self.block_size
        if r.n_prompt_blocks > m:
            self.store(r, m, r.n_prompt_blocks)
        tiers = self.tiers
        if tiers is not None and (r.segments is None or not r.segments.salted):
            tiers.offer(r.chain, r.tier_offer_from, r.n_prompt_blocks)

    def release(self, r: SimRequest) -> None:
        """``r`` finished: cache its full output blocks (offered to the host tier too unless it stores prompts
        only), then unpin its chain tail-first and free the rest."""
        n = r.n_blocks
        if n > r.n_prompt_blocks:
            self.store(r, r.n_prompt_blocks, n)
        tiers = self.tiers
        if tiers is not None and (r.segments is None or not r.segments.salted):
            if n > r.n_prompt_blocks and not tiers.config.prompt_only:
                tiers.offer(r.chain, max(r.n_prompt_blocks, r.tier_offer_from), n)
            tiers.finish(r.chain, n)
        self._unpin(r, n)

    def abandon(self, r: SimRequest) -> None:
        """``r`` was aborted before its prefill completed: unpin its reused prefix, free its reserved blocks."""
        self._unpin(r, r.cached_tokens // self.block_size)

    def _unpin(self, r: SimRequest, n: int) -> None:
        """Drop ``r``'s reference on its first ``n`` chain blocks (last first: eviction order) and free its
        anonymous blocks; blocks no request references any more become evictable."""
        freed = unpin(self.refs, r.chain, n)
        if freed:
            self.n_pinned -= len(freed)
            self.policy.unpinned(freed)
        self.free += r.anon_blocks
        r.anon_blocks = 0
