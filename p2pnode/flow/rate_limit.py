"""Per-tenant rate limits: a token bucket for requests and one for tokens, drained by the whole mesh's admissions.

A bucket holds ``burst_s`` seconds of its rate (at least one request) and refills continuously. A request is
admitted when both of its tenant's buckets hold what it needs -- one request, and its tokens (a request larger than
the token bucket can ever hold needs a full bucket, so a big prompt is slowed, never refused for good) -- and is then
charged; otherwise nothing is charged and the answer is how long until it would be admitted, which becomes the
``Retry-After`` a client is told. ``consume`` charges what other nodes admitted for the tenant (they gossip it), and
may drive a bucket below zero: a tenant over its limit mesh-wide waits until the mesh's debt has refilled, at
whichever node it asks.

Invariants: a bucket's level never exceeds its capacity; a limit of 0 is no limit (no bucket is kept); at most
``max_tenants`` tenants are tracked, the least recently used forgotten first (forgetting gives a tenant a full
bucket, which bounds the memory a flood of made-up tenant names can take, at the price of one burst each).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

#: Seconds of its rate a bucket holds (the burst a tenant may send at once after a quiet spell).
DEFAULT_BURST_S = 1.0
#: Tenants tracked at once (two buckets each, ~200 bytes).
DEFAULT_MAX_TENANTS = 10_000


@dataclass(frozen=True, slots=True)
class RateLimit:
    """A tenant's limits; 0 is unlimited."""

    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0
    burst_s: float = DEFAULT_BURST_S

    def __post_init__(self) -> None:
        for name in ("requests_per_s", "tokens_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not (math.isfinite(self.burst_s) and self.burst_s > 0):
            raise ValueError(f"burst_s must be a finite number > 0, got {self.burst_s}")

    @property
    def limited(self) -> bool:
        return self.requests_per_s > 0 or self.tokens_per_s > 0


class TokenBucket:
    """``capacity`` units refilled at ``rate`` per second; the level may go below zero (debt), never above capacity."""

    __slots__ = ("capacity", "level", "rate", "updated")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self.updated = now

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until the bucket holds ``amount`` (capped at its capacity); 0 when it does now."""
        need = min(amount, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate


class _Buckets:
    __slots__ = ("requests", "tokens")

    def __init__(self, limit: RateLimit, now: float) -> None:
        self.requests = (
            TokenBucket(limit.requests_per_s, max(limit.requests_per_s * limit.burst_s, 1.0), now)
            if limit.requests_per_s > 0
            else None
        )
        self.tokens = (
            TokenBucket(limit.tokens_per_s, limit.tokens_per_s * limit.burst_s, now) if limit.tokens_per_s > 0 else None
        )


class TenantRateLimits:
    """A token bucket pair (requests, tokens) per tenant, bounded to ``max_tenants`` (least recently used forgotten)."""

    def __init__(self, limit_of: Callable[[str], RateLimit], max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self._limit_of = limit_of
        self.max_tenants = max_tenants
        self._tenants: OrderedDict[str, _Buckets] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tenants)

    def _buckets(self, tenant: str, now: float) -> _Buckets | None:
        buckets = self._tenants.get(tenant)
        if buckets is None:
            limit = self._limit_of(tenant)
            if not limit.limited:
                return None
            buckets = self._tenants[tenant] = _Buckets(limit, now)
            if len(self._tenants) > self.max_tenants:
                self._tenants.popitem(last=False)
        else:
            self._tenants.move_to_end(tenant)
        for bucket in (buckets.requests, buckets.tokens):
            if bucket is not None:
                bucket.refill(now)
        return buckets

    def admit(self, tenant: str, tokens: float, now: float) -> float:
        """0.0: admitted, one request and ``tokens`` charged; otherwise the seconds until it would be admitted
        (Retry-After), nothing charged."""
        buckets = self._buckets(tenant, now)
        if buckets is None:
            return 0.0
        wait = max(
            buckets.requests.wait_for(1.0) if buckets.requests is not None else 0.0,
            buckets.tokens.wait_for(tokens) if buckets.tokens is not None else 0.0,
        )
        if wait > 0:
            return wait
        self._charge(buckets, 1.0, tokens)
        return 0.0

    def consume(self, tenant: str, requests: float, tokens: float, now: float) -> None:
        """Charge usage admitted elsewhere in the mesh; may drive the buckets below zero."""
        buckets = self._buckets(tenant, now)
        if buckets is not None:
            self._charge(buckets, requests, tokens)

    @staticmethod
    def _charge(buckets: _Buckets, requests: float, tokens: float) -> None:
        if buckets.requests is not None:
            buckets.requests.level -= requests
        if buckets.tokens is not None:
            buckets.tokens.level -= tokens
