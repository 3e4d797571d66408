"""Choosing the eviction policy from live traffic: shadow caches of every candidate, replaying this node's stream.

Each admitted request's blocks (hashes only: no prompt text, no request type) are served by one ``ReplayCache``
per candidate policy, at the real cache's capacity; each shadow keeps an exponentially decayed token-weighted hit
rate (half-life ``half_life`` sampled requests). Every ``period`` sampled requests, once ``min_requests`` were
seen, the selector compares them: a challenger that beats the active policy by more than ``margin`` at ``confirm``
decisions in a row becomes the active policy (hysteresis: policies within noise of each other never flap). Ties go
to the earlier candidate (LRU first).

Bounded cost (SHARDS, Waldspurger et al., FAST 2015, spatial sampling): when the cache holds more than
``shadow_max_blocks`` blocks, only requests whose *first* block's hash falls below ``rate * 2^64`` are replayed,
into shadows of ``rate * capacity`` blocks, ``rate = shadow_max_blocks / capacity``. Sampling by the first block,
not block by block, keeps prefix trees whole -- a prefix hit needs every block before it, so a shadow holding a
sampled block but not its parent would count hits no cache sees. The price is variance when a few prefixes carry
most traffic; below the bound (the default covers 256k tokens at 16-token blocks) nothing is sampled and the
shadows are exact replays. Memory: candidates x shadow blocks x ~3 entries; CPU: candidates x blocks per request.

Invariant: ``active`` is always a candidate; it changes only in ``observe``, and only as described above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from p2pnode.cache.block_hash import mix64
from p2pnode.cache.eviction.registry import get_static
from p2pnode.cache.eviction.replay import ReplayCache
from p2pnode.config import EvictionConfig

__all__ = ["PolicySelector", "SelectorSnapshot"]


@dataclass(frozen=True, slots=True)
class SelectorSnapshot:
    """What ``p2pnode status`` and /metrics show: the choice, each shadow's recent hit rate, the counters."""

    active: str
    hit_rates: dict[str, float]  # candidate -> decayed token-weighted hit rate of its shadow
    observed: int  # requests offered to the selector
    sampled: int  # of those, replayed by the shadows
    switches: int
    sample_rate: float
    shadow_blocks: int  # capacity of each shadow


class PolicySelector:
    """Shadow caches of every candidate at the real capacity and the hysteresis that picks the active policy."""

    def __init__(self, capacity_blocks: int, config: EvictionConfig | None = None, initial: str | None = None):
        cfg = config if config is not None else EvictionConfig()
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.config = cfg
        self.candidates = tuple(cfg.candidates)
        self.sample_rate = min(1.0, cfg.shadow_max_blocks / capacity_blocks)
        self._threshold = int(self.sample_rate * (1 << 64))
        self.shadow_blocks = max(1, round(capacity_blocks * self.sample_rate))
        self.shadows = {n: ReplayCache(self.shadow_blocks, get_static(n)) for n in self.candidates}
        self._decay = 0.5 ** (1.0 / cfg.half_life)
        self._hits = dict.fromkeys(self.candidates, 0.0)
        self._tokens = 0.0
        self.active = initial if initial is not None else self.candidates[0]
        if self.active not in self.shadows:
            raise ValueError(f"initial policy {self.active!r} is not a candidate")
        self.observed = 0
        self.sampled = 0
        self.switches = 0
        self._lead: str | None = None
        self._lead_count = 0

    def observe(self, blocks: Sequence[int], lookup: int, prompt_blocks: float) -> str | None:
        """Replay one admitted request (its cached-after blocks, how many may hit, prompt length in blocks).

        Returns the new active policy when this request's decision switched, else None.
        """
        self.observed += 1
        if not blocks or (self._threshold < (1 << 64) and mix64(blocks[0]) >= self._threshold):
            return None
        self.sampled += 1
        d = self._decay
        hits = self._hits
        for name, shadow in self.shadows.items():
            hits[name] = hits[name] * d + shadow.request(blocks, lookup)
        self._tokens = self._tokens * d + prompt_blocks
        if self.sampled >= self.config.min_requests and self.sampled % self.config.period == 0:
            return self._decide()
        return None

    def hit_rates(self) -> dict[str, float]:
        t = self._tokens
        return {n: (h / t if t else 0.0) for n, h in self._hits.items()}

    def _decide(self) -> str | None:
        rates = self.hit_rates()
        best = max(self.candidates, key=lambda n: (rates[n], n == self.active, -self.candidates.index(n)))
        if best == self.active or rates[best] <= rates[self.active] + self.config.margin:
            self._lead, self._lead_count = None, 0
            return None
        if best == self._lead:
            self._lead_count += 1
        else:
            self._lead, self._lead_count = best, 1
        if self._lead_count < self.config.confirm:
            return None
        self.active = best
        self.switches += 1
        self._lead, self._lead_count = None, 0
        return best

    def snapshot(self) -> SelectorSnapshot:
        return SelectorSnapshot(
            self.active,
            self.hit_rates(),
            self.observed,
            self.sampled,
            self.switches,
            self.sample_rate,
            self.shadow_blocks,
        )
